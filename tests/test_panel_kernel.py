"""The panel kernel (eagle/kernels/panel_kernel.py, panel_linear.cpp): built here with the machine's compiler,
F.linear's product for any shape, each row independent of the others, and cached per source, torch and CPU."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_builds import AVX2
from torch import nn

from eagle.kernels import few_rows, panel_kernel
from eagle.kernels.few_rows import few_row_kernels, install, set_plan, uniform_plan

needs_kernel = pytest.mark.skipif(not panel_kernel.available(), reason=f"panel kernel: {panel_kernel._state.get('why')}")


@needs_kernel
@pytest.mark.parametrize("n, k", [(1, 1), (47, 5), (48, 64), (49, 64), (200, 96), (3 * 48 + 7, 33)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17])
def test_panel_linear_equals_f_linear_for_any_shape(n, k, rows):
    torch.manual_seed(n * 100 + rows)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(2, rows, k)
    panels = panel_kernel.pack(w)
    assert panels.shape == (-(-n // panel_kernel.width()), k, panel_kernel.width())
    for bias in (None, b):
        out = torch.ops.eagle.panel_linear(x, panels, bias, n)
        assert out.shape == (2, rows, n) and out.is_contiguous()
        torch.testing.assert_close(out, nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_row_of_the_panel_kernel_does_not_depend_on_the_other_rows():
    """Padding rows and tree siblings never change a row's result, bit for bit (rows in tiles of any size)."""
    torch.manual_seed(0)
    w = torch.randn(100, 64)
    panels = panel_kernel.pack(w)
    x = torch.randn(1, 64)
    alone = torch.ops.eagle.panel_linear(x, panels, None, 100)
    for rows in (2, 5, 8, 13, 16):
        others = 100 * torch.randn(rows - 1, 64)
        assert torch.equal(torch.ops.eagle.panel_linear(torch.cat([x, others]), panels, None, 100)[:1], alone)
        assert torch.equal(torch.ops.eagle.panel_linear(torch.cat([others, x]), panels, None, 100)[-1:], alone)


@needs_kernel
def test_panels_that_do_not_match_the_weight_are_refused_with_the_fix():
    panels = panel_kernel.pack(torch.randn(96, 32))
    with pytest.raises(RuntimeError, match="pack the weight with eagle.kernels.panel_kernel.pack"):
        torch.ops.eagle.panel_linear(torch.randn(1, 31), panels, None, 96)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.eagle.panel_linear(torch.randn(1, 32, dtype=torch.bfloat16), panels, None, 96)


