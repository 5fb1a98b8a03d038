"""The app compiles its rounds in the background: replies are served eagerly meanwhile, the compiled graphs come in
between two replies (never under a running one), and the replies stay what they were."""

import pytest
from test_app_helpers import tiny_engine

from eagle.model import compiled, compiled_draft


@pytest.fixture
def one_bucket_each(monkeypatch, tmp_path):
    """Graphs for one bucket each (seconds to compile) and a cache of timings of its own."""
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "BUCKETS", (16,))
    monkeypatch.setattr(compiled_draft, "DRAFT_BUCKETS", (4,))


def test_compiled_rounds_come_in_between_replies_and_change_no_reply(one_bucket_each, tmp_path):
    engine = tiny_engine(str(tmp_path))
    model = engine.model
    ids = engine.prompt_ids([("w7 w8 w9", None)])
    reference = [t for r in engine.rounds(ids, max_new_tokens=24) for t in r.tokens]

    reply = engine.rounds(ids, max_new_tokens=24)
    tokens = list(next(reply).tokens)  # a reply is being written: it holds the model
    lines = []
    thread = engine.compile_in_background("on", lines.append, lambda m: {"forwards": "compiled now"})
    thread.join(timeout=600)  # graphs built and warmed beside the running reply
    assert not thread.is_alive() and any("4-row draft step" in line for line in lines), lines
    assert engine.finish_compiling(wait=False) is None  # not under the running reply (the serving loop's poll)
    assert model.base.compiled is None and model.compiled_draft is None
    tokens += [t for r in reply for t in r.tokens]
    assert engine.finish_compiling() is True
    assert model.base.compiled is not None and model.compiled_draft is not None
    assert tokens == reference
    assert [t for r in engine.rounds(ids, max_new_tokens=24) for t in r.tokens] == reference
    assert engine.info["forwards"] == "compiled now" and lines[-1].startswith("compiled rounds in use")
    assert engine.baseline is not None and "start-up" in engine.baseline[1]
    assert engine.finish_compiling() is None  # nothing left to put in use


def test_auto_keeps_eager_where_compiled_measured_slower(one_bucket_each, tmp_path, monkeypatch):
    from eagle.model import tuner

    slower = {"ms": {"compiled": {16: 2.0}, "eager": {16: 1.0}}, "compiled_pays": False}
    monkeypatch.setattr(tuner, "_compiled_vs_eager", lambda base: slower)
    monkeypatch.setattr(compiled.CompiledDecode, "warm", lambda self, log=None: {})
    monkeypatch.setattr(compiled_draft.CompiledDraft, "warm", lambda self, log=None: {})
    engine = tiny_engine(str(tmp_path))
    lines = []
    engine.compile_in_background("auto", lines.append).join(timeout=120)
    assert engine.finish_compiling() is False
    assert engine.model.base.compiled is None and engine.model.compiled_draft is None
    assert lines[-1] == "compiled forwards measured slower than eager here: decoding eagerly"
