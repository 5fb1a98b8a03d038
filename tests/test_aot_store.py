"""Graphs saved whole (eagle/runtime/aot_store.py): a later process loads them without tracing and they compute what
the process that compiled them did; a file is keyed on the graph's structure, not on weight values; a graph that
aot_compile cannot take, or a file that does not load, is compiled the usual way."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny import tiny_base

from eagle.kernels import panel_kernel
from eagle.models.base import BaseModel
from eagle.models.masks import additive_mask
from eagle.runtime import aot_store, runners
from eagle.runtime.config import RuntimeConfig

pytestmark = pytest.mark.skipif(not panel_kernel.available(), reason="graphs are saved whole on the panel kernel")

STEP = textwrap.dedent("""
    import sys, torch
    from torch._dynamo.utils import counters
    sys.path.insert(0, {tests!r})
    from tiny import tiny_base
    from eagle.runtime import runners
    from eagle.runtime.config import RuntimeConfig
    from eagle.models.base import BaseModel
    from eagle.models.masks import additive_mask

    torch.set_num_threads(1)
    base = BaseModel(tiny_base("llama", seed={seed}), eagle3=False)
    base.compiled = runners.decode_graphs(base, RuntimeConfig(base_buckets=(1,)))
    with torch.inference_mode():
        cache = base.new_cache(32)
        base.forward(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], cache, last_logits_only=True)
        mask = additive_mask(torch.ones(1, 5, dtype=torch.bool), base.dtype)
        logits, _ = base.compiled.run(torch.tensor([[5]]), torch.tensor([[4]]), mask, cache, False)
    print("TRACED", counters["stats"]["unique_graphs"])
    print("LOGITS", logits.flatten().tolist())
