"""The few-row CPU linear path: same results as nn.Linear up to float32 rounding, and only where it is enabled."""

import pytest
import torch
from torch import nn

from eagle.model import few_rows
from eagle.model.few_rows import MAX_ROWS, FewRowLinear, few_row_kernels, install, uninstall


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, MAX_ROWS, MAX_ROWS + 1, 40])
def test_few_row_linear_matches_nn_linear(rows, bias):
    torch.manual_seed(0)
    ref = nn.Linear(48, 80, bias=bias)
    fast = nn.Linear(48, 80, bias=bias)
    fast.load_state_dict(ref.state_dict())
    assert install(fast) == 1 and type(fast) is FewRowLinear
    x = torch.randn(1, rows, 48)
    with few_row_kernels():
        y = fast(x)
    assert y.shape == (1, rows, 80)
    torch.testing.assert_close(y, ref(x), rtol=1e-5, atol=1e-5)


def test_the_fast_path_runs_only_inside_the_context(monkeypatch):
    layer = nn.Linear(8, 4)
    install(layer)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(few_rows.torch, "mm", lambda *a: calls.append(1) or real_mm(*a))
    x = torch.randn(2, 8)
    layer(x)
    assert calls == []  # outside: exactly nn.Linear
    with few_row_kernels():
        layer(x)
    assert calls == [1]
    layer(x)
    assert calls == [1]  # the context resets on exit


def test_install_touches_only_float32_cpu_linears():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.Embedding(5, 4))
    keys = list(model.state_dict())
    assert install(model) == 1
    assert [type(m) for m in model] == [FewRowLinear, nn.Linear, nn.Embedding]
    assert list(model.state_dict()) == keys
    assert uninstall(model) == 1 and type(model[0]) is nn.Linear
