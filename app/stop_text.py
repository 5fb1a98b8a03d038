"""Stop strings, cut as OpenAI cuts them: the reply ends right before the first stop string it contains, which is
left out; the text is the same however the reply's pieces (tokens, rounds) split it.

"First" is the stop string completed first as the text grows (the occurrence that ends first; of two that end at
the same character, the one that starts first). While a reply streams, text that could still be the start of a
stop string is held back until the next pieces tell (`StopText.add`), so nothing after the cut is ever sent.
"""

from __future__ import annotations

from typing import Sequence


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where `text` is cut: the start of the stop string that ends first (searched from `start`), or None."""
    best = None  # (end, start)
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return None if best is None else best[1]


def held_back(text: str, stops: Sequence[str], start: int = 0) -> int:
    """How many characters at the end of text[start:] could begin a stop string (the longest such suffix)."""
    tail, longest = text[start:], 0
    if not tail:
        return 0
    for s in stops:
        for k in range(min(len(s) - 1, len(tail)), longest, -1):  # the longest first; shorter than found: no use
            if s[k - 1] == tail[-1] and tail.endswith(s[:k]):
                longest = k
                break
    return longest


class StopText:
    """A reply's text as its pieces come: `add(piece)` returns the text now safe to send; `hit` once a stop string
    completed (nothing more is sent: the reply is over); `finish()` sends what was held back when none came."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # the reply so far (cut at the stop once one is hit)
        self.sent = 0  # characters of text returned so far
        self.hit: str | None = None  # the stop string that ended the reply

    def add(self, piece: str) -> str:
        if self.hit is not None or not piece:
            return ""
        self.text += piece
        if not self.stops:
            return self._send(len(self.text))
        cut = first_stop(self.text, self.stops, self.sent)  # no stop can start in text already sent (held back)
        if cut is not None:
            self.hit = min((s for s in self.stops if self.text.startswith(s, cut)), key=len)
            self.text = self.text[:cut]
            return self._send(cut)
        return self._send(len(self.text) - held_back(self.text, self.stops, self.sent))

    def finish(self) -> str:
        """The rest of the text, held back as a possible stop string's start (no more pieces come)."""
        return "" if self.hit is not None else self._send(len(self.text))

    def _send(self, upto: int) -> str:
        out, self.sent = self.text[self.sent : upto], max(self.sent, upto)
        return out
