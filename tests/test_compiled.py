"""Compiled base forwards (eagle/runtime/compiled.py): padding rows change nothing, the compiled vanilla step and
verify pass stay lossless and compile once per bucket, and `compile` falls back or stays off as documented."""

import pytest
import torch
from tiny import random_draft, save_base, tiny_base

from eagle.decoding.generate import TreeSpec
from eagle.decoding.verify import SamplingParams, TokenPicker
from eagle.model import compiling
from eagle.model.ea_model import EaModel
from eagle.models.base import BaseModel
from eagle.models.masks import additive_mask, tree_mask
from eagle.runtime import compiled, compiled_draft, runners
from eagle.runtime.compiled import CompiledDecode, bucket_for, pad_rows
from eagle.runtime.compiled_draft import CompiledDraft
from eagle.runtime.config import RuntimeConfig
from eagle.runtime.round_graphs import CompiledRound
from eagle.tuning import tuner

NEW = 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiled")
    base = tiny_base("llama", layers=8)  # 8 layers: three distinct EAGLE-3 taps (2, 4, 5)
    save_base(base, str(folder / "base"))
    return folder, base


def test_padding_rows_never_change_the_output(folder):
    _, model = folder
    base = BaseModel(model, eagle3=True)
    prefix, q, rows = 7, 5, 16
    ids = torch.randint(0, 16, (1, prefix + q))
    parents = [-1, 0, 0, 1, 2]  # a small tree: each row sees itself and its ancestors
    ancestors = torch.zeros(q, q, dtype=torch.bool)
    for i, p in enumerate(parents):
        ancestors[i, i] = True
        while p >= 0:
            ancestors[i, p], p = True, parents[p]
    positions = torch.tensor([[prefix + d for d in (0, 1, 1, 2, 2)]])
    results = []
    with torch.inference_mode():
        for pad in (False, True):
            cache = base.new_cache(prefix + rows)
            base.decode(ids[:, :prefix], torch.arange(prefix)[None], None, cache, False, True)
            mask = tree_mask(prefix, ancestors, torch.float32, "cpu")
            args = pad_rows(ids[:, prefix:], positions, mask, rows) if pad else (ids[:, prefix:], positions, mask)
            logits, feats = base.decode(*args, cache, True, False)
            assert cache.length == prefix + (rows if pad else q)
            cache.crop_to(prefix + q)
            keys = torch.cat([layer.keys[:, :, : prefix + q] for layer in cache.layers])
            results.append((logits[:q], feats[:q], keys))
    for plain, padded in zip(*results):
        torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-6)


def test_pad_rows_mask_lets_pads_see_only_the_prefix_and_themselves():
    mask = additive_mask(torch.ones(2, 5, dtype=torch.bool).tril(3), torch.float32)  # 3 prefix + 2 rows
    ids, positions, full = pad_rows(torch.tensor([[5, 6]]), torch.tensor([[3, 4]]), mask, 4)
    allowed = full[0, 0] == 0
    assert ids.tolist() == [[5, 6, 6, 6]] and positions.tolist() == [[3, 4, 4, 4]]
    assert allowed[:2, :5].equal(mask[0, 0] == 0) and not allowed[:2, 5:].any()  # real rows never see pads
    assert allowed[2].tolist() == [True, True, True, False, False, True, False]
    assert allowed[3].tolist() == [True, True, True, False, False, False, True]
    buckets = (1, 4, 8)
    assert bucket_for(1, buckets) == 1 and bucket_for(2, buckets) == 4 and bucket_for(5, buckets) == 8
    assert bucket_for(8, buckets) == 8 and bucket_for(9, buckets) is None


