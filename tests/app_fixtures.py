"""Shared pieces of the app tests: a tiny real EaModel behind an Engine, and a running server (no tests here)."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
from tiny import random_draft, save_base, tiny_base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from app.engine import Engine  # noqa: E402
from eagle.chat.templates import FittedPrompt  # noqa: E402
from eagle.decoding.generate import Round  # noqa: E402
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
def serve(engine, max_new_tokens: int = 32, **launch):
    """The app on 127.0.0.1 (a free port), closed afterwards; `launch`: more of demo.launch's keywords."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from app.ui import build, launch_options

    demo = build(engine, max_new_tokens=max_new_tokens)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **launch_options(), **launch)
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


# a reply of known rounds: a scripted engine (no model) -------------------------------------------------
LIST_ROUNDS = [  # a list, bold, code and HTML; in each round every piece but the last is drafted and accepted
    ["Steps", ":", "\n\n"], ["-", " **", "Draft", " fast", "**"], [" with", " `", "code", "`", "\n"],
    ["-", " <script>", "alert(1)", "</script>", " done"],
]  # fmt: skip


class PiecesTokenizer:
    """Ids index a list of text pieces."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.pieces[i] for i in ids)


class ModelFreeEngine:
    """What the page asks of an Engine besides its rounds: one path, a vanilla reference if set, no idle work."""

    name, template, default_system, max_length, path, status, child = "fake", "fake", "", 2048, "eager", "", None

    def __init__(self):
        self.info, self.jobs, self.references, self.replies = {"model_type": "fake"}, [], {}, []

    def reference(self, path=None):
        return self.references.get(path or self.path)

    def record_reply(self, path, tokens, rounds, seconds):
        self.replies.append((path, tokens, rounds, seconds))

    def reply_figures(self, path=None):
        return ""

    def context_line(self):
        return f"{self.max_length:,} tokens"

    def forget(self, conversation):
        pass

    def waiting_lines(self):
        return iter(())

    def wanted(self):
        return contextlib.nullcontext()


class ScriptedEngine(ModelFreeEngine):
    """Answers every message with the same rounds: what the page needs of an Engine, without a model."""

    name, template, max_length = "scripted", "scripted", 2048

    def __init__(self, rounds: list[list[str]]):
        super().__init__()
        self.info = {"model_type": "scripted"}
        self.tokenizer = PiecesTokenizer([p for r in rounds for p in r])
        starts = [sum(map(len, rounds[:i])) for i in range(len(rounds))]
        self.rounds_ids = [list(range(s, s + len(r))) for s, r in zip(starts, rounds)]

    def fit(self, turns, system, max_new_tokens):
        return FittedPrompt(ids=[0], dropped=0)

    def rounds(self, ids, eagle=True, **_):
        script = self.rounds_ids if eagle else [[t] for r in self.rounds_ids for t in r]
        for i, tokens in enumerate(script):
            time.sleep(0.05)
            yield Round(tokens, len(tokens) - 1 if eagle else 0, 0.05, "eos" if i == len(script) - 1 else None)
