"""A tiny model folder for the bench and answer-file tests (no tests here): a random Llama with a chat template
for its word-level tokenizer, a random EAGLE-3 head and QUESTIONS in MT-bench's format."""

import json

import pytest
from tiny import random_draft, save_base, tiny_base
from transformers import AutoTokenizer

# A chat template for the tiny word-level tokenizer (ids: "<s>"=0, "</s>"=1, "w2".."w15").
TEMPLATE = "<s>{% for m in messages %} w3 {{ m['content'] }} w4{% endfor %}{% if add_generation_prompt %} w5{% endif %}"
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["w7 w8 w9 w10 w7 w8", "w2"]},
    {"question_id": 82, "category": "writing", "turns": ["w11 w12 w13 w11 w12 w13 w11", "w2"]},
    {"question_id": 101, "category": "reasoning", "turns": ["w6 w14 w15 w6 w14"]},
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    base = tiny_base("llama", seed=8)  # a seed where one answer stops at </s> and drafts get accepted
    save_base(base, str(folder / "base"))
    tok = AutoTokenizer.from_pretrained(folder / "base")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder / "base")
    random_draft(base, str(folder / "head"), eagle3=True)
    with open(folder / "questions.jsonl", "w") as f:
        f.write("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return folder
