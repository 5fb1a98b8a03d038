"""Faster float32 linear layers on CPU for the few-row forwards of decoding (1 to MAX_ROWS rows).

A decode step or a tree verification streams every weight of the base once for a handful of rows, so its speed
is memory bandwidth. MKL leaves much of it unused there: its GEMV (one row) runs on one thread, and its GEMM
repacks the weight on every call. W @ x^T with 2 or 4 columns streams the weight once on all threads (1 and 3
rows get one repeated column; odd counts take a slower kernel). Measured on SmolLM2-135M, 2 cores
(`python -m eagle.evaluation.pass_cost`): a 1-row forward 43 -> 27 ms, 4 rows 68 -> 30 ms; none beyond 4 rows.
The threads pay off while one thread runs the model: the app gives its model calls to the main thread
(app/engine.py).

The results equal F.linear up to float32 rounding (a different summation order), the same kind of difference a
batched tree verification already has against one-row decoding. The faster path runs only inside
`few_row_kernels()` (BaseModel enters it), so the same model used directly (`generate`) behaves as loaded.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

MAX_ROWS = 4
_enabled = contextvars.ContextVar("few_row_kernels", default=False)


class FewRowLinear(nn.Linear):
    """nn.Linear whose forward takes the W @ x^T path for few rows inside `few_row_kernels()`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows > MAX_ROWS or not _enabled.get():
            return super().forward(x)
        flat = x.reshape(rows, x.shape[-1])  # [rows, in]
        if rows % 2:
            flat = torch.cat((flat, flat[:1]))  # [rows + 1, in]: 2 or 4 columns
        # x^T as the transposed view of a row-major x: a row-major [in, rows] operand took a 3x slower MKL kernel
        # (down_proj's input, when it was an earlier output's view). The result is row-major, as F.linear's.
        out = torch.mm(self.weight, flat.contiguous().T)[:, :rows].T.contiguous()  # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def install(model: nn.Module) -> int:
    """Give the float32 CPU nn.Linear layers of `model` the few-row path; returns how many. Parameters, state
    dict keys and behaviour outside `few_row_kernels()` stay the same."""
    n = 0
    for module in model.modules():
        w = module.weight if type(module) is nn.Linear else None
        if w is not None and w.device.type == "cpu" and w.dtype == torch.float32:
            module.__class__ = FewRowLinear
            n += 1
    return n


def uninstall(model: nn.Module) -> int:
    """Undo `install` (to measure what the path gives); returns how many layers went back to nn.Linear."""
    n = 0
    for module in model.modules():
        if type(module) is FewRowLinear:
            module.__class__ = nn.Linear
            n += 1
    return n


@contextlib.contextmanager
def few_row_kernels():
    token = _enabled.set(True)
    try:
        yield
    finally:
        _enabled.reset(token)
