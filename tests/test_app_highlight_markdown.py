"""Replies render as markdown (lists, emphasis, headings, code, tables), sanitised, safe to render at any point
of a stream, with the characters of accepted draft tokens highlighted. CPU only, no model."""

from __future__ import annotations

import html
import re

from html_checks import elements

from app import markdown_render
from app.highlight import Reply, plain_text, render
from app.markdown_render import (
    TAGS,
    accepted_bytes,
    cut_points,
    markdown_html,
    pieces,
    render_piece,
)

ACC = re.compile(r'<span class="acc">(.*?)</span>')


def highlighted(out: str) -> list[str]:
    """The texts inside highlight spans, in order."""
    return [html.unescape(s) for s in ACC.findall(out)]


def words(s: str) -> str:
    return re.sub(r"[^0-9A-Za-z]", "", s)


def everything(text: str) -> list[list[int]]:
    return [[0, len(text)]]


# markdown constructs -------------------------------------------------------------------------------------
def test_numbered_list_with_bold_titles_is_a_list_not_asterisks():
    out = render("1. **Speed**: fast\n2. **Safety**: lossless\n", [])
    assert out.startswith('<div class="eagle-tokens"><ol><li><strong>Speed</strong>: fast</li>')
    assert out.count("<li>") == 2 and "*" not in plain_text(out)


def test_bold_italic_and_headings():
    out = render("# Title\n\n## Part *one*\n\nSome **bold**, *italic* and ***both***.", [])
    assert "<h1>Title</h1>" in out and "<h2>Part <em>one</em></h2>" in out
    assert "<strong>bold</strong>" in out and "<em>italic</em>" in out and "<em><strong>both</strong></em>" in out


def test_inline_and_fenced_code_keep_their_text_and_lines():
    text = "Use `a < b && c` here:\n\n```python\ndef f():\n\n    return '<b>'\n```\n\n    indented()\n"
    out = render(text, [])
    assert "<code>a &lt; b &amp;&amp; c</code>" in out
    assert '<pre><code class="language-python">def f():&#10;&#10;    return \'&lt;b&gt;\'&#10;</code></pre>' in out
    assert "<pre><code>indented()&#10;</code></pre>" in out
    assert "\n" not in out  # one line: the chat's markdown step passes it through as one HTML block


def test_tables_render_with_their_alignment():
    out = render("| name | value |\n|:-----|------:|\n| alpha | `1` |\n| beta | **2** |\n", [])
    tags = [t for t, _ in elements(out)]
    assert tags.count("th") == 2 and tags.count("td") == 4 and tags.count("tr") == 3
    assert '<th style="text-align:left">name</th>' in out and '<td style="text-align:right"><code>1</code></td>' in out


def test_paragraph_lines_stay_lines():
    out = render("roses are red\nviolets are blue", [])
    assert out == '<div class="eagle-tokens"><p>roses are red<br>violets are blue</p></div>'


# streaming ------------------------------------------------------------------------------------------------
def test_half_written_constructs_render_without_losing_text():
    assert "<pre><code>def f():&#10;    return 1</code></pre>" in render("```\ndef f():\n    return 1", [])
    assert "<p>Some **bold</p>" in render("Some **bold", [])
    header_only = render("| a | b |\n|---|---|", [])
    assert "<th>a</th><th>b</th>" in header_only and "<tbody>" not in header_only
    assert "| a | b |" in plain_text(render("| a | b |\n|--", []))
    assert plain_text(render("See [the docs](https://exa", [])) == "See [the docs](https://exa"


DOC = (
    "# Title\n\nSome **bold** and *it* text with `code`.\n\n- one\n- two **x**\n\n1. first\n\n2. second\n\n"
    "| h1 | h2 |\n|----|:--:|\n| c1 | c2 |\n\n```\nfn main() {}\n\nlet x = 1;\n```\n\n> quoted _words_\n\nEnd.\n"
)


def test_every_prefix_of_a_reply_renders_and_keeps_its_words():
    for k in range(len(DOC) + 1):
        out = markdown_html(DOC[:k], everything(DOC[:k]))
        assert "\n" not in out
        without_numbers = re.sub(r"(?m)^\d+\.(?: |$)", "", DOC[:k])  # the list's numbers come from CSS
        assert words(plain_text(out)) == words(without_numbers), DOC[:k]


TRICKY = (
    "Intro paragraph\n\n1. loose\n\n2. list\n   - nested\n\n3. end\n\n- other kind\n\n1) and another\n\n"
    "-\n\n\n- after an empty item\n\n- a\n\n- - -\n\n> quote\n\n> another\n\nSetext\n======\n\n"
    "    indented\n\n    code\n\n| a |\n|---|\n| b |\n\n- item\n  ```\n  nested fence\n\nafter the list\n"
    "  ```\n\ninside a real fence\n\nstill inside\n```\n\nlast *words*\n"
)


def test_pieces_render_as_the_whole_reply(monkeypatch):
    monkeypatch.setattr(markdown_render, "MIN_PIECE", 0)  # cut wherever it may
    cuts = cut_points(TRICKY)
    assert TRICKY.index("2. list") in cuts and TRICKY.index("3. end") in cuts  # a loose list cut (and joined)
    assert TRICKY.index("inside a real") in cuts  # fence_spans guesses wrong here: pieces sees it
    for k in range(len(TRICKY) + 1):
        text = TRICKY[:k]
        acc = accepted_bytes(k, [[i, i + 2] for i in range(0, k, 5)])
        assert "".join(p.html for p in pieces(text, acc)) == render_piece(text, acc).html, text


