"""A draft head with its linears in GGUF blocks (few_rows.quantize: Q4_1 as the app uses, or Q8_0), one of the heads a
compiled float32 base on CPU times its round with: each weight its blocks dequantized, read by the quantized panel
kernel; the output stays lossless."""

import copy

import gguf
import pytest
import torch
from lossless_checks import PROMPTS
from q4_fixtures import error_bound
from tiny import random_draft, tiny_base

from eagle.kernels import few_rows, panel_kernel, quant_panels
from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import read_checkpoint

needs_kernel = pytest.mark.skipif(
    not panel_kernel.available(), reason=f"panel kernel: {panel_kernel._state.get('why')}"
)


@pytest.fixture
def base_and_head(tmp_path):
    base = tiny_base("llama", seed=0, layers=4, hidden_size=64, intermediate_size=128)
    config, state = read_checkpoint(random_draft(base, str(tmp_path / "draft"), eagle3=True))
    return base, load_head(base, config, state)


@needs_kernel
@pytest.mark.parametrize("qtype", [None, quant_panels.Q8_0], ids=["q4_1 by default", "q8_0"])
def test_a_quantized_head_holds_its_blocks_dequantized_and_reads_them(base_and_head, qtype):
    _, head = base_and_head
    quantized = copy.deepcopy(head)
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, torch.nn.Linear)}
    eligible = {n for n, m in layers.items() if m.in_features % 32 == 0}
    args = () if qtype is None else (qtype,)
    assert few_rows.quantize(quantized, *args) == len(eligible) > 0  # made few-row layers, then rounded
    assert all(type(m) is few_rows.FewRowLinear for m in layers.values())
    expected = quant_panels.Q4_1 if qtype is None else qtype
    assert quantized.dtype_name == quant_panels.NAMES[expected] and head.dtype_name == "float32"
    x = torch.randn(3, 64 * 3)
    fc = layers["fc"]
    held, blocks = fc.gguf
    assert held == expected
    ref = gguf.quantize(head.fc.weight.detach().numpy(), gguf.GGMLQuantizationType(expected))
    assert torch.equal(blocks, torch.from_numpy(ref).reshape(blocks.shape))
    assert torch.equal(fc.weight, quant_panels.dequantize(held, blocks))  # the weights the kernel multiplies
    with torch.no_grad(), few_rows.few_row_kernels():
        out = fc(x)
    exact = torch.nn.functional.linear(x.double(), fc.weight.double(), fc.bias.double() if fc.bias is not None else None)
    assert ((out - exact).abs() <= error_bound(x, held, blocks, fc.bias)).all()


@needs_kernel
def test_greedy_eagle_with_a_q4_1_head_equals_greedy_vanilla(base_and_head):
    base, head = base_and_head
    few_rows.quantize(head)
    model = EaModel(base, head, None, total_token=8, depth=3, top_k=2)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        vanilla = model.naivegenerate(ids, max_new_tokens=24, stop_token_ids=[])
        assert model.eagenerate(ids, max_new_tokens=24, stop_token_ids=[]).tolist() == vanilla.tolist()


@needs_kernel
def test_the_app_loads_the_same_q4_1_head_in_every_process(tmp_path):
    """The app's compile children and the page's process each load the head the graphs freeze (app/precompile.py):
    with Q4_1 weights, the same ones bit for bit (the compiled graphs' cache keys are their weights)."""
    from app.precompile import load_compiled_head

    base = tiny_base("llama", seed=0, layers=4, hidden_size=64, intermediate_size=128)
    folder = random_draft(base, str(tmp_path / "draft"), eagle3=True)
    first, second = (load_compiled_head(base, folder, "q4_1") for _ in range(2))
    assert first.dtype_name == "q4_1" and first.fc.weight.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert load_compiled_head(base, folder, "bfloat16").fc.weight.dtype == torch.bfloat16


@needs_kernel
def test_the_app_compiles_the_q4_1_head_and_a_4_row_graph_for_a_base_reading_gguf_blocks(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from q4_fixtures import quantized_tiny_base

    from app.cli import compile_spec
    from eagle.model import compiling

    base = quantized_tiny_base(tmp_path / "tiny.gguf", layers=4)
    config, state = read_checkpoint(random_draft(base, str(tmp_path / "draft"), eagle3=True))
    model = EaModel(base, load_head(base, config, state), None, total_token=8, depth=3, top_k=2)
    loaded = SimpleNamespace(model=model, base_path="base", head_path="draft", dtype="float32")
    spec = compile_spec(loaded)
    assert spec.draft_dtype == "float32" and spec.base_buckets == (1, 4, 8)  # a tiny head stays in float32
    monkeypatch.setattr(compiling, "QUANTIZED_HEAD_MIN_BYTES", 0)
    assert compile_spec(loaded).draft_dtype == "q4_1"
    few_rows.uninstall(base)  # float32 weights: no 4-row graph
    assert compile_spec(loaded).base_buckets == (1, 8)
