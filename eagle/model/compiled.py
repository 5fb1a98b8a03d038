"""Compiled base forwards: the vanilla step and the tree verify pass as inductor graphs (torch.compile).

What is compiled is `BaseModel.decode`, transformers' own decoder plus the lm_head and the base's logit processing,
for a fixed number of new rows, a *bucket*: 1 (the vanilla step), 4 and 8 (tree verification). The rows are
static in each graph, the context length symbolic, so a bucket compiles once and never again as the context grows
or a new cache is allocated. A tree with fewer rows than its bucket is padded with rows that see only the committed
prefix and themselves; their logits, features and cache rows are dropped before anyone sees them, so padding never
changes the output. Prefill, and trees wider than the largest bucket, run eagerly.

The weights are frozen into the graphs (inductor's `freezing`) and the matmuls are inductor's own C++ GEMM
micro-kernels (`max_autotune`, backend CPP), which pack each weight once at compile time for the bucket's rows.
A decode-sized matmul is a stream of the weight, and these kernels stream it 2-2.5x faster than MKL's GEMV/GEMM on
an AMD EPYC (a 49152 x 576 lm_head, 1 row, 2 threads: 4.7 ms vs 10.0); the small operations between the matmuls
(norms, rotary, attention, residuals) fuse into a few C++/OpenMP loops per layer. Where no CPP kernel applies to a
shape (odd sizes, as in tiny test models; every shape of the default model has one), that bucket's graph is
compiled again with MKL's kernels as candidates too (`GEMM_BACKENDS`): not first,
because autotuning times the candidates on a weight already in cache, which picks MKL for 8-16 rows where, streaming
from memory, it is slower (16 rows of the default model: 86 ms a forward with MKL allowed, 63 without).
The frozen graphs hold their own packed copy of the weights (the default model: +538 MB).

Compiled artefacts are cached on disk under `cache_dir()/inductor` (TORCHINDUCTOR_CACHE_DIR if set), but inductor's
graph cache skips these graphs ("mkldnn tensors unpickleable": the prepacked frozen weights), so each start compiles
again: about 2 minutes a bucket on a 2-core AMD EPYC (autotuning results and C++ builds are reused). Three buckets
because 16 rows cost 2.7 one-row forwards there (1 / 4 / 8 / 16 rows: 23 / 24 / 36 / 63 ms): the tuner's trees stay
within 8 nodes, and a larger tree verifies eagerly.
On CUDA the same graphs would want CUDA graphs over static buffers; that is not built yet (`compile` is CPU
only and refuses CUDA with a message).
"""

from __future__ import annotations

import os
import time

import torch

from .base import additive_mask

BUCKETS = (1, 4, 8)
# inductor's GEMM backends, tried in order: the first whose graphs compile is kept (see the module docstring)
GEMM_BACKENDS = ("CPP", "CPP,ATEN")


def use_project_inductor_cache() -> str:
    """Point inductor's on-disk cache at the project cache unless the user chose one; returns the folder.

    Importing torch._inductor (transformers does, at model load) writes inductor's default, a folder under /tmp,
    into TORCHINDUCTOR_CACHE_DIR; that value counts as not chosen (a machine's /tmp does not outlive it)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from eagle.fetch import cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        chosen = str(cache_dir() / "inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = chosen
    return chosen


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
        self.backend: dict[int, int] = {}  # rows -> index into GEMM_BACKENDS
        self.graphs: dict[int, object] = {}  # rows -> compiled decode

    def _graph(self, rows: int):
        if rows not in self.graphs:
            gemms = GEMM_BACKENDS[self.backend.setdefault(rows, 0)]
            options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": gemms}
            graph = torch.compile(self.base.decode, dynamic=True)

            def call(*args):
                # a config scope, not torch.compile's options=: freezing is decided while dynamo traces, before
                # those options apply (with them the weights stayed graph inputs and the GEMMs plain MKL calls)
                with torch._inductor.config.patch(options):
                    return graph(*args)

            self.graphs[rows] = call
        return self.graphs[rows]

    def bucket(self, rows: int) -> int | None:
        return bucket_for(rows, self.buckets)

    def run(self, input_ids, position_ids, mask, cache, features: bool):
        """Like `BaseModel.decode` on q <= max bucket rows, with the cache left at length L + q."""
        q = input_ids.shape[1]
        rows = self.bucket(q)
        # fresh row-major tensors: a slice of a longer one keeps its strides, and strides are guarded (a recompile)
        ids, positions, mask = (t.new_empty(t.shape).copy_(t) for t in pad_rows(input_ids, position_ids, mask, rows))
        for t, rows_dim in ((ids, 1), (positions, 1), (mask, 2)):
            torch._dynamo.mark_static(t, rows_dim)  # one graph per bucket, its GEMMs built for that many rows
        length = cache.length
        try:
            logits, feats = self._graph(rows)(ids, positions, mask, cache, features, False)
        except Exception as e:  # noqa: BLE001 - inductor's NoValidChoicesError comes wrapped in its own errors
            if "NoValidChoicesError" not in str(e) or self.backend[rows] + 1 == len(GEMM_BACKENDS):
                raise
            self.backend[rows] += 1  # this bucket compiles again with the next backend
            del self.graphs[rows]
            cache.crop_to(length)
            return self.run(input_ids, position_ids, mask, cache, features)
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
                    log(f"compiled the {rows}-row forward in {seconds[rows]:.1f} s (GEMMs: "
                        f"{GEMM_BACKENDS[self.backend[rows]]})")  # fmt: skip
        return seconds
