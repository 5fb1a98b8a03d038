"""Shared pieces of the app tests: a tiny real EaModel behind an Engine, and a running server.

(This module holds no tests; it is named test_app_* so it lives beside them.)"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from tiny import random_draft, save_base, tiny_base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from app.engine import Engine  # noqa: E402
from eagle.model.ea_model import EaModel  # noqa: E402

VOCAB = 48  # word-level "w2".."w47": big enough for distinct replies to distinct prompts
# A ChatML-like template over the tiny vocabulary: w4 = system, w2 = user, w3 = assistant, w5 = end of turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ {'system': 'w4', 'user': 'w2', 'assistant': 'w3'}[m['role']] }} {{ m['content'] }} "
    "w5 {% endfor %}{% if add_generation_prompt %}w3 {% endif %}"
)


def tiny_model(folder: str, chat_template: bool = True) -> EaModel:
    """A 4-layer random Llama (eos = "</s>") with a random EAGLE-3 head and a small draft tree."""
    base = tiny_base("llama", vocab=VOCAB, layers=4)
    save_base(base, os.path.join(folder, "base"), eos=1)
    draft = random_draft(base, os.path.join(folder, "draft"), eagle3=True)
    model = EaModel.from_pretrained(os.path.join(folder, "base"), draft, total_token=12, depth=3, top_k=4,
                                    dtype=torch.float32)  # fmt: skip
    if chat_template:
        model.tokenizer.chat_template = CHAT_TEMPLATE
    return model


def tiny_engine(folder: str, max_length: int = 256, chat_template: bool = True) -> Engine:
    model = tiny_model(folder, chat_template)
    return Engine(model, "chat-template", max_length, name="tiny", default_system="",
                  info={"model_type": "tiny", "base": "tiny random llama", "head": "random EAGLE-3"})  # fmt: skip


@contextlib.contextmanager
def one_thread():
    """Tests share 2 busy cores: one intra-op thread is much faster than two fighting for them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def serve(engine, max_new_tokens: int = 32):
    """The app on 127.0.0.1 (a free port), closed afterwards."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from app.ui import build, launch_options

    demo = build(engine, max_new_tokens=max_new_tokens)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **launch_options())
    try:
        yield demo
    finally:
        demo.close()


def greedy_reply(engine, turns, max_new_tokens: int, system: str = "") -> str:
    """What the app must answer: the model's own greedy eagenerate on the same prompt, decoded."""
    ids = engine.prompt_ids(turns, system)
    out = engine.model.eagenerate(torch.tensor([ids]), temperature=0.0, max_new_tokens=max_new_tokens,
                                  max_length=engine.max_length)  # fmt: skip
    return engine.tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
