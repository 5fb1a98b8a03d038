"""A reply as rendered markdown, sanitised, with the characters of accepted draft tokens highlighted by source.

Pipeline, each step linear in the length of the text it is given:

1. markdown-it parses the reply: CommonMark plus tables, raw HTML off (every ``<`` of a reply is text),
   images off (a reply never makes the page load anything) and link reference definitions off (a
   definition line would vanish from the page). Any prefix of a reply parses: an unclosed fence is a code
   block to the end, a ``**bold`` without its end is literal text, so streaming never fails or drops text.
2. `Aligner` finds the source character of every rendered character. Rendered text is the source minus
   syntax (``**``, list markers, backticks, fence lines...), in the same order, so a forward scan that skips
   source characters finds each rendered one; each scan stays inside the lines of the block that the token
   came from, so a character the source spells differently (an entity such as ``&copy;``) costs at most
   that block and the alignment picks up again at the next block.
3. The renderer writes every text, inline code and code block with its runs of accepted characters in a
   span of their source's class: ``<span class="acc">`` for the head's drafts, ``<span class="ctx">`` for
   context copies (a run ends where the source changes); whitespace-only runs stay plain.
4. nh3 keeps only the tags and attributes that this renderer writes: the second wall after markdown-it's
   escaping, so no HTML or script from a reply ever becomes an element.
5. The block goes on one line: newlines inside ``<pre>`` become ``&#10;``, the others (between tags) go.
   The chat renders its messages as markdown; a one-line HTML block passes that step unchanged.

Streaming renders the growing reply again every round, so the reply is cut into pieces at lines where
every markdown block but a list is closed (`cut_points`), each rendered on its own and cached
(`render_piece`), a list that goes on across a cut joined back into one: the HTML is the same as the whole
reply's (tests/test_app_highlight_markdown.py checks it), and a round parses only the last piece.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import nh3
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml, unescapeAll

# Where a reply's character came from, one byte per character ("flags"): the base's own token, a draft of the
# head accepted, or a context copy accepted (an earlier stretch of the prompt or reply,
# eagle/decoding/context_draft.py).
BASE, HEAD, CONTEXT = 0, 1, 2
SOURCE_CLASS = {HEAD: "acc", CONTEXT: "ctx"}  # the span class of each accepted source (styles: assets/app.css)
SPAN_CLOSE = "</span>"
ANCHOR = 8  # rendered characters looked up together, to step over syntax that repeats the text's first one
ANCHOR_SLACK = 8  # how much further the anchored match may lie: the longest syntax before text ("###### ")

MIN_PIECE = 512  # characters at least in a piece (but the last): fewer pieces cost less; a round renders one

NEWLINE = re.compile(r"\r\n?|\n")  # markdown-it's own line split
SPACES = re.compile(r"\s+")
WORD = re.compile(r"[^\W_]")  # a letter or a digit
ACCEPTED_RUN = re.compile(rb"\x01+|\x02+")  # a run of one accepted source
PRE = re.compile(r"(<pre\b.*?</pre>)", re.DOTALL)  # markdown never nests <pre>; "<" in code text is "&lt;"
BLANK_THEN_TEXT = re.compile(r"\n[ \t]*\n(?=\S)")  # ends where a line follows a blank one at column 0
LIST_MARKER = re.compile(r"(?:[-+*]|\d{1,9}[.)])(?:[ \t\r\n]|$)")  # how a list item's line starts
FENCE_LINE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$", re.MULTILINE)

# What this renderer writes (markdown-it's CommonMark + tables, and the highlight span); nothing else passes.
TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "ul", "ol", "li", "blockquote", "hr", "br", "strong", "em",
        "code", "pre", "a", "table", "thead", "tbody", "tr", "th", "td", "span"}  # fmt: skip
ATTRIBUTES = {"a": {"href", "title"}, "ol": {"start"}, "code": {"class"}, "th": {"style"}, "td": {"style"},
              "span": {"class", "title"}}  # fmt: skip
CLEANER = nh3.Cleaner(tags=TAGS, attributes=ATTRIBUTES, url_schemes={"http", "https", "mailto"},
                      filter_style_properties={"text-align"}, link_rel="noopener noreferrer nofollow")  # fmt: skip


class Aligner:
    """Maps rendered text back onto the source, in document order, to say which characters were accepted.

    Invariant: `pos` only moves forward, so the whole text costs one pass over the source (plus, for a
    rendered character that the source spells differently, one scan to the end of its block)."""

    def __init__(self, source: str, accepted: bytes):
        self.source, self.accepted = source, accepted  # accepted: 1 byte per source character (BASE, HEAD, CONTEXT)
        self.line_starts = [0, *(m.end() for m in NEWLINE.finditer(source))]
        self.pos, self.end = 0, len(source)

    def enter(self, lines: list[int] | None, skip: int = 0) -> None:
        """Scan only lines [first + skip, last) of the source next (a token's `map`; None: keep the last)."""
        if lines is None:
            return
        first, last = lines
        self.pos = max(self.pos, self.offset(first + skip))
        self.end = self.offset(last)

    def offset(self, line: int) -> int:
        """Where source line `line` starts (the source's length for a line past its end)."""
        return self.line_starts[line] if line < len(self.line_starts) else len(self.source)

    def flags(self, text: str) -> bytes:
        """One byte per character of rendered `text`: the flag of the source character it came from (BASE where it
        has none)."""
        out = bytearray(len(text))
        i = 0
        while i < len(text):
            if text[i].isspace():
                i = self._spaces(text, i, out)
                continue
            p = self._find(text, i)
            if p < 0:  # spelled differently in the source (an entity): not marked, and the scan stays put
                i += 1
                continue
            n = self._same(text, i, p)
            out[i : i + n] = self.accepted[p : p + n]
            i, self.pos = i + n, p + n
        return bytes(out)

    def _spaces(self, text: str, i: int, out: bytearray) -> int:
        """Match the whitespace run at `text[i]` with the next whitespace run of the source, whatever its
        characters (a tab comes out as spaces, a newline in inline code as a space, CR LF as LF); return
        where the run ends."""
        j = SPACES.match(text, i).end()
        m = SPACES.search(self.source, self.pos, self.end)
        if m:
            a, b = m.span()
            n = min(j - i, b - a)
            out[i : i + n] = self.accepted[a : a + n]
            out[i + n : j] = self.accepted[b - 1 : b] * (j - i - n)  # a run that came out longer
            self.pos = b
        return j

    def _find(self, text: str, i: int) -> int:
        """Where `text[i]` (not whitespace) comes from in the source, at or after `pos` (-1: nowhere in
        this block). When the next few rendered characters appear together a little further on, past
        nothing but syntax (no letters or digits), that place wins: it steps over syntax that starts
        like the text (``## #1``, ``- -1``)."""
        src, pos, end = self.source, self.pos, self.end
        first = src.find(text[i], pos, end)
        anchor = text[i : i + ANCHOR]
        if first < 0 or len(anchor) == 1:
            return first
        anchored = src.find(anchor, first, min(end, first + ANCHOR_SLACK + len(anchor)))
        return anchored if anchored > first and not WORD.search(src, first, anchored) else first

    def _same(self, text: str, i: int, p: int) -> int:
        """How many characters of `text[i:]` and the source from `p` agree (at least 1: the found one)."""
        src, end = self.source, self.end
        if src.startswith(text[i:], p, end):
            return len(text) - i
        lo, hi = 1, min(len(text) - i, end - p)  # they agree on lo characters and not on hi + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if src.startswith(text[i : i + mid], p, end):
                lo = mid
            else:
                hi = mid - 1
        return lo


def marked_html(text: str, flags: bytes) -> str:
    """Escaped `text` with each run of characters of one accepted source (flags HEAD or CONTEXT) in that source's
    span, except runs of whitespace alone (a highlighted space or newline shows as an empty coloured block)."""
    out, pos = [], 0
    for run in ACCEPTED_RUN.finditer(flags):
        a, b = run.span()
        if text[a:b].isspace():
            continue
        opening = f'<span class="{SOURCE_CLASS[flags[a]]}">'
        out += [escapeHtml(text[pos:a]), opening, escapeHtml(text[a:b]), SPAN_CLOSE]
        pos = b
    out.append(escapeHtml(text[pos:]))
    return "".join(out)


# markdown-it: the parser, the alignment pass over its tokens, and render rules that use the alignment ------
def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "breaks": True}).enable("table").disable(["image", "reference"])
    for name, rule in (("text", _text), ("code_inline", _code_inline), ("code_block", _code_block), ("fence", _fence)):
        md.add_render_rule(name, rule)
    return md


