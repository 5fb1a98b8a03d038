"""Questions -> prompt token ids: the first turn of each MT-bench-format question in the model's chat format.

Template kinds: "chat-template" uses the tokenizer's own template (`apply_chat_template(...,
add_generation_prompt=True)`) and falls back to a plain "User: ...\\nAssistant:" prompt when the tokenizer has
none; "vicuna", "llama-2" and "mixtral" build fastchat's conversations, as the reference's evaluation does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Prompt:
    question_id: object
    category: str
    ids: list[int]


def prompt_text(tokenizer, kind: str, user: str, system: str = "") -> tuple[str, bool]:
    """(text, has_bos_text): the prompt for one user message; has_bos_text = the template wrote BOS itself."""
    if kind in ("vicuna", "llama-2", "mixtral"):
        from fastchat.conversation import get_conv_template

        conv = get_conv_template("vicuna_v1.1" if kind == "vicuna" else "llama-2")
        if kind == "mixtral":
            conv.set_system_message("")
            conv.sep2 = "</s>"
        elif system:
            conv.set_system_message(system)
        conv.append_message(conv.roles[0], user)
        conv.append_message(conv.roles[1], None)
        text = conv.get_prompt()
        return (text if kind == "vicuna" else text + " "), False
    if kind != "chat-template":
        raise ValueError(f"unknown template kind {kind!r}")
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, True
    prefix = f"System: {system}\n\n" if system else ""
    return f"{prefix}User: {user}\nAssistant:", False


def build_prompts(questions: list[dict], tokenizer, kind: str = "chat-template", system: str = "") -> list[Prompt]:
    prompts = []
    for q in questions:
        text, has_bos = prompt_text(tokenizer, kind, q["turns"][0], system)
        ids = list(tokenizer(text, add_special_tokens=not has_bos)["input_ids"])
        prompts.append(Prompt(q["question_id"], str(q.get("category", "")), ids))
    return prompts
