"""A base whose config names a GGUF (eagle/kernels/quant_gguf.py) reads the file's Q4_1 / Q8_0 blocks in its CPU
linears (few_rows.py): the same weights as its float32 copy, logits within the 16-bit rounding of the inputs, and
greedy EAGLE equal to greedy vanilla on it."""

import pytest
import torch
from lossless_checks import PROMPTS
from q4_fixtures import quantized_tiny_base
from tiny import random_draft, save_base

from eagle.chat.model_types import forwards_description
from eagle.kernels import few_rows, panel_kernel, quant_gguf, quant_panels
from eagle.model.ea_model import EaModel, load_head
from eagle.models.base import BaseModel
from eagle.models.checkpoint import read_checkpoint

needs_kernel = pytest.mark.skipif(
    not panel_kernel.available(), reason=f"panel kernel: {panel_kernel._state.get('why')}"
)


@needs_kernel
def test_the_layers_read_the_gguf_blocks_and_compute_what_float32_weights_do(tmp_path, monkeypatch):
    base = quantized_tiny_base(tmp_path / "tiny.gguf")
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        plain = base(ids).logits  # nn.Linear on the float32 weights
    assert few_rows.install(base) == 2 * 7 + 1
    assert few_rows.plan_of(base) == few_rows.uniform_plan("panel")  # the default plan of a quantized base
    assert few_rows.weights_of(base) == "q4_1 (14 layers), q8_0 (lm_head)"
    q_proj = base.model.layers[0].self_attn.q_proj
    assert q_proj.gguf[0] == quant_panels.Q4_1 and q_proj.panels.dtype == torch.uint8
    with torch.no_grad(), few_rows.few_row_kernels():
        quantized = [base(ids[:, : n + 1]).logits for n in range(ids.shape[1])]
        with monkeypatch.context() as m:
            m.setitem(quant_panels.INPUT_BITS, quant_panels.Q4_1, 16)
            quantized16 = [base(ids[:, : n + 1]).logits for n in range(ids.shape[1])]
        layers = [m for m in base.modules() if type(m) is few_rows.FewRowLinear]
        for layer in layers:
            layer.gguf = None
        few_rows.set_plan(base, {1: "linear"})  # the copies freed, then made again of the float32 weights
        few_rows.set_plan(base, few_rows.uniform_plan("panel"))
        assert few_rows.weights_of(base) == "fp32"
        fp32 = [base(ids[:, : n + 1]).logits for n in range(ids.shape[1])]
    # the same weights; the layers' inputs rounded to 16 bits a block of 32, or to 8 where the engine does (Q4_1: 2^-8
    # of a block's largest input, through two layers); the lm_head's (Q8_0) to 8 bits in both
    for q8, q16, f in zip(quantized, quantized16, fp32):
        torch.testing.assert_close(q16, f, rtol=0, atol=1e-2 * f.abs().max().item())
        torch.testing.assert_close(q8, f, rtol=0, atol=2e-2 * f.abs().max().item())
        assert not torch.equal(q8, q16)
    torch.testing.assert_close(fp32[-1], plain, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_loading_puts_the_tiling_measured_fastest_here_in_force_measured_once(tmp_path, monkeypatch):
    """A base that reads GGUF blocks, loaded with the kernels timed here (few_row_kernels="auto", as the app and the
    tools load), runs under the panel tiling its forwards measured fastest on this machine (tuner.panel_tiling):
    every candidate timed, the least total in force after loading, and a second load (another process) takes it
    from the cache without timing. A load with a given plan (the app's compile children) times nothing."""
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    base = quantized_tiny_base(tmp_path / "tiny.gguf")
    save_base(base, str(tmp_path / "base"))  # config.json names the GGUF
    head = random_draft(base, str(tmp_path / "head"))
    fastest = quant_panels.tilings()[-1]
    timed = []

    def pass_seconds(self, rows, context=256, repeats=5):  # this machine, as far as the tuner can tell
        timed.append(quant_panels.tiling())
        return {n: (1e-3 if timed[-1] == fastest else 2e-3) * n for n in rows}

    monkeypatch.setattr(BaseModel, "pass_seconds", pass_seconds)
    # "auto" times the few-row kernels too: the panel kernel wins them on GGUF blocks (tests/test_tuner.py times them)
    monkeypatch.setattr("eagle.model.ea_model.few_row_plan", lambda model, log=None: few_rows.uniform_plan("panel"))
    with quant_panels.tiled(quant_panels.default_tiling()):
        for load in range(2):
            quant_panels.set_tiling(quant_panels.default_tiling())  # a new process
            model = EaModel.from_pretrained(str(tmp_path / "base"), head, total_token=8, depth=3, top_k=4,
                                            few_row_kernels="auto", dtype=torch.float32)  # fmt: skip
            assert few_rows.reads_gguf_blocks(model.base_model)
            assert quant_panels.tiling() == fastest
            assert forwards_description(model).endswith(
                f"GGUF blocks in wide tiles up to {fastest.wide_rows} rows, prefetch {fastest.prefetch // 1024} KB"
                " (the base's past the caches)")
            assert fastest.stream_nta
            assert set(timed) == (set(quant_panels.tilings()) if load == 0 else set())
            timed.clear()
        quant_panels.set_tiling(quant_panels.default_tiling())
        plan = few_rows.plan_of(model.base_model)
        EaModel.from_pretrained(str(tmp_path / "base"), head, total_token=8, depth=3, top_k=4, few_row_kernels=plan,
                                dtype=torch.float32)  # fmt: skip
        assert not timed and quant_panels.tiling() == quant_panels.default_tiling()


@needs_kernel
def test_a_few_row_plan_timed_all_f_linear_keeps_the_layers_on_their_gguf_blocks(tmp_path, monkeypatch):
    """Where F.linear times fastest for every row count (a tiny model on a busy machine: CI saw it), the float32
    layers take it, but the layers with GGUF blocks keep reading them: `--weights q4_1` stays the model asked for,
    not its dequantized weights times unrounded inputs."""
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    base = quantized_tiny_base(tmp_path / "tiny.gguf")
    save_base(base, str(tmp_path / "base"))
    head = random_draft(base, str(tmp_path / "head"))
    monkeypatch.setattr("eagle.model.ea_model.few_row_plan", lambda model, log=None: few_rows.uniform_plan("linear"))
    monkeypatch.setattr("eagle.model.ea_model.panel_tiling", lambda model, log=None: quant_panels.default_tiling())
    model = EaModel.from_pretrained(str(tmp_path / "base"), head, total_token=8, depth=3, top_k=4,
                                    few_row_kernels="auto", dtype=torch.float32)  # fmt: skip
    assert few_rows.plan_of(model.base_model) == few_rows.uniform_plan("linear")
    assert few_rows.weights_of(model.base_model) == "q4_1 (14 layers), q8_0 (lm_head)"
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad(), few_rows.few_row_kernels():
        timed_linear = model.base_model(ids).logits
        few_rows.set_plan(model.base_model, few_rows.uniform_plan("panel"))
        assert torch.equal(model.base_model(ids).logits, timed_linear)


@needs_kernel
def test_a_model_that_is_not_the_ggufs_is_refused_with_the_fix(tmp_path):
    base = quantized_tiny_base(tmp_path / "tiny.gguf")
    with torch.no_grad():
        base.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    with pytest.raises(quant_gguf.GgufMismatch, match=r"layers\.1\.mlp\.down_proj.*--weights fp32"):
        few_rows.install(base)


@needs_kernel
def test_greedy_eagle_equals_greedy_vanilla_at_q4_1_weights(tmp_path):
    """Every verify pass (8 rows of a tree) gives each row the logits a one-row step gives it: the batch-invariant
    kernel, so EAGLE's greedy tokens are vanilla's, bit for bit, on the quantized weights."""
    base = quantized_tiny_base(tmp_path / "tiny.gguf", layers=4)
    config, state = read_checkpoint(random_draft(base, str(tmp_path / "draft")))
    model = EaModel(base, load_head(base, config, state), None, total_token=8, depth=3, top_k=4)
    assert few_rows.weights_of(base).startswith("q4_1")
    new_tokens = forwards = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        vanilla = model.naivegenerate(ids, max_new_tokens=40, stop_token_ids=[])
        eagle, n, rounds = model.eagenerate(ids, max_new_tokens=40, stop_token_ids=[], log=True)
        assert eagle.tolist() == vanilla.tolist()
        new_tokens, forwards = new_tokens + n, forwards + rounds + 1
    assert new_tokens / forwards > 1.05, "no drafted token was accepted: the verify passes were not exercised"


@needs_kernel
def test_a_traced_graph_calls_the_quantized_kernel_on_the_siblings_panels(tmp_path):
    """In a graph (compiled.py traces the base), a layer with GGUF blocks calls the quantized operator, on its
    siblings' shared panels where it has siblings, and the graph computes what eager code does."""
    from torch._dynamo.testing import CompileCounterWithBackend

    base = quantized_tiny_base(tmp_path / "tiny.gguf", layers=1)
    few_rows.install(base)
    layer = base.model.layers[0]
    x = torch.randn(1, 8, 64)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    with torch.no_grad():
        out = torch.compile(layer.mlp, backend=counter, fullgraph=True)(x)
        with few_rows.few_row_kernels():
            assert torch.equal(out, layer.mlp(x))
    targets = [n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    # gate and up make the same call on their shared panels (freezing keeps one), down its own
    assert targets.count(torch.ops.eagle.quant_panel_linear) == 3
    assert torch.ops.eagle.panel_linear not in targets


@needs_kernel
def test_a_base_read_from_its_gguf_streams_its_weights_and_a_quantized_head_keeps_its_own(tmp_path):
    """A base's pass reads each weight once and outgrows the caches before reading it again, so its GGUF blocks go to
    the kernel as `streamed` (prefetched past the caches where the tiling says so); a draft head's weights are read
    again within the round, so its Q4_1 blocks are not: what the graphs pass to the operator."""
    from torch._dynamo.testing import CompileCounterWithBackend

    base = quantized_tiny_base(tmp_path / "tiny.gguf", layers=1)
    few_rows.install(base)
    config, state = read_checkpoint(random_draft(base, str(tmp_path / "draft")))
    head = load_head(base, config, state)
    assert few_rows.quantize(head) > 0
    head_layer = next(m for m in head.modules() if type(m) is few_rows.FewRowLinear and m.gguf is not None)

    def streamed_flags(fn, x) -> set:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("eager")
        with torch.no_grad():
            torch.compile(fn, backend=counter, fullgraph=True)(x)
        calls = [n for g in counter.graphs for n in g.graph.nodes if n.target == torch.ops.eagle.quant_panel_linear]
        assert calls
        return {n.args[6] if len(n.args) > 6 else n.kwargs.get("streamed", False) for n in calls}

    assert streamed_flags(base.model.layers[0].mlp, torch.randn(1, 4, 64)) == {True}
    assert streamed_flags(base.lm_head, torch.randn(1, 4, 64)) == {True}
    assert streamed_flags(head_layer, torch.randn(1, 4, head_layer.in_features)) == {False}


@needs_kernel
def test_compiled_greedy_eagle_equals_compiled_greedy_vanilla_at_q4_1_weights(tmp_path):
    """The inductor graphs (compiled.py) freeze the GGUF blocks' panels and call the quantized operator: greedy
    EAGLE through the 8-row graph equals greedy vanilla through the 1-row graph (a compile of each: 20 s)."""
    base = quantized_tiny_base(tmp_path / "tiny.gguf", layers=4)
    config, state = read_checkpoint(random_draft(base, str(tmp_path / "draft")))
    model = EaModel(base, load_head(base, config, state), None, total_token=8, depth=3, top_k=4)
    graphs = model.compile_base((1, 8))
    graphs.warm()
    model.base.compiled = graphs
    assert few_rows.weights_of(base).startswith("q4_1") and graphs.graphs.linears(8) == "panel kernel"
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        vanilla = model.naivegenerate(ids, max_new_tokens=40, stop_token_ids=[])
        assert model.eagenerate(ids, max_new_tokens=40, stop_token_ids=[]).tolist() == vanilla.tolist()
