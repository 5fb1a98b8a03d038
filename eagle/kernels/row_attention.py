"""Batch-invariant attention for the float32 CPU bases that run the panel kernel (`torch.ops.eagle.row_attention`,
row_attention.cpp, in the kernel library), and for their draft heads (draft_head.py calls the operator).

Why, for bases whose linears read GGUF blocks: the quantized kernel (quant_linear.cpp) rounds each linear's inputs
to 8 or 16 bits a block, so a difference of one float32 unit in an input can move a rounding step and grow from layer
to layer. Greedy EAGLE equals greedy vanilla only if a tree node's forward is bit for bit the one-row step of the same
token, and library attention is not: it sums a row over every cached position in vector lanes fixed by position, so
the masked gaps of a tree shift the lanes of later keys. This attention computes each row over only the keys it may
see, in cache order, the same operations whatever the other rows are. For every base: a decode step's or a tree's
few rows over a long cache take a fraction of the time of ATen's flash attention, which is blocked for many rows.

`install(model)` registers it with transformers (an attention function and its mask function, under NAME) and
switches the model's config to it; `uninstall(model)` switches back. Eager forwards and inductor graphs call the
same operator.
"""

from __future__ import annotations

import torch
from torch import nn

from . import panel_kernel, shared_kv_sdpa

NAME = "eagle_rows"  # the attention implementation's name in transformers' registries


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function interface: query [b, Hq, q, D], key and value [b, Hkv, L, D], the mask
    additive or bool [b, 1, q, >= L] or None (causal) -> ([b, q, Hq, D], None). The operator where it applies (one
    sequence, float32 on the CPU, keys and values of one width), else SDPA with shared key/value heads
    (shared_kv_sdpa.py: a batch of padded prompts, another dtype, a base whose values are narrower than its keys)."""
    if dropout != 0.0 or not applies(query, key, value, attention_mask):
        return shared_kv_sdpa.attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.eagle.row_attention(query, key, value, attention_mask, scale), None


def applies(query, key, value, mask) -> bool:
    """Whether the operator takes these inputs: one sequence, float32 on the CPU, keys and values of the query's width,
    a mask of one sequence or None, and the kernel library loaded."""
    return (
        query.shape[0] == 1 and query.device.type == "cpu" and value.shape[-1] == query.shape[-1] == key.shape[-1]
        and query.dtype == key.dtype == value.dtype == torch.float32 and (mask is None or mask.shape[0] == 1)
        and panel_kernel.loaded()
    )  # fmt: skip


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # SDPA's masks: the operator reads them, as the fallback does


def supported(model: nn.Module) -> bool:
    """A transformers model whose decoder layers are all of full causal attention (no sliding windows: the operator's
    own causal rule, for a mask of None, knows no window)."""
    if not hasattr(getattr(model, "config", None), "get_text_config"):
        return False  # not a transformers model (a draft head calls the operator itself: draft_head.py)
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None) or ()
    return not getattr(config, "sliding_window", None) and all(t == "full_attention" for t in types)


def install(model: nn.Module) -> bool:
    """Switch `model` (a transformers causal LM on CPU) to this attention; False where `supported` says no."""
    if not supported(model):
        return False
    _register()
    if not installed(model):
        model._row_attention_before = model.config._attn_implementation  # on the model: configs are saved
    model.set_attn_implementation(NAME)
    return True


def uninstall(model: nn.Module) -> None:
    before = getattr(model, "_row_attention_before", None)
    if before is not None:
        model.set_attn_implementation(before)
        del model._row_attention_before


def installed(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME
