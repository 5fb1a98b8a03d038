"""Batch-invariant attention for the float32 CPU bases that run the panel kernel (`torch.ops.eagle.row_attention`,
row_attention.cpp, in the kernel library), and for their draft heads (draft_head.py calls the operator).

Why, for bases whose linears read GGUF blocks: the quantized kernel (quant_linear.cpp) rounds each linear's inputs to 8 or 16 bits a block, so a difference of one
float32 unit in an input can move a rounding step and grow from layer to layer. Greedy EAGLE equals greedy vanilla
only if a tree node's forward is bit for bit the one-row step of the same token, and library attention is not:
it sums a row over every cached position in vector lanes fixed by position, so the masked gaps of a tree shift the
lanes of later keys. This attention computes each row over only the keys it may see, in cache order, the same
operations whatever the other rows are. For every base: a decode step's or a tree's few rows over a long cache take
a fraction of the time of ATen's flash attention, which is blocked for many rows.

`install(model)` registers it with transformers (an attention function and its mask function, under NAME) and
switches the model's config to it; `uninstall(model)` switches back. Eager forwards and inductor graphs call the
same operator.
"""

from __future__ import annotations

import torch
from torch import nn

NAME = "eagle_rows"  # the attention implementation's name in transformers' registries


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function interface: query [1, Hq, q, D], key and value [1, Hkv, L, D], the mask
    additive or bool [1, 1, q, >= L] or None (causal) -> ([1, q, Hq, D], None)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.eagle.row_attention(query, key, value, attention_mask, scale), None


def causal_mask(*args, **kwargs):
    """The mask function for NAME: no tensor, the operator's causal rule (each row sees the keys up to its own)."""
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, causal_mask)


def supported(model: nn.Module) -> bool:
    """A transformers model whose decoder layers are all of full causal attention (the mask function knows the
    causal rule only: no sliding windows)."""
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
