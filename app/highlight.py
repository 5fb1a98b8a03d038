"""Tokens -> text -> HTML, with the tokens that EAGLE drafted (and the base accepted) highlighted by source.

`Detokenizer` turns a stream of token ids into text pieces incrementally: it decodes a short window of ids
and diffs the text, so a character split over several byte tokens appears once it is complete, and
tokenizers that change a word's leading space with context (SentencePiece) come out right.

`render` builds a reply's HTML, for the chat, the side-by-side panes and the `/chat` endpoint alike: the
markdown rendered here (`app.markdown_render`: lists, bold, headings, code and tables as HTML, sanitised), with
highlighting on the accepted characters, in ``<span class="acc">`` where the head drafted them and in
``<span class="ctx">`` where they were copied from the context (context drafts), on a single line (newlines as
``&#10;``) so that the chat's markdown renderer passes it through as one HTML block. The styles live in
``assets/app.css``.
"""

from __future__ import annotations

import html
import re

from .markdown_render import BASE, CONTEXT, HEAD, mark_source, markdown_html

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


def token_sources(count: int, accepted: int, context: int = 0) -> list[int]:
    """The source of each of a round's `count` tokens: the first `accepted` were drafted and accepted, the last
    `context` of those copied from the context (`Round.context`), the rest the base's own."""
    head = max(0, accepted - max(0, context))
    return [HEAD if i < head else CONTEXT if i < accepted else BASE for i in range(count)]


class Reply:
    """The text of a reply so far and which characters came from accepted draft tokens, and from which source.

    Invariant: `marks` are ascending, non-overlapping [start, end) ranges of one source each, [start, end] for the
    head's drafts and [start, end, CONTEXT] for context copies; two adjacent ranges of one source are one range."""

    def __init__(self, tokenizer):
        self.detok = Detokenizer(tokenizer)
        self.text = ""
        self.marks: list[list[int]] = []

    def add_round(self, tokens: list[int], accepted: int, context: int = 0) -> None:
        for token, source in zip(tokens, token_sources(len(tokens), accepted, context)):
            piece = self.detok.push(token)
            if piece:
                self._add(piece, source)

    def _add(self, piece: str, source: int) -> None:
        start, self.text = len(self.text), self.text + piece
        if source == BASE:
            return
        last = self.marks[-1] if self.marks else None
        if last is not None and last[1] == start and mark_source(last) == source:
            last[1] = len(self.text)
        else:
            self.marks.append([start, len(self.text)] + ([CONTEXT] if source == CONTEXT else []))


# ---------------------------------------------------------------------------------------------------------
LEGEND_HTML = (
    '<div class="eagle-legend"><span class="acc">highlighted</span> drafted by EAGLE\'s head and accepted by the '
    'base model &nbsp;·&nbsp; <span class="ctx">other shade</span>: copied from the context (the prompt or the '
    "reply so far) and accepted &nbsp;·&nbsp; plain: the base model's own token of each forward pass</div>"
)


# Gradio labels every chat message with its raw content (`aria-label="bot's message: <div class=...`), so a
# screen reader would read the reply's HTML tags. This page script (given to launch(js=...)) replaces each
# label that holds markup or entities with its text, again whenever Gradio sets it anew (each streamed
# update). A <template> parses the markup inert: nothing in it runs or loads. (Gradio has no option for
# the label, and the page script changes only the attribute, not Gradio's code.)
PLAIN_LABELS_JS = r"""() => {
  const text = (label) => {  // a space after each block, so that "Title</h2><p>Text" reads "Title Text"
    const t = document.createElement("template");
    t.innerHTML = label.replace(/<\/(p|li|h[1-6]|th|td|pre|blockquote)>|<br>/g, "$& ");
    return t.content.textContent.trim();
  };
  const fix = (el) => {
    const label = el.getAttribute("aria-label");
    if (label === el.dataset.plainLabel || !/[<&]/.test(label)) return;
    el.dataset.plainLabel = text(label);
    el.setAttribute("aria-label", el.dataset.plainLabel);
  };
  new MutationObserver(() => document.querySelectorAll("#chat [aria-label]").forEach(fix))
    .observe(document.body, { subtree: true, childList: true, attributes: true, attributeFilter: ["aria-label"] });
}"""


def render(text: str, marks: list[list[int]], highlight: bool = True) -> str:
    """The assistant message: the reply's markdown rendered and sanitised here, with the accepted draft tokens
    highlighted by source (`marks` as `Reply.marks`), or without highlights when `highlight` is off. Either way the
    model's text reaches the page only through `markdown_html`, so HTML it writes shows as text and never loads or
    runs."""
    if not text:
        return '<div class="eagle-tokens"></div>'
    return markdown_html(text, marks if highlight else [])


def plain_text(message_html: str) -> str:
    """The text of a rendered message (tags dropped, entities decoded): the reply less its markdown syntax; for
    tests and API users."""
    return html.unescape(re.sub(r"<[^>]+>", "", message_html))