def test_a_streamed_list_renders_only_its_new_piece():
    item = "**A point** unique to this test, long enough to make a piece of its own with the next words. " * 6
    text = "".join(f"{i}. {item}\n\n" for i in range(1, 5)) + "5. The last"
    markdown_html(text, [])
    before = render_piece.cache_info()
    out = markdown_html(text + " one", [])
    after = render_piece.cache_info()
    assert after.misses - before.misses == 1  # 5 pieces: only the last one is new
    assert out.count("<ol>") == 1 and out.count("<li><p><strong>A point</strong>") == 4  # one loose list


# safety ---------------------------------------------------------------------------------------------------
def test_html_and_script_in_a_reply_are_text_never_elements():
    reply = (
        "<script>alert(1)</script>\n\n<img src=x onerror=alert(1)> <b>bold?</b> <a href='javascript:alert(1)'>a</a>\n\n"
        "[click](javascript:alert(1)) ![pic](http://example.com/p.png) [ok](https://example.com) `<i>`\n\n"
        "<div onclick=\"x()\">d</div>\n\n```html\n<script>alert(2)</script>\n```\n"
    )
    out = render(reply, everything(reply))
    found = elements(out)
    assert {tag for tag, _ in found} <= TAGS | {"div"} and [t for t, _ in found].count("div") == 1  # the wrapper
    assert not {"script", "img", "b", "i"} & {tag for tag, _ in found}
    assert not [name for _, attrs in found for name in attrs if name.startswith("on")]
    assert [attrs["href"] for tag, attrs in found if tag == "a"] == ["http://example.com/p.png", "https://example.com"]
    shown = plain_text(out)
    assert "<script>alert(1)</script>" in shown and "<img src=x onerror=alert(1)>" in shown
    assert "<script>alert(2)</script>" in shown and "[click](javascript:alert(1))" in shown


# highlights -----------------------------------------------------------------------------------------------
class _Pieces:
    """A tokenizer whose ids index a list of text pieces."""

    def __init__(self):
        self.vocab: list[str] = []

    def ids(self, pieces: list[str]) -> list[int]:
        self.vocab += pieces
        return list(range(len(self.vocab) - len(pieces), len(self.vocab)))

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.vocab[i] for i in ids)


def reply_of(rounds: list[list[str]]) -> Reply:
    """A reply decoded in `rounds`: in each, every token but the last was drafted by EAGLE and accepted."""
    tok = _Pieces()
    reply = Reply(tok)
    for pieces_ in rounds:
        reply.add_round(tok.ids(pieces_), accepted=len(pieces_) - 1)
    return reply


def test_highlights_land_on_the_characters_of_accepted_tokens():
    reply = reply_of([["1."], [" **", "Fast", " path", "**"], [":"], [" use", " `"], ["x", " <"], [" y", "`"],
                      [" now"], ["\n\n```\n", "code", " here"], ["\n```\n"]])  # fmt: skip
    assert reply.text == "1. **Fast path**: use `x < y` now\n\n```\ncode here\n```\n"
    out = render(reply.text, reply.marks)
    assert highlighted(out) == ["Fast path", " use", "x", " y", "code"]
    assert '<li><strong><span class="acc">Fast path</span></strong>:<span class="acc"> use</span> <code>' in out
    assert '<code><span class="acc">x</span> &lt;<span class="acc"> y</span></code> now</li>' in out
    assert '<pre><code><span class="acc">code</span> here&#10;</code></pre>' in out


def test_highlights_skip_syntax_that_looks_like_the_text():
    text = "## #1 pick\n\n- -5 degrees\n\n```python\nprint(1)\n```\n"
    marks = [[text.index("#1"), text.index("#1") + 2], [text.index("-5"), text.index("-5") + 2],
             [text.index("print"), text.index("print") + 1]]  # fmt: skip
    out = render(text, marks)
    assert '<h2><span class="acc">#1</span> pick</h2>' in out
    assert '<li><span class="acc">-5</span> degrees</li>' in out
    assert '<span class="acc">p</span>rint(1)' in out


def test_an_entity_in_the_source_does_not_shift_later_highlights():
    text = "AT&amp;T &copy; said **yes**"
    out = render(text, [[text.index("yes"), len(text) - 2]])
    assert highlighted(out) == ["yes"] and "AT&amp;T © said" in out


def test_whitespace_only_accepted_runs_are_not_wrapped():
    text = "one two\n\n- three  four\n\n```\na\n\n  b\n```"
    spaces = [[m.start(), m.end()] for m in re.finditer(r"\s+", text)]
    assert "acc" not in render(text, spaces)
    assert highlighted(render(text, [[3, 7]])) == [" two"]  # a run with text keeps its leading space


def test_plain_toggle_drops_the_highlights_and_still_sanitises():
    text = "**x**\n- <b>y</b> <img src=x onerror=alert(1)>"
    plain = render(text, everything(text), highlight=False)
    assert plain == render(text, [], highlight=True)  # the same rendering, no highlights
    assert "<strong>x</strong>" in plain and "acc" not in plain
    assert "<img" not in plain and "<b>" not in plain and "&lt;b&gt;" in plain
    assert render("", [], True) == '<div class="eagle-tokens"></div>'