# render rules: (renderer, tokens, index, options, env) -> HTML; the flags come from `align`
def _marked(token) -> str:
    return marked_html(token.content, token.meta.get("flags", b""))


def _text(_, tokens, i, *__) -> str:
    return _marked(tokens[i])


def _code_inline(_, tokens, i, *__) -> str:
    return f"<code>{_marked(tokens[i])}</code>"


def _code_block(_, tokens, i, *__) -> str:
    return f"<pre><code>{_marked(tokens[i])}</code></pre>\n"


def _fence(_, tokens, i, *__) -> str:
    lang = unescapeAll(tokens[i].info).strip().split(maxsplit=1)
    attr = f' class="language-{escapeHtml(lang[0])}"' if lang else ""
    return f"<pre><code{attr}>{_marked(tokens[i])}</code></pre>\n"


def align(tokens, aligner: Aligner) -> None:
    """Store in each text-bearing token's meta["flags"] which of its characters were accepted.

    Tokens come in document order; text lives in the children of `inline` tokens (paragraphs, headings,
    table cells) and in `fence` / `code_block` tokens, each with the source lines it came from in `map`."""
    for token in tokens:
        if token.type == "inline":
            aligner.enter(token.map)
            for child in token.children or ():
                if child.type in ("text", "code_inline"):
                    child.meta["flags"] = aligner.flags(child.content)
        elif token.type in ("fence", "code_block"):
            aligner.enter(token.map, skip=1 if token.type == "fence" else 0)  # a fence's text starts below ```
            token.meta["flags"] = aligner.flags(token.content)


