"""transformers' SDPA attention with each key/value head shared by its query heads (`enable_gqa`), not copied to
every one of them (`repeat_kv`, which transformers' own SDPA does whenever a mask is given, as in every tree pass):
the same products without the copies. Registered with transformers under NAME; `install(model)` switches a model
whose attention is transformers' "sdpa" to it, as BaseModel does for a base on the CPU (its eager forwards and its
compiled graphs alike). Not for CUDA, where a masked call with shared heads would fall back to SDPA's math kernel.
row_attention.py falls back to it too.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

NAME = "eagle_sdpa"  # the attention implementation's name in transformers' registries


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
              **kwargs):  # fmt: skip
    """transformers' attention-function interface: query [b, Hq, q, D], key and value [b, Hkv, L, D], the mask
    additive or bool [b, 1, q, >= L] or None -> ([b, q, Hq, D], None)."""
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError(f"attention {NAME!r} takes neither softcap nor position_bias; load the model with "
                         "attn_implementation='eager'")  # fmt: skip
    q, kv = query.shape[2], key.shape[2]
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, :kv]  # [b, 1, q, L]
    # causal by SDPA's own rule only without a mask and over as many keys as queries (its diagonal is the top-left
    # one); transformers' mask functions leave the mask out only then, as for its own SDPA
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = q > 1 and attention_mask is None and is_causal
    if causal and kv > q:  # a prefill over an empty static cache: the keys past the queries are not written yet
        key, value = key[:, :, :q], value[:, :, :q]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal,
                                         enable_gqa=query.shape[1] != key.shape[1])  # [b, Hq, q, D]  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # SDPA's masks, as transformers' own SDPA takes them


def install(model: nn.Module) -> bool:
    """Switch `model` from transformers' "sdpa" attention to this one; False (nothing changed) for any other."""
    if getattr(getattr(model, "config", None), "_attn_implementation", None) != "sdpa":
        return False
    _register()
    model.set_attn_implementation(NAME)
    return True