""")


def _step(tmp_path, seed: int = 0) -> tuple[int, list[float]]:
    """(graphs dynamo traced, logits) of a compiled 1-row step in a fresh process."""
    env = {**os.environ, "EAGLE_AOT_DIR": str(tmp_path / "aot"), "PYTHONPATH": os.getcwd()}
    code = STEP.format(tests=os.path.dirname(__file__), seed=seed)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("TRACED", "LOGITS")))
    return int(lines["TRACED"]), eval(lines["LOGITS"])


def test_a_graph_saved_whole_loads_in_another_process_without_tracing(tmp_path):
    traced, logits = _step(tmp_path)
    assert traced >= 1 and len(list((tmp_path / "aot").glob("*.bin"))) == 1  # compiled, saved
    traced_again, logits_again = _step(tmp_path)
    assert traced_again == 0 and logits_again == logits  # loaded: no trace, the same numbers
    # another model of the same structure reads its own weights through the same file
    _, other = _step(tmp_path, seed=1)
    assert other != logits and len(list((tmp_path / "aot").glob("*.bin"))) == 1


def test_the_key_follows_the_graphs_structure_not_the_weights_values():
    from eagle.decoding.round_steps import TreeShape

    def key(model, rows=1, eagle3=False, shape=TreeShape.of(8, 3, 2)):
        base = BaseModel(model, eagle3=eagle3)

        def verify(*args):  # a closure as the runners make them: a model and a tree's shape
            return base.decode(*args), shape

        return aot_store.key(verify, rows, {"freezing": False})

    same = key(tiny_base("llama", seed=0))
    assert key(tiny_base("llama", seed=1)) == same  # other weights, same graph
    assert key(tiny_base("llama", seed=0), rows=4) != same
    assert key(tiny_base("llama", seed=0, layers=4)) != same
    assert key(tiny_base("llama", seed=0).to(torch.bfloat16)) != same
    assert key(tiny_base("llama", seed=0), eagle3=True) != same  # feature taps
    assert key(tiny_base("llama", seed=0), shape=TreeShape.of(8, 2, 4)) != same


def _graphs(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_AOT_DIR", str(tmp_path / "aot"))
    base = BaseModel(tiny_base("llama"), eagle3=False)
    base.compiled = runners.decode_graphs(base, RuntimeConfig(base_buckets=(1,)))
    return base


def _run(base):
    with torch.inference_mode():
        cache = base.new_cache(32)
        base.forward(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], cache, last_logits_only=True)
        mask = additive_mask(torch.ones(1, 5, dtype=torch.bool), base.dtype)
        return base.compiled.run(torch.tensor([[5]]), torch.tensor([[4]]), mask, cache, False)[0]


def test_a_graph_aot_compile_cannot_take_is_traced_instead(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise torch._dynamo.exc.PackageError("ID_MATCH guard cannot be serialized.")

    monkeypatch.setattr(aot_store, "compile_and_save", refuse)
    base = _graphs(tmp_path, monkeypatch)
    graphs = base.compiled.graphs
    try:
        logits = _run(base)
        assert graphs.aot is False and graphs.ran == {1} and graphs.cache_key_tag is not None  # traced, frozen
        with torch.inference_mode():
            cache = base.new_cache(32)
            base.decode(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], None, cache, False, True)
            eager = base.decode(torch.tensor([[5]]), torch.tensor([[4]]), None, cache, False, False)[0]
        assert torch.allclose(logits, eager, atol=1e-5)
    finally:
        base.decompile()


def test_a_file_that_does_not_load_is_compiled_again(tmp_path, monkeypatch):
    base = _graphs(tmp_path, monkeypatch)
    try:
        logits = _run(base)
        [saved] = (tmp_path / "aot").glob("*.bin")
        saved.write_bytes(b"not a graph")
        assert aot_store.load(saved.stem, base.compiled.graphs.fn) is None and not saved.exists()
        again = _graphs(tmp_path, monkeypatch)
        assert torch.equal(_run(again), logits) and saved.exists()
        again.decompile()
    finally:
        base.decompile()


def test_the_same_model_loaded_from_another_path_keeps_its_key(tmp_path):
    """The app and its compiling children may reach one model through two paths (a link): where it came from is
    not what the graph is made of."""
    from tiny import save_base
    from transformers import AutoModelForCausalLM

    folder = save_base(tiny_base("llama"), str(tmp_path / "base"))
    (tmp_path / "link").symlink_to(folder)
    keys = []
    for path in (folder, str(tmp_path / "link")):
        base = BaseModel(AutoModelForCausalLM.from_pretrained(path), eagle3=False)

        def forward(*args):
            return base.decode(*args)

        keys.append(aot_store.key(forward, 1, {}))
    assert keys[0] == keys[1]


def test_the_graphs_a_model_runs_on_are_not_part_of_its_key():
    """A child compiles a round's graph on a model with no graphs in use; the app loads it beside its own compiled
    forwards (`BaseModel.compiled` set): the same graph, so the same file."""
    base = BaseModel(tiny_base("llama"), eagle3=False)

    def forward(*args):
        return base.decode(*args)

    # the kernels its graphs run: the child's model has them too
    graphs = runners.decode_graphs(base, RuntimeConfig(base_buckets=(1,)))
    before = aot_store.key(forward, 1, {})
    base.compiled = graphs
    assert aot_store.key(forward, 1, {}) == before
    base.model.config.rms_norm_eps = 0.5  # what the graph computes is still in the key
    assert aot_store.key(forward, 1, {}) != before


def test_a_saved_graph_is_called_without_a_guard_stance(tmp_path, monkeypatch):
    """A graph from the store evaluates no guard, so its calls skip dynamo's stance (a scope with a cost of its own);
    a traced graph's calls still enter it."""
    entered = []
    stance = torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: entered.append(k) or stance(*a, **k))
    base = _graphs(tmp_path, monkeypatch)
    try:
        first = _run(base)
        assert base.compiled.graphs.saved == {1} and entered == []
        assert torch.equal(_run(base), first) and entered == []  # a second call: the saved graph, directly
    finally:
        base.decompile()
    monkeypatch.setattr(aot_store, "compile_and_save", lambda *a, **k: (_ for _ in ()).throw(
        torch._dynamo.exc.PackageError("ID_MATCH guard cannot be serialized.")))  # fmt: skip
    traced = _graphs(tmp_path / "traced", monkeypatch)
    try:
        _run(traced), _run(traced)
        assert traced.compiled.graphs.saved == set() and any(k.get("skip_guard_eval_unsafe") for k in entered)
    finally:
        traced.decompile()
