"""Questions -> prompt token ids: the first turn of each MT-bench-format question in the model's chat format, and any
later turn after a method's own earlier answers (`turn_prompt`, for `bench --turns all`).

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


def answer_text(tokenizer, tokens: list[int]) -> str:
    """A reply's token ids as the text the history carries: special tokens (the stop token) left out, as the app's
    page shows and sends it back (app/highlight.py)."""
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def turn_prompt(question: dict, answers: list[str], tokenizer, kind: str = "chat-template",
                system: str = "") -> list[int]:  # fmt: skip
    """The ids of turn len(answers) + 1 of `question`: its earlier turns with `answers` (the method's own replies to
    them, as text) in the history, then the turn to answer; with no answers, the first turn as `build_prompts`."""
    turns = question["turns"]
    if len(answers) >= len(turns):
        raise ValueError(f"question {question['question_id']} has {len(turns)} turns, not {len(answers) + 1}")
    history = [(turns[i], answers[i]) for i in range(len(answers))]
    text = build_prompt(kind, [*history, (turns[len(answers)], None)], system, tokenizer)
    return encode(kind, tokenizer, text)