def test_compiled_rounds_equal_hf_generate_and_compile_once_per_bucket(folder, monkeypatch):
    path, base = folder
    # two buckets each (a minute a graph on 2 cores): the 1-row step and the tree's 8, commits of 1-2 and 3-4
    # rows and the tree's 4-wide levels
    monkeypatch.setattr(compiled, "BUCKETS", (1, 8))
    monkeypatch.setattr(compiled_draft, "DRAFT_BUCKETS", (2, 4))
    draft = random_draft(base, str(path / "draft3"), eagle3=True, draft_vocab=12)
    # the greedy rounds of this tree: its draft and verify steps compiled (round_graphs.py), one graph each
    model = EaModel.from_pretrained(str(path / "base"), draft, total_token=7, depth=3, top_k=4, dtype=torch.float32,
                                    compile="on")  # fmt: skip
    assert isinstance(model.base.compiled, CompiledDecode) and isinstance(model.compiled_draft, CompiledDraft)
    # every bucket ran once while warming up: from now on only the guards that tell the graphs apart are checked
    assert model.base.compiled.graphs.ran == {1, 8} and model.compiled_draft.graphs.ran == {2, 4}
    tree = TreeSpec(total_token=7, depth=3, top_k=4)
    rounds = model.round_runner(tree, TokenPicker(SamplingParams()))
    assert isinstance(rounds, CompiledRound) and rounds.verify_graph.ran == rounds.draft_graph.ran == {7}
    torch._dynamo.utils.counters.clear()
    for prompt in ([3, 4, 5], [7, 2, 9, 9, 11, 4, 2, 8, 8]):
        ids = torch.tensor([prompt])
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                            min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)  # fmt: skip
        out, n, forwards = model.eagenerate(ids, max_new_tokens=NEW, stop_token_ids=[], log=True)
        assert out.tolist() == ref.tolist()
        assert n / (forwards + 1) > 1.05  # drafts were accepted: the verify step ran on the compiled graph
        assert model.naivegenerate(ids, max_new_tokens=NEW, stop_token_ids=[]).tolist() == ref.tolist()
    # warm() compiled every graph already: the base's, the draft's and the round's
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_compile_auto_follows_the_measurement_and_failures_stay_eager(folder, monkeypatch, tmp_path):
    path, base = folder
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    draft = random_draft(base, str(path / "draft1"), eagle3=False)
    lines = []

    def load(mode):
        return EaModel.from_pretrained(str(path / "base"), draft, dtype=torch.float32, compile=mode, log=lines.append)

    assert load("auto").base.compiled is None and "not measured on this machine yet" in lines[-1]
    monkeypatch.setattr(CompiledDecode, "warm", lambda self, log=None: {})  # no real compiling below
    monkeypatch.setattr(CompiledDraft, "warm", lambda self, log=None: {})
    monkeypatch.setattr(CompiledRound, "warm", lambda self, log=None: {})
    timings = {"compiled": 0.001, "eager": 0.002}
    monkeypatch.setattr(BaseModel, "pass_seconds",
                        lambda self, rows, *a, **k: {n: timings["compiled" if self.compiled else "eager"] for n in rows})  # fmt: skip
    assert load("on").base.compiled is not None
    assert any(line.startswith("compiled vs eager") for line in lines)  # (the round's draft step timed after it)
    assert load("auto").base.compiled is not None  # measured faster: auto compiles

    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "other-machine"))
    timings["compiled"] = 0.003
    assert load("on").base.compiled is not None and any("measured slower" in line for line in lines[-3:])
    assert load("auto").base.compiled is None

    def broken(base, runtime):
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(runners, "decode_graphs", broken)
    model = load("on")
    assert model.base.compiled is None and lines[-1] == "compiling failed (RuntimeError: no C++ compiler); decoding eagerly"
    assert model.runtime.compile == "on" and compiling.compile_rounds(model, lines.append) is False
    with pytest.raises(ValueError, match="compile must be"):
        load("yes")


def test_inductor_cache_goes_to_the_project_cache_unless_the_user_chose_one(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from eagle.runtime.compiled import use_project_inductor_cache

    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "eagle"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()  # what importing torch._inductor does: its /tmp default written into the environment
    assert use_project_inductor_cache() == str(tmp_path / "eagle" / "inductor") == cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_project_inductor_cache() == str(tmp_path / "mine") == cache_dir()
    assert default_cache_dir() != str(tmp_path / "mine")


@pytest.mark.parametrize("linears", ["panel", "inductor"])
def test_compiled_graphs_freeze_the_weights_and_go_to_the_disk_cache(folder, monkeypatch, tmp_path, linears):
    """The graphs never run matmuls over weight inputs: where the panel kernel runs, the few-row layers call it on
    their panels for every row count while compiled, and each graph is saved whole (aot_store.py: a later start
    loads it without tracing); elsewhere they go back to nn.Linear (dynamo lifts a custom module's weights as
    inputs) for inductor's own GEMMs on weights frozen into the graph. Either way they come back with their plan
    when compiling is undone. Inductor's graph cache keeps the graphs' code (no MKL-packed weight, an mkldnn tensor
    it cannot store, is left in a frozen one). The layers that read the same input (q/k/v, gate/up) make one
    kernel call in a graph."""
    from torch._dynamo.utils import counters

    from eagle.kernels import few_rows, panel_kernel

    monkeypatch.setenv("EAGLE_AOT_DIR", str(tmp_path / "aot"))

    if linears == "panel" and not panel_kernel.available():
        pytest.skip(f"panel kernel: {panel_kernel._state.get('why')}")
    if linears == "inductor":
        monkeypatch.setattr(panel_kernel, "available", lambda log=None: False)
    _, model = folder
    few_rows.uninstall(model)  # earlier tests installed the default plan on this model
    base = BaseModel(model, eagle3=False, few_row_plan=few_rows.uniform_plan("wxt"))
    base.compiled = runners.decode_graphs(base, RuntimeConfig(base_buckets=(1,)))
    assert few_rows.plan_of(model) == (few_rows.uniform_plan("panel") if linears == "panel" else None)
    try:
        counters.clear()
        base.compiled.warm()
        cached = counters["inductor"]
        if linears == "panel":  # saved whole, for later starts
            assert len(list((tmp_path / "aot").glob("*.bin"))) == 1
        else:  # frozen, its code in inductor's cache
            assert cached["fxgraph_cache_bypass"] == 0 and cached["fxgraph_cache_miss"] + cached["fxgraph_cache_hit"] >= 1
            assert not (tmp_path / "aot").exists() or not list((tmp_path / "aot").glob("*.bin"))
        cache = base.new_cache(16)
        with torch.inference_mode():
            base.forward(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], cache, last_logits_only=True)
            with torch.profiler.profile() as prof:
                base.forward(torch.tensor([[4]]), torch.tensor([[3]]), cache, features=False)
        names = {e.key: e.count for e in prof.key_averages()}
        assert any("CompiledFxGraph" in n for n in names)
        assert not names.keys() & {"aten::mm", "aten::addmm", "aten::linear"}
        # one call for q/k/v, one for gate/up (few_rows.SIBLINGS), o and down apart, the lm_head
        calls = 4 * model.config.num_hidden_layers + 1
        assert names.get("eagle::panel_linear", 0) == (calls if linears == "panel" else 0)
    finally:
        base.decompile()
    assert few_rows.plan_of(model) == few_rows.uniform_plan("wxt")
    few_rows.uninstall(model)


