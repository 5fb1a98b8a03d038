"""Tokens -> text -> HTML, with the tokens that EAGLE drafted (and the base accepted) highlighted.

`Detokenizer` turns a stream of token ids into text pieces incrementally: it decodes a short window of ids
and diffs the text, so a character split over several byte tokens appears once it is complete, and
tokenizers that change a word's leading space with context (SentencePiece) come out right.

`render` builds the chat message: plain markdown text, or, with highlighting on, one HTML block in which
every piece of text is html-escaped before it is wrapped in ``<span class="acc">``. The HTML keeps the
reply's layout without relying on the markdown parser (token boundaries cut through markdown syntax, so
spans around tokens break it): lines are kept with ``white-space: pre-wrap`` and fenced code blocks become
``<pre>`` blocks. The block is written on a single line (newlines as ``&#10;``) so that the chat's markdown
renderer passes it through as one HTML block. The styles live in ``assets/app.css``.
"""

from __future__ import annotations

import html
import re

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence gives


class Detokenizer:
    """Incremental decoding: `push(token)` returns the new text that token completes ("" while pending)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text that has been emitted
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if after.endswith(REPLACEMENT) or len(after) <= len(before):
            return ""  # an incomplete character (or a token with no text, e.g. a special one)
        if not after.startswith(before):  # should not happen with clean-up off; keep the text flowing
            common = 0
            while common < min(len(before), len(after)) and before[common] == after[common]:
                common += 1
            before = after[:common]
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]


class Reply:
    """The text of a reply so far and which characters came from accepted draft tokens."""

    def __init__(self, tokenizer):
        self.detok = Detokenizer(tokenizer)
        self.text = ""
        self.marks: list[list[int]] = []  # [start, end) character ranges drafted by EAGLE

    def add_round(self, tokens: list[int], accepted: int) -> None:
        for i, token in enumerate(tokens):
            piece = self.detok.push(token)
            if not piece:
                continue
            start, self.text = len(self.text), self.text + piece
            if i < accepted:
                if self.marks and self.marks[-1][1] == start:
                    self.marks[-1][1] = len(self.text)
                else:
                    self.marks.append([start, len(self.text)])


# ---------------------------------------------------------------------------------------------------------
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")

LEGEND_HTML = (
    '<div class="eagle-legend"><span class="acc">highlighted</span> drafted by EAGLE and accepted by the base '
    "model &nbsp;·&nbsp; plain: the base model's own token of each forward pass</div>"
)


def _escape(text: str) -> str:
    return html.escape(text, quote=True).replace("\n", "&#10;")


def _spans(text: str, start: int, marks: list[list[int]]) -> str:
    """Escaped `text` (which starts at character `start` of the reply) with the marked ranges wrapped."""
    end = start + len(text)
    out, pos = [], start
    for a, b in marks:
        if b <= pos or a >= end:
            continue
        a, b = max(a, pos), min(b, end)
        if a > pos:
            out.append(_escape(text[pos - start : a - start]))
        piece = text[a - start : b - start]
        # whitespace alone is not wrapped: a highlighted space or newline showed as an empty orange block
        out.append(_escape(piece) if piece.isspace() else f'<span class="acc">{_escape(piece)}</span>')
        pos = b
    if pos < end:
        out.append(_escape(text[pos - start :]))
    return "".join(out)


def blocks(text: str) -> list[tuple[str, int, str]]:
    """Split a reply into ("text" | "code" | "fence", start offset, content) blocks along fenced code."""
    out: list[tuple[str, int, str]] = []
    pos, in_code, fence = 0, False, ""
    for line in text.splitlines(keepends=True):
        m = FENCE.match(line)
        if m and (not in_code or (m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence))):
            in_code, fence = (not in_code), m.group(1)
            out.append(("fence", pos, line))
        else:
            kind = "code" if in_code else "text"
            if out and out[-1][0] == kind:
                k, s, content = out[-1]
                out[-1] = (k, s, content + line)
            else:
                out.append((kind, pos, line))
        pos += len(line)
    return out


def highlighted_html(text: str, marks: list[list[int]]) -> str:
    """One-line HTML block of the reply with accepted draft tokens in ``<span class="acc">``.

    Every character of `text` is kept (newlines as ``&#10;``), so `plain_text` gives the text back."""
    tags = {"code": ('<pre class="eagle-code"><code>', "</code></pre>"), "fence": ('<div class="eagle-fence">', "</div>"),
            "text": ('<span class="eagle-text">', "</span>")}  # fmt: skip
    parts = []
    for kind, start, content in blocks(text):
        open_tag, close_tag = tags[kind]
        parts.append(f"{open_tag}{_spans(content, start, marks)}{close_tag}")
    return f'<div class="eagle-tokens">{"".join(parts)}</div>'


def render(text: str, marks: list[list[int]], highlight: bool = True) -> str:
    """The assistant message: highlighted HTML, or the plain text (rendered as markdown by the chat)."""
    if not highlight:
        return text
    if not text:
        return '<div class="eagle-tokens"></div>'
    return highlighted_html(text, marks)


def plain_text(message_html: str) -> str:
    """The text of a highlighted message (tags dropped, entities decoded): for tests and API users."""
    return html.unescape(re.sub(r"<[^>]+>", "", message_html))
