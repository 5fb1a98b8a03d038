"""Compiled base forwards: the vanilla step and the tree verify pass as inductor graphs (torch.compile).

What is compiled is `BaseModel.decode`, transformers' own decoder plus the lm_head and the base's logit processing,
for a fixed number of new rows, a *bucket*: 1 (the vanilla step) and 16 (tree verification). The context length
stays symbolic (`dynamic=True`), so a bucket compiles once and never again as the context grows or a new cache is
allocated. A tree with fewer rows than its bucket is padded with rows that see only the committed prefix and
themselves; their logits, features and cache rows are dropped before anyone sees them, so padding never changes
the output. Prefill, and trees wider than the largest bucket, run eagerly.

Where the time goes that this removes: on a 2-core CPU a SmolLM2-135M forward spends about as long in the
small operations between the matmuls (norms, rotary, attention, residuals, Python dispatch) as in the matmuls
themselves; inductor fuses them into a few C++/OpenMP loops per layer. The few-row kernels stay what the plan
says (`few_rows.py`); the MKL-packed one enters the graph as an opaque custom op.

Compiled artefacts are cached on disk under `cache_dir()/inductor` (TORCHINDUCTOR_CACHE_DIR if set). Measured on
a 2-core Intel Xeon: 1-2.5 min a bucket the first time, and still ~60-70 s a bucket at a later start (the cache
saves less than it should here; not yet understood).
On CUDA the same graphs would want CUDA graphs over static buffers; that is not built yet (`compile` is CPU
only and refuses CUDA with a message).
"""

from __future__ import annotations

import os
import time

import torch

from .base import additive_mask

BUCKETS = (1, 16)


def use_project_inductor_cache() -> str:
    """Point inductor's on-disk cache at the project cache unless the user chose one; returns the folder."""
    from eagle.fetch import cache_dir

    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(cache_dir() / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def bucket_for(rows: int, buckets=BUCKETS) -> int | None:
    return next((b for b in buckets if b >= rows), None)


def pad_rows(
    input_ids: torch.Tensor,  # [1, q]
    position_ids: torch.Tensor,  # [1, q]
    mask: torch.Tensor,  # additive [1, 1, q, L + q]
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad q new rows to `rows`: pad tokens repeat the last real one at its position and attend to the L
    prefix positions and themselves only; no real row attends to a pad. Returns ids, positions [1, rows] and
    the mask [1, 1, rows, L + rows]."""
    q = input_ids.shape[1]
    pad = rows - q
    if pad == 0:
        return input_ids, position_ids, mask
    prefix = mask.shape[-1] - q
    ids = torch.cat([input_ids, input_ids[:, -1:].expand(1, pad)], dim=1)
    positions = torch.cat([position_ids, position_ids[:, -1:].expand(1, pad)], dim=1)
    blocked = torch.finfo(mask.dtype).min
    full = torch.full((1, 1, rows, prefix + rows), blocked, dtype=mask.dtype, device=mask.device)
    full[:, :, :q, : prefix + q] = mask
    full[:, :, q:, :prefix] = 0
    pads = torch.arange(q, rows, device=mask.device)
    full[0, 0, pads, prefix + pads] = 0
    return ids, positions, full


class CompiledDecode:
    """`BaseModel.decode` compiled for each bucket; `run` pads, calls the graph and drops the pads."""

    def __init__(self, base, buckets=BUCKETS):
        if base.lm_head.weight.device.type != "cpu":
            raise ValueError("compiled rounds are built for CPU (inductor) only; on CUDA use compile='off'")
        use_project_inductor_cache()
        self.buckets = tuple(sorted(buckets))
        self.base = base
        self.graph = torch.compile(base.decode, dynamic=True)

    def bucket(self, rows: int) -> int | None:
        return bucket_for(rows, self.buckets)

    def run(self, input_ids, position_ids, mask, cache, features: bool):
        """Like `BaseModel.decode` on q <= max bucket rows, with the cache left at length L + q."""
        q = input_ids.shape[1]
        rows = self.bucket(q)
        # fresh row-major tensors: a slice of a longer one keeps its strides, and strides are guarded (a recompile)
        ids, positions, mask = (t.new_empty(t.shape).copy_(t) for t in pad_rows(input_ids, position_ids, mask, rows))
        logits, feats = self.graph(ids, positions, mask, cache, features, False)
        cache.crop_to(cache.length - (rows - q))  # the pads' rows
        return logits[:q], None if feats is None else feats[:q]

    def warm(self, log=None, context: int = 64) -> dict[int, float]:
        """Compile every bucket now (a forward over dummy tokens); returns seconds per bucket."""
        seconds = {}
        cache = self.base.new_cache(context + max(self.buckets))
        with torch.inference_mode():
            ids = torch.zeros(1, context, dtype=torch.long)
            # eager, with features: transformers installs its hidden-state hooks on first use (a graph break if
            # that happened inside the graph)
            self.base.forward(ids, torch.arange(context)[None], cache, features=True, last_logits_only=True)
            for rows in self.buckets:
                t0 = time.perf_counter()
                ids = torch.zeros(1, rows, dtype=torch.long)
                positions = torch.arange(context, context + rows)[None]
                allowed = torch.ones(rows, context + rows, dtype=torch.bool).tril(context)
                # the vanilla step (1 row) needs no features, a verify pass (more rows) does
                self.run(ids, positions, additive_mask(allowed, self.base.dtype), cache, features=rows > 1)
                cache.crop_to(context)
                seconds[rows] = time.perf_counter() - t0
                if log:
                    log(f"compiled the {rows}-row forward in {seconds[rows]:.1f} s")
        return seconds
