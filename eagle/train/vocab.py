"""The EAGLE-3 reduced draft vocabulary: the N target ids most frequent in the training replies.

    used = the N most frequent target ids at loss-masked positions, sorted ascending      # [N]
    d2t[i] = used[i] - i          (draft id i -> target id i + d2t[i])                     # [N] long
    t2d[v] = v in used            (which target ids the draft can produce)                 # [V] bool
"""

from __future__ import annotations

import torch


def token_counts(ids_and_masks, vocab_size: int) -> torch.Tensor:
    """Count target ids at loss-masked positions. `ids_and_masks`: iterable of (ids [T], mask [T]). -> [V] long"""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in ids_and_masks:
        counts += torch.bincount(ids[mask.bool()].long(), minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [V] -> (d2t [N] long, t2d [V] bool) with N = min(size, V).

    Ties (including never-seen ids when fewer than N ids occur) go to the lower id, so the result is
    deterministic."""
    vocab_size = counts.numel()
    size = min(size, vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: equal counts keep id order
    used = torch.sort(order[:size]).values  # [N] ascending
    d2t = used - torch.arange(size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def used_ids(d2t: torch.Tensor) -> torch.Tensor:
    """d2t [N] -> the target id of every draft id [N]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of the counted reply tokens that the draft vocabulary covers."""
    total = counts.sum().item()
    return counts[t2d].sum().item() / total if total else 0.0
