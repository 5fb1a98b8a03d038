"""The longest earlier occurrence of a growing token sequence's end, for context drafts (context_draft.py).

`ContextIndex` holds the sequence S (prompt token ids, then reply token ids) and a suffix automaton of it: lists
indexed by state (state 0 is the root, the empty string) of transitions (dict token -> state), suffix link, `length`
(the longest string of the state) and `pos` (an end position, see below). Every substring of S is read from the
root along transitions; the strings of one state are the suffixes of its longest string with lengths
(length[link], length], and they share one set of end positions, endpos.

After S[0..i] has been appended (n = i + 1 tokens):
  * `_last` is the state of the whole of S; L = length[link[_last]] is the length of the longest suffix of S that
    also ends before i (the link of the whole sequence's state is the longest suffix with two or more end positions).
  * `_tail` is the state that holds the suffix of S of length min(n, max_match).
  * a state is *short* when length[link] < max_match (it holds a string of at most max_match tokens). For every short
    state, pos is exactly the largest position in its endpos: the most recent end of its strings. pos of the other
    (long) states is never read. A state only ever goes from short to long (its link is replaced by a longer clone).
  * the answer for the current sequence, (`_match`, `_end`): match = min(L, max_match), and `_end` = the largest
    p < i at which S's suffix of that length ends (-1 when match is 0).

propose(limit) returns S[_end + 1 : _end + 1 + limit]: the tokens that followed the most recent earlier occurrence of
the sequence's last `match` tokens, where match is the longest suffix that occurred before, capped at max_match. So
past max_match tokens, recency wins over length: a 500-token match in the prompt loses to the last max_match tokens'
occurrence in the reply. The continuation may overlap the matched suffix (periodic text) and never passes S's end.

Cost: extend is amortised O(1) per token for the automaton and `_tail`, plus one walk from `_tail` to the root that
records the new end position in every short state it passes (these are exactly the short states whose endpos gains
it); that walk visits one state per distinct endpos class among the sequence's last max_match suffixes, so at most
max_match (a long run of one token), typically a few. propose is O(limit). Memory is O(n) states (at most 2n).
"""

from __future__ import annotations

from collections.abc import Iterable


class ContextIndex:
    """A token sequence that grows at its end, and for its end the most recent earlier occurrence of the longest
    suffix (capped at `max_match` tokens) that occurred before. See the module docstring for the invariants."""

    def __init__(self, tokens: Iterable[int] = (), max_match: int = 32):
        if max_match < 1:
            raise ValueError(f"max_match must be at least 1, got {max_match}")
        self.max_match = max_match
        self._tokens: list[int] = []
        self._next: list[dict[int, int]] = [{}]  # per state: token -> state
        self._link: list[int] = [-1]  # per state: the state of its longest suffix in another endpos class
        self._length: list[int] = [0]  # per state: length of its longest string
        self._pos: list[int] = [-1]  # per state: its most recent end position (exact for short states only)
        self._last = 0  # the state of the whole sequence
        self._tail = 0  # the state of the sequence's suffix of length min(len, max_match)
        self._match = 0  # min(L, max_match), L: longest suffix that also ends earlier
        self._end = -1  # the most recent earlier end of the sequence's last `_match` tokens; -1 when _match is 0
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the sequence; amortised O(len(tokens)) (no rescans of the whole sequence)."""
        seq, nxt, link, length, pos = self._tokens, self._next, self._link, self._length, self._pos
        cap = self.max_match
        last, tail = self._last, self._tail
        match, end = self._match, self._end
        for c in tokens:
            i = len(seq)
            seq.append(c)
            # suffix automaton extension by c (the standard online construction)
            cur = len(length)
            nxt.append({})
            link.append(0)
            length.append(length[last] + 1)
            pos.append(i)
            p = last
            while p != -1 and c not in nxt[p]:
                nxt[p][c] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][c]
                if length[p] + 1 == length[q]:
                    link[cur] = q
                else:  # split q: the clone takes q's strings up to length[p] + 1 (and q's endpos, plus i)
                    clone = len(length)
                    nxt.append(nxt[q].copy())
                    link.append(link[q])
                    length.append(length[p] + 1)
                    pos.append(pos[q])  # exact when the clone is short: then q was short, and endpos(q) is all before i
                    while p != -1 and nxt[p].get(c) == q:
                        nxt[p][c] = clone
                        p = link[p]
                    link[q] = link[cur] = clone
            last = cur
            # _tail: the state of the suffix of length min(i + 1, cap)
            if i < cap:
                tail = cur
            else:  # tail held s = S[i - cap .. i - 1]; s + c is a substring, its cap-long suffix is the new tail
                if length[link[tail]] >= cap:  # tail was split above and s went to the clone
                    tail = link[tail]
                w = nxt[tail][c]
                while length[link[w]] >= cap:
                    w = link[w]
                tail = w
            # the answer, read before i enters the pos of the states on the walk below
            v = link[cur]
            longest = length[v]
            if longest == 0:
                match, end = 0, -1
            elif longest < cap:
                match, end = longest, pos[v]  # v is short and holds exactly the matched suffix as its longest string
            else:
                match, end = cap, pos[tail]  # tail != cur: its string is a suffix of v's, so it occurred before
            # i joins the endpos of every state on cur's link path; the short ones are tail and its ancestors
            u = tail
            while u > 0:
                pos[u] = i
                u = link[u]
        self._last, self._tail = last, tail
        self._match, self._end = match, end

    def propose(self, limit: int) -> tuple[list[int], int]:
        """(continuation, match): the up-to-`limit` tokens that followed the most recent earlier occurrence of the
        longest suffix of the sequence that occurred before (that suffix capped at max_match tokens), and that
        suffix's length in tokens (capped at max_match; 0 and [] when the last token never occurred before).
        limit <= 0 gives [] and still the match. O(limit)."""
        if self._match == 0 or limit <= 0:
            return [], self._match
        start = self._end + 1
        return self._tokens[start : start + limit], self._match
