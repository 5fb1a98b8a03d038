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


def tree_mask(prefix_len, ancestors: torch.Tensor, dtype: torch.dtype, device, span: int | None = None) -> torch.Tensor:
    """Mask for n tree rows after `prefix_len` committed positions: all of the prefix, plus their ancestors
    ([n, n] bool); built where `device` is, from ancestors already there (no host sync). span: see `with_tree`."""
    ancestors = ancestors.to(device)
    if span is None:
        n = ancestors.shape[0]
        allowed = torch.ones(n, prefix_len + n, dtype=torch.bool, device=device)
        allowed[:, prefix_len:] = ancestors
        return additive_mask(allowed, dtype)
    seen = torch.arange(span, device=device) < prefix_len  # [span]
    return additive_mask(with_tree(seen, ancestors, prefix_len, span), dtype)


def with_tree(seen: torch.Tensor, ancestors: torch.Tensor, tree_at, span: int | None = None) -> torch.Tensor:
    """bool [q, width]: rows that see the key positions `seen` and, of the m tree entries written at positions
    tree_at, tree_at + 1, ..., those `ancestors` [q, m] marks.

    span None: the keys end with the tree (tree_at an int, seen [tree_at], width tree_at + m); an int: the keys are a
    static span of the cache (tree_at a [] long tensor, seen [span], width span), shapes that do not follow the
    context, for CUDA graphs (cuda_round.py)."""
    q, m = ancestors.shape
    if span is None:
        return torch.cat([seen.expand(q, -1), ancestors], dim=1)
    at = torch.arange(span, device=ancestors.device) - tree_at  # [span] each key's index among the tree entries
    inside = (at >= 0) & (at < m)  # [span]
    return seen[None] | (ancestors.index_select(1, at.clamp(0, m - 1)) & inside)
