"""Tokens -> text -> HTML, with the tokens that EAGLE drafted (and the base accepted) highlighted.

`Detokenizer` turns a stream of token ids into text pieces incrementally: it decodes a short window of ids
and diffs the text, so a character split over several byte tokens appears once it is complete, and
tokenizers that change a word's leading space with context (SentencePiece) come out right.

`render` builds a reply's HTML, for the chat, the side-by-side panes and the `/chat` endpoint alike: the
markdown rendered here (`app.markdown_render`: lists, bold, headings, code and tables as HTML, sanitised), with
highlighting on the accepted characters in ``<span class="acc">``, on a single line (newlines as ``&#10;``) so
that the chat's markdown renderer passes it through as one HTML block. The styles live in ``assets/app.css``.
"""

from __future__ import annotations

import html
import re

from .markdown_render import markdown_html

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
LEGEND_HTML = (
    '<div class="eagle-legend"><span class="acc">highlighted</span> drafted by EAGLE and accepted by the base '
    "model &nbsp;·&nbsp; plain: the base model's own token of each forward pass</div>"
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
    highlighted, or without highlights when `highlight` is off. Either way the model's text reaches the page
    only through `markdown_html`, so HTML it writes shows as text and never loads or runs."""
    if not text:
        return '<div class="eagle-tokens"></div>'
    return markdown_html(text, marks if highlight else [])


def plain_text(message_html: str) -> str:
    """The text of a rendered message (tags dropped, entities decoded): the reply less its markdown syntax; for
    tests and API users."""
    return html.unescape(re.sub(r"<[^>]+>", "", message_html))
