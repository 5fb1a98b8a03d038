"""The few-row CPU linear kernels: same results as nn.Linear up to float32 rounding, and only where enabled."""

import pytest
import torch
from torch import nn

from eagle.kernels import few_rows
from eagle.kernels.few_rows import (
    MAX_ROWS, FewRowLinear, few_row_kernels, install, set_plan, uniform_plan, uninstall, usable_kernels,
)  # fmt: skip


@pytest.mark.parametrize("kernel", usable_kernels())
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_ROWS, MAX_ROWS + 1, 40])
def test_each_kernel_matches_nn_linear_for_any_row_count(rows, bias, kernel):
    torch.manual_seed(0)
    ref = nn.Linear(48, 80, bias=bias)
    fast = nn.Linear(48, 80, bias=bias)
    fast.load_state_dict(ref.state_dict())
    assert install(fast, uniform_plan(kernel)) == 1 and type(fast) is FewRowLinear
    x = torch.randn(1, rows, 48)
    with few_row_kernels():
        y = fast(x)
    assert y.shape == (1, rows, 80) and y.is_contiguous()
    torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)


def test_a_row_of_the_packed_kernel_does_not_depend_on_the_other_rows():
    """Rows of one verify pass must not leak into each other (padding rows, tree siblings)."""
    if not few_rows.packed_kernel_available():
        pytest.skip("MKL packing is not available in this torch build")
    torch.manual_seed(0)
    layer = nn.Linear(64, 96)
    install(layer, uniform_plan("packed"))
    x = torch.randn(5, 64)
    with few_row_kernels():
        alone = layer(x[:1])
        together = layer(torch.cat([x[:1], 100 * torch.randn(7, 64)]))[:1]
    assert torch.equal(alone, together)


def test_the_plan_applies_only_inside_the_context(monkeypatch):
    layer = nn.Linear(8, 4)
    install(layer, {2: "wxt"})
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(few_rows.torch, "mm", lambda *a: calls.append(1) or real_mm(*a))
    x = torch.randn(2, 8)
    layer(x)
    assert calls == []  # outside: exactly nn.Linear
    with few_row_kernels():
        layer(x)
        layer(torch.randn(3, 8))  # 3 rows are not in the plan: F.linear
    assert calls == [1]
    layer(x)
    assert calls == [1]  # the context resets on exit


def test_packed_weights_exist_only_while_the_plan_uses_them():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    install(model, {1: "linear", 2: "wxt"})
    assert all(m.packed is None for m in model)
    if few_rows.packed_kernel_available():
        set_plan(model, {4: "packed"})
        assert all(m.packed is not None for m in model)
    set_plan(model, {4: "wxt"})
    assert all(m.packed is None for m in model)
    with pytest.raises(ValueError, match="unknown few-row kernels"):
        set_plan(model, {4: "fast"})


def test_no_packed_copy_when_it_would_not_fit_in_memory(monkeypatch):
    model = nn.Sequential(nn.Linear(16, 16))
    install(model, {1: "linear"})
    monkeypatch.setattr(few_rows, "_copy_fits", lambda layers, attr: False)  # e.g. a 7B float32 base on a small machine
    assert set_plan(model, {4: "packed"}) == {4: "linear"} and model[0].packed is None


def test_install_touches_only_float32_cpu_linears():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.Embedding(5, 4))
    keys = list(model.state_dict())
    assert install(model) == 1
    assert [type(m) for m in model] == [FewRowLinear, nn.Linear, nn.Embedding]
    assert list(model.state_dict()) == keys
    assert few_rows.plan_of(model)[1] == "linear"
    assert uninstall(model) == 1 and type(model[0]) is nn.Linear and few_rows.plan_of(model) is None


@pytest.mark.parametrize(
    "kernels", [False, {1: "linear", 2: "wxt"}, "auto", True], ids=["off", "plan-without-packed", "auto-cached", "default"]
)
def test_loading_packs_no_weight_for_a_plan_without_the_packed_kernel(tmp_path, monkeypatch, kernels):
    """The plan is decided before the layers are installed: a plan without "packed" never pays a packed copy."""
    from tiny import random_draft, save_base, tiny_base

    from eagle.model import ea_model
    from eagle.model.ea_model import EaModel

    base = tiny_base("llama")
    save_base(base, str(tmp_path / "base"))
    draft = random_draft(base, str(tmp_path / "d"))
    packed = []
    reorder = few_rows.torch.ops.mkl._mkl_reorder_linear_weight if few_rows.packed_kernel_available() else None
    monkeypatch.setattr(few_rows, "packed_kernel_available", lambda: True)
    count = lambda w, n: packed.append(w) or (reorder(w, n) if reorder else w.clone())  # noqa: E731
    monkeypatch.setattr(torch.ops.mkl, "_mkl_reorder_linear_weight", count, raising=False)
    cached = {rows: "wxt" for rows in range(1, 17)}  # what a cached measurement returns
    monkeypatch.setattr(ea_model, "few_row_plan", lambda model, log=None: cached)
    model = EaModel.from_pretrained(str(tmp_path / "base"), draft, dtype=torch.float32, few_row_kernels=kernels)
    plan = few_rows.plan_of(model.base_model)
    if kernels is True:  # the default plan packs: the check sees packing where it happens
        assert packed and "packed" in plan.values()
        return
    assert packed == []
    assert plan is None if kernels is False else "packed" not in plan.values()
