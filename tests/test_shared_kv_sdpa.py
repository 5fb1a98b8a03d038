"""SDPA with shared key/value heads (eagle/kernels/shared_kv_sdpa.py) attends as transformers' own SDPA does, without
copying heads, and a CPU base attends with it wherever the row operator does not take over."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_base
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eagle.kernels import shared_kv_sdpa
from eagle.models.base import BaseModel


class Layer(nn.Module):
    num_key_value_groups = 2  # 4 query heads over 2 key/value heads
    is_causal = True


def qkv(q: int, kv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, q, 8, generator=g), torch.randn(1, 2, kv, 8, generator=g),
            torch.randn(1, 2, kv, 8, generator=g))  # fmt: skip


def tree_mask(q: int, prefix: int, extra: int = 0) -> torch.Tensor:
    """Additive [1, 1, q, prefix + q + extra]: the prefix for every row, each row itself and row 0 (a tree's root),
    nothing past the rows (a cache's unwritten slack)."""
    mask = torch.full((q, prefix + q + extra), float("-inf"))
    mask[:, :prefix] = 0
    mask[:, prefix] = 0
    mask[torch.arange(q), prefix + torch.arange(q)] = 0
    return mask[None, None]


@pytest.mark.parametrize(
    "q, kv, mask",
    [
        (5, 12, tree_mask(5, 7)),  # a verify pass over a tree
        (5, 12, tree_mask(5, 7, extra=3)),  # a mask wider than the keys: the keys' columns only
        (5, 12, tree_mask(5, 7) == 0),  # the same as a bool mask
        (1, 12, None),  # a decode step
        (6, 6, None),  # a prompt, causal by SDPA's own rule
        (6, 10, None),  # a prompt over a static cache's unwritten keys: those are dropped
    ],
)
def test_shared_heads_attend_as_transformers_sdpa(q, kv, mask):
    query, key, value = qkv(q, kv)
    ours, _ = shared_kv_sdpa.attention(Layer(), query, key, value, mask)
    theirs, _ = sdpa_attention_forward(Layer(), query, key, value, None if mask is None else mask[..., :kv])
    assert ours.shape == theirs.shape == (1, q, 4, 8)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_a_cpu_base_without_the_row_operator_attends_with_shared_heads():
    model = tiny_base("llama", layers=2)
    assert model.config._attn_implementation == "sdpa"
    BaseModel(model, eagle3=False, few_row_plan=False)  # checks its logits against the model's own forward
    assert model.config._attn_implementation == shared_kv_sdpa.NAME


def test_only_transformers_sdpa_is_switched():
    model = tiny_base("llama", layers=1)
    model.set_attn_implementation("eager")
    assert not shared_kv_sdpa.install(model) and model.config._attn_implementation == "eager"
