"""Questions -> prompt token ids: the first turn of each MT-bench-format question in the model's chat format.

The prompts are built by `eagle.chat.templates` (the app's prompt builder): "chat-template" uses the tokenizer's
own template and falls back to a plain "User: ...\\nAssistant:" prompt when the tokenizer has none; "vicuna",
"llama-2" and "mixtral" build fastchat's conversations, as the reference's evaluation does.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle.chat.templates import build_prompt, encode


@dataclass
class Prompt:
    question_id: object
    category: str
    ids: list[int]


def build_prompts(questions: list[dict], tokenizer, kind: str = "chat-template", system: str = "") -> list[Prompt]:
    prompts = []
    for q in questions:
        text = build_prompt(kind, [(q["turns"][0], None)], system, tokenizer)
        ids = encode(kind, tokenizer, text)  # BOS from the chat template's text, or from the tokenizer
        prompts.append(Prompt(q["question_id"], str(q.get("category", "")), ids))
    return prompts
