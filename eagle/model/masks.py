"""Attention masks for the engine's passes, additive ([1, 1, q, k] float: 0 where a row may attend, the dtype's min
elsewhere): causal prefixes, tree rows that see their ancestors, and masks widened to a static buffer's capacity."""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [q, k] (True = may attend) -> float [1, 1, q, k]: 0 where allowed, the dtype's min elsewhere.

    A float mask, not a bool one: eager attention adds the mask to the scores."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def widened(mask: torch.Tensor, width: int) -> torch.Tensor:
    """An additive mask [1, 1, q, k] -> [1, 1, q, width]: the positions after the k-th masked out."""
    return torch.nn.functional.pad(mask, (0, width - mask.shape[-1]), value=torch.finfo(mask.dtype).min)


def tree_mask(prefix_len: int, ancestors: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """Mask for n tree rows after `prefix_len` committed positions: all of the prefix, plus their ancestors
    ([n, n] bool); built where `device` is, from ancestors already there (no host sync)."""
    n = ancestors.shape[0]
    allowed = torch.ones(n, prefix_len + n, dtype=torch.bool, device=device)
    allowed[:, prefix_len:] = ancestors.to(device)
    return additive_mask(allowed, dtype)