def one_line(html: str) -> str:
    """`html` without newlines: inside <pre> they are text (kept as ``&#10;``), elsewhere markdown-it's
    layout between tags (breaks=True turns the text's own newlines into <br>), so they go."""
    parts = PRE.split(html)  # [outside, pre, outside, pre, ..., outside]
    return "".join(p.replace("\n", "&#10;") if k % 2 else p.replace("\n", "") for k, p in enumerate(parts))


MD = _parser()


JOIN_BEFORE, JOIN_AFTER = 1, 2  # a piece's first / last block is a list that goes on in the previous / next


@dataclass(frozen=True)
class Parsed:
    tokens: list  # markdown-it's, text tokens aligned (meta["flags"]); never changed once made
    open_fence: bool  # the text ends inside a fenced code block that it opened
    last_item: int  # where the last item of the list that ends the text starts (-1: it ends with no list)


@dataclass(frozen=True)
class Piece:
    html: str  # sanitised, one line
    open_fence: bool  # as in Parsed
    last_item: int


@functools.lru_cache(maxsize=8)  # the last few pieces: one may be rendered again, joined to the next
def parse(text: str, accepted: bytes) -> Parsed:
    """markdown-it's tokens for `text`, aligned with it, and how the text ends (see Parsed)."""
    tokens = MD.parse(text)
    aligner = Aligner(text, accepted)
    align(tokens, aligner)
    last = tokens[-1] if tokens else None
    open_fence = last is not None and last.type == "fence" and last.map[1] >= text.count("\n")
    ends_list = last is not None and last.level == 0 and last.type.endswith("_list_close")
    item = next((t for t in reversed(tokens) if t.type == "list_item_open" and t.level == 1), None)
    return Parsed(tokens, open_fence, aligner.offset(item.map[0]) if ends_list else -1)


@functools.lru_cache(maxsize=2048)
def render_piece(text: str, accepted: bytes, joins: int = 0) -> Piece:
    """One stretch of a reply (or a whole one) rendered on its own; cached, as streaming asks again and again.

    `joins` (JOIN_BEFORE | JOIN_AFTER): the stretch's first / last list continues in the previous / next
    piece, so it is loose and its opening / closing tag belongs to that piece."""
    parsed = parse(text, accepted)
    html = one_line(CLEANER.clean(MD.renderer.render(loosened(parsed.tokens, joins), MD.options, {})))
    if joins & JOIN_BEFORE:
        html = html[html.index(">") + 1 :]  # <ul> or <ol start="n">: the previous piece opened the list
    if joins & JOIN_AFTER:
        html = html[: html.rindex("<")]  # </ul> or </ol>: the next piece closes it
    return Piece(html, parsed.open_fence, parsed.last_item)


@functools.lru_cache(maxsize=1024)
def continues_list(snippet: str) -> bool:
    """Whether `snippet` (a list's last item, the blank lines after it, and the line after those) is one
    list: that line is the list's next item, not a new block (another kind of list, a paragraph...)."""
    return sum(t.level == 0 and t.nesting >= 0 for t in MD.parse(snippet)) == 1


def loosened(tokens: list, joins: int) -> list:
    """`tokens` with the item paragraphs of the first (JOIN_BEFORE) / last (JOIN_AFTER) top-level list
    shown (as copies): a list cut between two items has a blank line there, which makes the whole list
    loose (<li><p>), whatever the items on either side of the cut say alone."""
    out = list(tokens)
    if joins & JOIN_BEFORE:
        close = next(i for i, t in enumerate(out) if t.level == 0 and t.nesting == -1)
        _show_paragraphs(out, 0, close)
    if joins & JOIN_AFTER:
        opening = max(i for i, t in enumerate(out) if t.level == 0 and t.nesting == 1)
        _show_paragraphs(out, opening, len(out))
    return out


