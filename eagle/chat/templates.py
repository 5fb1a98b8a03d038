"""Chat prompts: turn a conversation into the text and token ids the base model expects.

Pure functions (the tokenizer is passed in), so they are unit-tested without a model.

Template kinds:
- "vicuna":  fastchat's ``vicuna_v1.1`` conversation ("USER: ... ASSISTANT: ...", sep2 ``</s>``);
- "llama-2": fastchat's ``llama-2`` conversation ("[INST] <<SYS>> ... [/INST]"), as the reference web UI
  builds it: earlier replies get a leading space, and the prompt a trailing one;
- "mixtral": the same ``llama-2`` layout with no system block and sep2 ``</s>`` (the reference's choice);
- "chat-template": the tokenizer's own Jinja chat template (Llama-3, Qwen2, SmolLM2, ...);
  a tokenizer without one falls back to "plain";
- "plain": "System: ...\\n\\nUser: ...\\nAssistant: ..." lines, for bases that ship no template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

TEMPLATE_KINDS = ("vicuna", "llama-2", "mixtral", "chat-template", "plain")

# The Llama-2-chat system prompt from Meta's model card, which the reference web UI uses.
LLAMA2_SYSTEM_PROMPT = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being "
    "safe.  Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or illegal "
    "content. Please ensure that your responses are socially unbiased and positive in nature.\n\nIf a question "
    "does not make any sense, or is not factually coherent, explain why instead of answering something not "
    "correct. If you don't know the answer to a question, please don't share false information."
)

# One exchange: (user message, assistant reply); the reply of the turn being answered is None.
Turn = tuple[str, "str | None"]


def resolve_kind(kind: str, tokenizer) -> str:
    """The kind actually used: "chat-template" needs a tokenizer that has one."""
    if kind not in TEMPLATE_KINDS:
        raise ValueError(f"unknown template kind {kind!r}; expected one of {TEMPLATE_KINDS}")
    if kind == "chat-template" and not getattr(tokenizer, "chat_template", None):
        return "plain"
    return kind


def default_system_prompt(kind: str) -> str:
    """What the system box starts with for a template kind ("" = the template's own default, if any)."""
    if kind == "vicuna":
        from fastchat.conversation import get_conv_template

        return get_conv_template("vicuna_v1.1").system_message
    if kind == "llama-2":
        return LLAMA2_SYSTEM_PROMPT
    return ""


def build_prompt(kind: str, turns: Sequence[Turn], system: str = "", tokenizer=None) -> str:
    """The prompt text for `turns`; the last turn's reply must be None (the one to generate)."""
    if not turns or turns[-1][1] is not None:
        raise ValueError("the last turn must be the user message to answer (reply None)")
    if any(reply is None for _, reply in turns[:-1]):
        raise ValueError("only the last turn may lack a reply")
    kind = resolve_kind(kind, tokenizer)
    system = (system or "").strip()
    if kind in ("vicuna", "llama-2", "mixtral"):
        return _fastchat_prompt(kind, turns, system)
    if kind == "chat-template":
        return _chat_template_prompt(tokenizer, turns, system)
    return _plain_prompt(turns, system)


def _fastchat_prompt(kind: str, turns: Sequence[Turn], system: str) -> str:
    from fastchat.conversation import get_conv_template

    if kind == "vicuna":
        conv = get_conv_template("vicuna_v1.1")
        if system:
            conv.set_system_message(system)
    else:
        conv = get_conv_template("llama-2")
        if kind == "mixtral":
            conv.set_system_message("")
            conv.sep2 = "</s>"
        else:
            conv.set_system_message(system)
    space = kind != "vicuna"  # the reference adds " " before llama-2 replies and after the prompt
    for user, reply in turns:
        conv.append_message(conv.roles[0], user)
        conv.append_message(conv.roles[1], None if reply is None else (" " + reply if space else reply))
    prompt = conv.get_prompt()
    return prompt + " " if space else prompt


def messages(turns: Sequence[Turn], system: str = "") -> list[dict]:
    """OpenAI-style messages for a chat template (the pending reply left out)."""
    out = [{"role": "system", "content": system}] if system else []
    for user, reply in turns:
        out.append({"role": "user", "content": user})
        if reply is not None:
            out.append({"role": "assistant", "content": reply})
    return out


def _chat_template_prompt(tokenizer, turns: Sequence[Turn], system: str) -> str:
    msgs = messages(turns, system)
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception:
        if not system:
            raise
        # Some templates (Mistral, Gemma) refuse a system role: put it in front of the first user message.
        msgs = messages(turns)
        msgs[0] = {"role": "user", "content": f"{system}\n\n{msgs[0]['content']}"}
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def _plain_prompt(turns: Sequence[Turn], system: str) -> str:
    lines = [f"System: {system}\n"] if system else []
    for user, reply in turns:
        lines.append(f"User: {user}")
        lines.append("Assistant:" if reply is None else f"Assistant: {reply}")
    return "\n".join(lines)


def encode(kind: str, tokenizer, prompt: str) -> list[int]:
    """Token ids of a prompt. Chat templates already write their BOS text; the others get the tokenizer's."""
    special = resolve_kind(kind, tokenizer) != "chat-template"
    return list(tokenizer(prompt, add_special_tokens=special)["input_ids"])


@dataclass
class FittedPrompt:
    ids: list[int]
    dropped: int  # how many of the oldest turns were left out to fit


class PromptTooLong(ValueError):
    """Even the newest message alone does not fit the context."""

    def __init__(self, tokens: int, room: int):
        self.tokens, self.room = tokens, room
        super().__init__(
            f"This message needs {tokens:,} prompt tokens, but only {room:,} fit in the model's context "
            "(after leaving room for the reply). Please shorten it."
        )


def fit_turns(
    turns: Sequence[Turn], room: int, to_ids: Callable[[Sequence[Turn]], list[int]]
) -> FittedPrompt:
    """Drop the oldest turns until the prompt has at most `room` tokens.

    `to_ids(turns)` builds and tokenizes a prompt. The newest turn is always kept: if it alone is too long,
    `PromptTooLong` is raised. Prompt length grows with the number of turns, so a binary search finds the
    fewest turns to drop with O(log n) prompt builds."""
    ids = to_ids(turns)
    if len(ids) <= room:
        return FittedPrompt(ids, 0)
    last = to_ids(turns[-1:])
    if len(last) > room:
        raise PromptTooLong(len(last), room)
    lo, hi, best = 1, len(turns) - 1, last  # drop lo..hi turns; dropping len-1 fits
    best_drop = len(turns) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = to_ids(turns[mid:])
        if len(cand) <= room:
            best, best_drop, hi = cand, mid, mid - 1
        else:
            lo = mid + 1
    return FittedPrompt(best, best_drop)