def test_the_disk_cache_serves_a_graph_only_to_the_model_it_was_compiled_for(monkeypatch, tmp_path):
    """Inductor keys a frozen graph's cache entry on its weights' shapes, yet the entry holds the CPP GEMMs' packed
    copy of them: a model of the same shapes with other weights must compile its own (the weights' fingerprint is
    in the key), and the same weights load the entry instead of compiling it again."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    for seed, cached in ((0, "miss"), (1, "miss"), (0, "hit")):
        base = BaseModel(tiny_base("llama", seed=seed, layers=1), eagle3=False, few_row_plan=False)
        with torch.inference_mode():
            cache = base.new_cache(16)
            base.forward(ids[:, :5], torch.arange(5)[None], cache, last_logits_only=True)
            eager, _ = base.forward(ids[:, 5:], torch.tensor([[5]]), cache, features=False)
            counters.clear()
            base.compiled = runners.decode_graphs(base, RuntimeConfig(base_buckets=(1,)))
            base.compiled.warm()
            assert counters["inductor"][f"fxgraph_cache_{cached}"] == 1, (seed, dict(counters["inductor"]))
            assert counters["inductor"]["cpp_templated_kernel_counter"] > 0  # the packed weights are in the entry
            cache = base.new_cache(16)
            base.forward(ids[:, :5], torch.arange(5)[None], cache, last_logits_only=True)
            compiled_logits, _ = base.forward(ids[:, 5:], torch.tensor([[5]]), cache, features=False)
        torch.testing.assert_close(compiled_logits, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two draft graphs, ~40 s
def test_compiled_drafts_in_both_dtypes_and_the_faster_one_is_kept(folder, monkeypatch, tmp_path):
    """A bfloat16 head under a float32 base (eager timing's pick) is compiled in both dtypes; the one whose compiled
    draft phase for the tree in use measures faster becomes the model's head, and the timing is cached."""
    path, base = folder
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    monkeypatch.setattr(compiled_draft, "DRAFT_BUCKETS", (4,))
    monkeypatch.setattr(compiling, "QUANTIZED_HEAD_MIN_BYTES", 0)  # the tiny head offered with Q4_1 weights too
    draft = random_draft(base, str(path / "draft_dtypes"), eagle3=True, draft_vocab=12)
    model = EaModel.from_pretrained(str(path / "base"), draft, dtype=torch.float32, draft_dtype=torch.bfloat16)
    lines = []
    drafts = compiling._compiled_drafts(model, lines.append)
    # the head's dtype, the base's, and the base's with Q4_1 weights (few_rows.quantize)
    assert [h.dtype_name for h, _ in drafts] == ["bfloat16", "float32", "q4_1"]
    assert drafts[0][0] is model.ea_layer and all(isinstance(g, CompiledDraft) for _, g in drafts)
    timed = {"bfloat16": 2.0, "float32": 1.0, "q4_1": 3.0}  # float32 drafts faster here (as on an AMD EPYC)
    monkeypatch.setattr(tuner, "draft_seconds", lambda m, d, k, repeats, head_and_graphs: {
        (d[0], k[0]): timed[head_and_graphs[0].dtype_name]})  # fmt: skip
    where = tmp_path / "draft-timing.json"
    head, graphs = compiling._faster_draft(model, drafts, (2, 1), where, lines.append)
    assert head.dtype_name == "float32" and graphs is drafts[1][1]
    assert lines[-1] == ("compiled draft phase (depth 2, width 1): 2000.0 ms in bfloat16, 1000.0 ms in float32, "
                         "3000.0 ms in q4_1")  # fmt: skip
    timed = {"bfloat16": 1.0, "float32": 2.0, "q4_1": 3.0}  # cached: not timed again
    assert compiling._faster_draft(model, drafts, (2, 1), where, lines.append)[0].dtype_name == "float32"
    # the kept head drafts with its graphs as it does eagerly: the same tokens in the same rounds
    runs = []
    for graphs_in_use in (None, graphs):
        model.ea_layer, model.compiled_draft = head, graphs_in_use
        ids, new, rounds = model.eagenerate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=24, log=True)
        runs.append((ids.tolist(), new, rounds))
    assert runs[0] == runs[1] and runs[0][2] < 24  # drafts were accepted