def _show_paragraphs(tokens: list, start: int, end: int) -> None:
    for i in range(start, end):
        t = tokens[i]
        if t.hidden and t.level == 2 and t.type in ("paragraph_open", "paragraph_close"):  # list, item, p
            tokens[i] = t.copy(hidden=False)


# Where a reply may be cut into pieces that render on their own as they do in the whole ------------------
def fence_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of what looks like fenced code (a guess that ignores containers; `pieces` checks it)."""
    spans, opening = [], None  # opening: (offset, fence character, fence length)
    for m in FENCE_LINE.finditer(text):
        fence, rest = m.group(1), m.group(2)
        if opening is None and not (fence[0] == "`" and "`" in rest):  # a backtick fence's info has none
            opening = (m.start(), fence[0], len(fence))
        elif opening and fence[0] == opening[1] and len(fence) >= opening[2] and not rest.strip():
            spans.append((opening[0], m.end()))
            opening = None
    if opening:
        spans.append((opening[0], len(text)))
    return spans


def cut_points(text: str) -> list[int]:
    """Offsets of lines that follow a blank line and start at column 0, outside what looks like fenced
    code. Such a line closes every open block (paragraphs, quotes, tables, indented code, list items)
    except a fenced code block and a list that it continues with an item, so what comes before it renders
    alone as in the whole, but for that list (`pieces` joins it)."""
    spans, k, cuts = fence_spans(text), 0, []
    for m in BLANK_THEN_TEXT.finditer(text):
        at = m.end()
        while k < len(spans) and spans[k][1] <= at:
            k += 1
        if not (k < len(spans) and spans[k][0] < at):
            cuts.append(at)
    return cuts


def pieces(text: str, accepted: bytes) -> list[Piece]:
    """The reply rendered piece by piece, cut at `cut_points` into pieces of at least MIN_PIECE characters
    (but the last). A piece that ends inside fenced code (`fence_spans` guessed wrong) is not cut there: it
    grows to the next cut, so every cut kept is exact. A list that goes on across a cut is rendered as one
    (`render_piece` joins). So the pieces' HTML is the whole reply's."""
    out, start, joins = [], 0, 0
    for end in [*cut_points(text), len(text)]:
        if end - start < MIN_PIECE and end < len(text):
            continue
        piece = render_piece(text[start:end], accepted[start:end], joins)
        if piece.open_fence and end < len(text):
            continue
        goes_on = end < len(text) and piece.last_item >= 0 and _list_goes_on(text, start + piece.last_item, end)
        if goes_on:
            piece = render_piece(text[start:end], accepted[start:end], joins | JOIN_AFTER)
        joins = JOIN_BEFORE if goes_on else 0
        out.append(piece)
        start = end
    return out


def _list_goes_on(text: str, item: int, cut: int) -> bool:
    """Whether the line at `cut` is the next item of the list whose last item starts at `item` (< cut)."""
    if not LIST_MARKER.match(text, cut):
        return False
    line_end = NEWLINE.search(text, cut)
    return continues_list(text[item : line_end.start() if line_end else None])


def mark_source(mark) -> int:
    """The source of a mark: CONTEXT for [start, end, CONTEXT], else HEAD ([start, end]: a draft of the head)."""
    return CONTEXT if len(mark) > 2 and mark[2] == CONTEXT else HEAD


def accepted_bytes(length: int, marks: list[list[int]]) -> bytes:
    """1 byte per character of a `length`-character reply: each mark's source (`mark_source`) inside its
    [start, end) range, BASE elsewhere."""
    out = bytearray(length)
    for mark in marks:
        a, b = mark[0], min(mark[1], length)
        out[a:b] = bytes([mark_source(mark)]) * max(0, b - a)
    return bytes(out)


def markdown_html(text: str, marks: list[list[int]]) -> str:
    """The reply as one line of sanitised HTML: markdown rendered, accepted draft characters highlighted by their
    source (marks: [start, end] for the head's drafts, [start, end, CONTEXT] for context copies).

    While a reply streams, only its last piece (from its last cut point on) is new: the others come from
    the cache, so a round costs the new piece plus a linear pass of regular expressions and hashes."""
    body = "".join(p.html for p in pieces(text, accepted_bytes(len(text), marks)))
    return f'<div class="eagle-tokens">{body}</div>'