@needs_kernel
def test_panel_copies_exist_only_while_the_plan_uses_them():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    install(model, {1: "linear"})
    assert all(m.panels is None for m in model)
    set_plan(model, uniform_plan("panel"))
    assert all(m.panels is not None for m in model)
    x = torch.randn(3, 16)
    with few_row_kernels():
        out = model(x)
    ref = nn.functional.linear(nn.functional.linear(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    set_plan(model, {4: "wxt"})
    assert all(m.panels is None for m in model)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_sibling_layers_keep_their_panels_in_one_tensor_and_compute_the_same(arch):
    """q/k/v and gate/up (few_rows.SIBLINGS) read the same input: their panels are made as one tensor, each layer's
    own a view of it, and the siblings' product sliced to a layer's columns (what a graph computes) is that layer's
    own product, bit for bit, whatever their widths (zero columns pad each one's last panel)."""
    from tiny import tiny_base

    model = tiny_base(arch, layers=1, hidden_size=40, intermediate_size=56)  # q 40, k and v 20 columns
    install(model, uniform_plan("panel"))
    layer = model.model.layers[0]
    groups = [[layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
              [layer.mlp.gate_proj, layer.mlp.up_proj]]  # fmt: skip
    x = torch.randn(1, 5, 40)
    for group in groups:
        shared = group[0].siblings.panels
        for linear in group:
            assert linear.siblings.panels is shared
            assert linear.panels.data_ptr() == shared.data_ptr() + linear.siblings.start * shared.shape[1] * 4
            assert torch.equal(linear.panels, panel_kernel.pack(linear.weight))
            s = linear.siblings
            together = torch.ops.eagle.panel_linear(x, s.panels, s.bias, s.out_features)
            alone = torch.ops.eagle.panel_linear(x, linear.panels, linear.bias, linear.out_features)
            assert torch.equal(together[..., s.start : s.start + linear.out_features], alone)
            torch.testing.assert_close(alone, nn.functional.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    assert layer.self_attn.o_proj.siblings is None and layer.mlp.down_proj.siblings is None
    set_plan(model, {1: "wxt"})
    assert all(m.panels is None and m.siblings is None for m in few_rows._layers(model))


@needs_kernel
def test_a_traced_graph_calls_the_panel_kernel_for_the_rows_the_plan_gives_it():
    """In a graph (compiled.py traces the base), the rows planned for "panel" call the operator, other rows F.linear."""
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = nn.Linear(40, 24)
    install(layer, {4: "panel", 2: "wxt"})
    for rows, op in ((4, torch.ops.eagle.panel_linear), (2, torch._C._nn.linear)):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("eager")
        x = torch.randn(1, rows, 40)
        out = torch.compile(layer, backend=counter, fullgraph=True)(x)
        torch.testing.assert_close(out, nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        targets = [n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
        assert op in targets, targets


def test_without_a_compiler_the_plan_falls_back_to_f_linear(monkeypatch, tmp_path):
    monkeypatch.setattr(panel_kernel, "_state", {})  # not built yet in this process
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    lines = []
    assert not panel_kernel.available(lines.append)
    assert "panel" not in few_rows.usable_kernels()
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "panel kernel unavailable" in lines[0]
    model = nn.Sequential(nn.Linear(16, 16))
    install(model, {1: "linear"})
    assert set_plan(model, {1: "panel", 2: "wxt"}) == {1: "linear", 2: "wxt"} and model[0].panels is None


@needs_kernel
def test_the_library_is_cached_per_cpu_and_source(monkeypatch):
    cxx = panel_kernel._compiler()
    here = panel_kernel.library_path(cxx)
    assert here.is_file() and here == panel_kernel._state["path"]
    monkeypatch.setattr(panel_kernel, "_cpu_identity", lambda: "model name: another CPU\nflags: avx2\n")
    assert panel_kernel.library_path(cxx) != here


CHECK = """
import sys, torch
from eagle.kernels.panel_kernel import pack, width
torch.ops.load_library(sys.argv[1])
assert width() == 16, width()  # the AVX2 build
for n, k in [(1, 1), (15, 7), (16, 64), (17, 64), (200, 96)]:
    for rows in (1, 4, 5, 6, 7, 12, 13, 16, 17):
        w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(2, rows, k)
        for bias in (None, b):
            out = torch.ops.eagle.panel_linear(x, pack(w), bias, n)
            torch.testing.assert_close(out, torch.nn.functional.linear(x, w, bias), rtol=1e-5, atol=1e-5)
x, w = torch.randn(1, 64), torch.randn(100, 64)
alone = torch.ops.eagle.panel_linear(x, pack(w), None, 100)
for rows in (2, 7, 13, 16):
    rest = 100 * torch.randn(rows - 1, 64)
    assert torch.equal(torch.ops.eagle.panel_linear(torch.cat([rest, x]), pack(w), None, 100)[-1:], alone)
"""


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
def test_the_avx2_build_computes_the_same(kernel_variant):
    """CI machines differ (AVX2 only, or AVX-512): the code for the other one is built and checked here too, in a
    process of its own (one process loads one library of the operator)."""
    library = kernel_variant(AVX2)
    root = str(Path(__file__).resolve().parents[1])  # the project, for eagle.kernels.panel_kernel.pack
    subprocess.run([sys.executable, "-c", CHECK, str(library)], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": root})  # fmt: skip
