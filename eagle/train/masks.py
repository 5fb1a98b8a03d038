"""Chat template -> (input_ids, loss_mask): the mask covers the assistant replies and their end-of-turn token.

The mask is derived from the template itself, never from hand-tuned token offsets:

1. render the whole conversation to text with the template;
2. for assistant message i, render the prefix ``messages[:i]`` with the generation prompt (where the reply
   starts) and ``messages[:i+1]`` (where the turn ends); the reply is the message content found between them;
3. tokenize the text with the fast tokenizer's ``return_offsets_mapping`` and mark the tokens that overlap a
   reply's characters, plus the first end-of-turn token (eos, ``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ...)
   between the reply and the end of its turn: the draft must predict it, since the base emits it to stop.

Two renderers: `HFTemplate` (``tokenizer.apply_chat_template``, or any Jinja string in the same format) and
`FastChatTemplate` (fastchat's ``get_conversation_template(name)``, e.g. ``vicuna_v1.1`` or ``llama-2``, as the
reference project used for Vicuna / LLaMA-2-chat).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle.model.ea_model import stop_token_ids

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


class TemplateError(ValueError):
    pass


class HFTemplate:
    """The tokenizer's own chat template (or `chat_template`, a Jinja string in the same format)."""

    adds_bos = False  # HF templates write the bos token into the text when they want one

    def __init__(self, tokenizer, chat_template: str | None = None):
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template: pass --template fastchat:<name>")
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
        )


class FastChatTemplate:
    """fastchat's conversation templates (`fastchat.model.get_conversation_template`), e.g. "vicuna_v1.1"."""

    adds_bos = True  # fastchat prompts are tokenized with the tokenizer's bos prepended

    def __init__(self, name: str, system: str | None = None):
        from fastchat.model import get_conversation_template

        self._get = get_conversation_template
        self.name = name
        self.system = system

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        conv = self._get(self.name)
        if self.system is not None:
            conv.system_message = self.system
        for m in messages:
            if m["role"] == "system":
                conv.system_message = m["content"]
            else:
                conv.append_message(conv.roles[0 if m["role"] == "user" else 1], m["content"])
        if add_generation_prompt:
            conv.append_message(conv.roles[1], None)
        return conv.get_prompt()


def make_template(tokenizer, spec: str | None = None):
    """`spec`: None/"hf" = the tokenizer's template; "fastchat:<name>" = a fastchat template; else a path to a
    Jinja file."""
    if spec in (None, "", "hf"):
        return HFTemplate(tokenizer)
    if spec.startswith("fastchat:"):
        return FastChatTemplate(spec.split(":", 1)[1])
    with open(spec) as f:
        return HFTemplate(tokenizer, f.read())


@dataclass
class ReplySpan:
    start: int  # first character of the reply
    end: int  # one past its last character
    turn_end: int  # one past the last character of its turn (the end-of-turn token lies in [end, turn_end))


def reply_spans(template, messages: list[Message]) -> tuple[str, list[ReplySpan]]:
    """Render `messages`; return the text and the character span of every assistant reply."""
    text = template.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True)
        turn = template.render(messages[: i + 1])
        if not (text.startswith(turn) and turn.startswith(prompt)):
            raise TemplateError(
                "the chat template does not render conversation prefixes as prefixes of the whole "
                "conversation, so reply spans cannot be derived from it"
            )
        start, turn_end = len(prompt), len(turn)
        content = m["content"]
        at = text.find(content, start, turn_end)
        if at < 0:  # templates such as Llama-3's trim the content
            content = content.strip()
            at = text.find(content, start, turn_end) if content else -1
        if at < 0:
            raise TemplateError(f"assistant message {i} does not appear verbatim in the rendered template")
        spans.append(ReplySpan(at, at + len(content), turn_end))
    return text, spans


def tokenize_with_mask(
    tokenizer, text: str, spans: list[ReplySpan], add_bos: bool = False, stop_ids: set[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids [T] long, loss_mask [T] bool: the tokens of each reply plus its end-of-turn token."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    if add_bos and tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
        ids, offsets = [tokenizer.bos_token_id] + ids, [(0, 0)] + offsets
    stop_ids = stop_token_ids(tokenizer) if stop_ids is None else stop_ids
    mask = [False] * len(ids)
    for span in spans:
        for t, (a, b) in enumerate(offsets):
            if a < span.end and b > span.start and b > a:
                mask[t] = True
        # The first end-of-turn token between the reply and the end of its turn.
        for t, (a, b) in enumerate(offsets):
            if a >= span.end and a < span.turn_end and ids[t] in stop_ids:
                mask[t] = True
                break
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def encode_conversation(
    tokenizer, template, messages: list[Message], max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversation -> (input_ids [T], loss_mask [T]), truncated to `max_len` tokens."""
    text, spans = reply_spans(template, messages)
    ids, mask = tokenize_with_mask(tokenizer, text, spans, add_bos=template.adds_bos)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask
