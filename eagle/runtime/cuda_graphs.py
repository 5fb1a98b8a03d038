"""CUDA graphs of the vanilla step, the tree verify pass and the draft head's steps: the GPU's compiled rounds.

At batch size 1 a GPU forward is mostly kernel launches (a few hundred per base pass, each some microseconds of
host time against microseconds of device work), so the graphs here capture each pass once per bucket of rows and
replay it: one launch a pass. A graph holds the addresses it was captured with, so everything it reads and writes
is static: the runner owns the KV cache (a zeroed `TreeKVCache`, the base's or the head's) and one buffer per
input; a call copies its inputs into the buffers, replays, and returns copies of the outputs (the
next replay overwrites them). Shapes are static too: the rows are the bucket's (a smaller tree is padded as on the
CPU path, compiled.py: pads see the prefix and themselves and are dropped), the keys a *span* of the cache's first
positions, the smallest of `SPANS` that holds the prefix and the rows (positions past the length are masked out),
and rows are written at positions held in a device buffer; so a graph per (rows, span) serves every context length
in its span, and attention reads the live part of the cache, not its whole capacity. The host reads the device
once a round, in verification (verify.py); replays and the copies around them never wait for it.

The runner's cache is leased to one generation at a time (`lease`/`release`); a generation that finds it taken,
or needs more room, runs eagerly on a cache of its own. Prefill and trees wider than the largest bucket run eagerly
on the leased cache. The kernels under the graph are transformers' eager ones (cuBLAS, SDPA). A conversation's kept
rows (prefix_cache.py) are copied into the cache when it is leased and out of it before it is released (a cache
`lent`: its buffers are never kept).

`capture=False` runs the same buffers, padding and masks without capturing (each call runs the function on the
static buffers): how the tests check this path on a machine without CUDA.
"""

from __future__ import annotations

import functools
import threading

import torch

from eagle.models.kv_cache import TreeKVCache
from eagle.models.masks import additive_mask, widened

from .compiled import RECOMPILE_LIMIT, bucket_for, pad_rows, timed_buckets

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # base rows: the vanilla step, then trees up to 64 nodes (a GPU verifies flat)
DRAFT_BUCKETS = (1, 2, 4, 8, 16, 32)  # draft rows: a level's width (top_k), a round's commit (depth + 1)
CAPACITY = 4096  # positions in a runner's cache: prompt + reply + a tree, the app's max_length (2048) and more
SPANS = (256, 512, 1024, 2048)  # key positions a captured pass attends over, below the cache's whole capacity


def spans_of(capacity: int) -> tuple[int, ...]:
    """The spans of a cache of `capacity` positions: SPANS below it, then the capacity itself."""
    return tuple(s for s in SPANS if s < capacity) + (capacity,)


def warm_lengths(spans: tuple[int, ...], rows: int, context: int) -> list[int]:
    """Cached lengths at which a pass of `rows` rows captures every span's graph: `context`, then each span's end."""
    return sorted({context} | {max(context, span - rows) for span in spans})


class GraphedSteps:
    """One CUDA graph per key (a bucket of rows and its flags) of a function of static buffers, captured on the
    key's first call: of the function's eager kernels, or with `inductor` of inductor's fused kernels (the function
    compiled first: see `_compiled`)."""

    def __init__(self, device: torch.device, capture: bool):
        self.device = device
        self.capture = capture
        self.buffers: dict[tuple, tuple[torch.Tensor, ...]] = {}  # key -> static inputs
        self.outputs: dict[tuple, tuple] = {}  # key -> static outputs (captured)
        self.graphs: dict[tuple, object] = {}  # key -> torch.cuda.CUDAGraph, or the function (capture=False)
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for all the graphs

    def run(self, key: tuple, fn, inputs: tuple[torch.Tensor, ...], inductor: bool = False) -> tuple:
        """fn(*buffers) with `inputs` copied into the key's buffers (made like the key's first inputs; fn is
        compiled with `inductor` and captured then), through its graph; returns copies of the outputs."""
        if key not in self.buffers:
            if inductor:
                fn = _compiled(fn)
            self.buffers[key] = tuple(x.to(self.device, copy=True) for x in inputs)
            self.graphs[key] = self._capture(key, fn) if self.capture else fn
        for buffer, x in zip(self.buffers[key], inputs):
            buffer.copy_(x, non_blocking=True)
        if not self.capture:
            return self.graphs[key](*self.buffers[key])
        self.graphs[key].replay()
        return tuple(None if out is None else out.clone() for out in self.outputs[key])

    def _capture(self, key: tuple, fn):
        buffers = self.buffers[key]
        side = torch.cuda.Stream()  # warm-up off the capturing stream (lazy cuBLAS/SDPA set-up), as torch advises
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*buffers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the app captures on a thread of its own while the model thread serves replies eagerly
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs[key] = fn(*buffers)
        return graph


def _compiled(fn):
    """fn compiled by inductor, called under dynamo's limit of graphs per function raised (every key of a runner
    compiles the same function). The keys of one step differ in their span alone (an int argument): the first span
    compiles with its shapes static, the second with the span symbolic (dynamo's automatic dynamic shapes), and that
    graph serves every later span, so a step compiles twice, not once per span."""
    compiled = torch.compile(fn, dynamic=None)

    def call(*args):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args)

    return call


class LeasedCache:
    """A runner's cache (`self.cache`, `self.capacity` positions of room), leased to one generation at a time."""

    cache: object
    capacity: int
    _taken: threading.Lock

    def lease(self, capacity: int):
        """The cache, emptied, for a generation needing `capacity` positions; None if taken or too small."""
        if capacity > self.capacity or not self._taken.acquire(blocking=False):
            return None
        self._empty()
        return self.cache

    def release(self, cache) -> None:
        if cache is self.cache:
            self._taken.release()

    def _empty(self) -> None:
        raise NotImplementedError


class GraphedRunner(LeasedCache):
    """The CUDA graphs' side of runners.py's interface, shared by the base's and the head's: graphs per bucket of
    rows (`self.buckets`) over the runner's own cache (`self.cache`), leased to one generation at a time."""

    kind = "CUDA graphs"
    buckets: tuple[int, ...]

    def bucket(self, rows: int) -> int | None:
        return bucket_for(rows, self.buckets)

    def takes(self, cache, rows: int, at: int) -> bool:
        """Whether `run` takes `rows` rows written at `at` in `cache`: the runner's own, a bucket holding the rows,
        written at 2 or later (a prompt's passes run eagerly)."""
        return cache is self.cache and at > 1 and self.bucket(rows) is not None

    def capture_buckets(self, what: str, passes, log=None) -> dict[int, float]:
        """`passes(rows)` (the passes that capture a bucket at every span) for each bucket; seconds per bucket."""
        return timed_buckets(self.buckets, passes, log, lambda rows, s: (
            f"captured the {rows}-row {what} as CUDA graphs ({len(self.spans)} spans) in {s:.1f} s"))  # fmt: skip


class GraphedDecode(GraphedRunner):
    """`BaseModel.decode` as CUDA graphs per bucket over a static cache it owns; `run` as `CompiledDecode.run`."""

    def __init__(self, base, buckets=BUCKETS, capacity: int = CAPACITY, capture: bool | None = None,
                 inductor: bool = False):  # fmt: skip
        """inductor: the vanilla step's graphs (one row) of inductor's kernels, and the round's (cuda_round.py);
        wider passes (sampling's, static trees') keep their eager kernels."""
        device = base.lm_head.weight.device
        if {p.device for p in base.model.parameters()} != {device}:
            raise ValueError("CUDA graphs need the whole base on one device (device_map placed it on several)")
        self.base = base
        self.buckets = tuple(sorted(buckets))
        # + a padded pass; lent: kept rows are copied in and out (prefix_cache.py), the buffers stay the graphs'
        self.cache = TreeKVCache(base.num_layers, capacity + max(self.buckets), zeroed=True, lent=True)
        self.spans = spans_of(self.cache.capacity)
        self.capacity, self._taken = capacity, threading.Lock()
        self.steps = GraphedSteps(device, device.type == "cuda" if capture is None else capture)
        self.inductor = inductor

    def _empty(self) -> None:
        self.cache.crop_to(0)

    def _step(self, ids, positions, mask, write_positions, features: bool):
        """The captured pass: ids, positions [1, rows], mask [1, 1, rows, span], write_positions [rows]."""
        self.cache.write_positions, self.cache.read_span = write_positions, mask.shape[-1]
        try:
            return self.base.decode(ids, positions, mask, self.cache, features, False)
        finally:
            self.cache.write_positions = self.cache.read_span = None

    def run(self, input_ids, position_ids, mask, cache, features: bool):
        """Like `BaseModel.decode` on q <= max bucket rows, with the cache left at length L + q."""
        q, length = input_ids.shape[1], cache.length
        rows = self.bucket(q)
        span = bucket_for(length + rows, self.spans)
        ids, positions, mask = pad_rows(input_ids, position_ids, mask, rows)
        mask, write = widened(mask, span), torch.arange(length, length + rows, device=mask.device)
        step = functools.partial(self._step, features=features)
        inductor = self.inductor and rows == 1
        logits, feats = self.steps.run((rows, features, span), step, (ids, positions, mask, write), inductor)
        cache.crop_to(length + q)
        return logits[:q], None if feats is None else feats[:q]

    def warm(self, log=None, context: int = 64) -> dict[int, float]:
        """Capture every bucket at every span now: the vanilla step without features, verify passes with (a pass
        after `context` positions, then at the end of each longer span). Seconds per bucket, all spans."""
        context, device = min(context, self.capacity), self.base.input_device
        with torch.inference_mode():
            cache = self.lease(context)
            ids = torch.zeros(1, context + max(self.buckets), dtype=torch.long, device=device)

            def passes(rows: int) -> None:
                for length in warm_lengths(self.spans, rows, context):
                    cache.crop_to(length)  # positions past `context` hold zeros: a pass reads them masked in
                    allowed = torch.ones(rows, length + rows, dtype=torch.bool, device=device).tril(length)
                    positions = torch.arange(length, length + rows, device=device)[None]
                    self.run(ids[:, :rows], positions, additive_mask(allowed, self.base.dtype), cache, rows > 1)
                cache.crop_to(context)

            try:
                self.base.forward(ids[:, :context], torch.arange(context, device=device)[None], cache,
                                  last_logits_only=True)  # fmt: skip
                return self.capture_buckets("forward", passes, log)
            finally:
                self.release(cache)


class GraphedDraft(GraphedRunner):
    """`HeadStep` as CUDA graphs per bucket over a draft cache it owns; `run` as `CompiledDraft.run`."""

    def __init__(self, step, buckets=DRAFT_BUCKETS, capacity: int = CAPACITY, capture: bool | None = None):
        device = step.head.fc.weight.device
        self.step = step
        self.buckets = tuple(sorted(buckets))
        self.cache = step.head.new_cache(capacity + max(self.buckets), zeroed=True)
        self.cache.lent = True  # kept rows are copied in and out (prefix_cache.py), the buffers stay the graphs'
        self.spans = spans_of(self.cache.capacity)
        self.capacity, self._taken = capacity, threading.Lock()
        self.steps = GraphedSteps(device, device.type == "cuda" if capture is None else capture)

    def _empty(self) -> None:
        self.cache.length = 0

    def _step(self, hidden, ids, positions, mask, write_positions):
        return self.step(hidden, ids, positions, mask, self.cache, write_positions)

    def run(self, hidden, input_ids, position_ids, mask, cache, write_at: int):
        """hidden [1, q, H], ids and positions [1, q], mask [1, 1, q, write_at + q] -> out [q, H], log-probs
        [q, draft vocab] float32; rows written at write_at.. (the caller keeps the cache's length)."""
        q = input_ids.shape[1]
        rows = self.bucket(q)
        ids, positions, mask = pad_rows(input_ids, position_ids, mask, rows)
        hidden = torch.cat([hidden, hidden[:, -1:].expand(1, rows - q, -1)], dim=1)  # [1, rows, H]
        span = bucket_for(write_at + rows, self.spans)
        mask, write = widened(mask, span), torch.arange(write_at, write_at + rows, device=mask.device)
        out, log_probs = self.steps.run((rows, span), self._step, (hidden, ids, positions, mask, write))
        return out[:q], log_probs[:q]

    def warm(self, log=None, context: int = 64) -> dict[int, float]:
        """Capture every bucket now (a step over dummy rows after `context` cached ones); seconds per bucket."""
        head = self.step.head
        dtype, H, device = head.fc.weight.dtype, head.config.hidden_size, head.fc.weight.device
        context = min(context, self.capacity)
        with torch.inference_mode():
            cache = self.lease(context)

            def passes(rows: int) -> None:
                for at in warm_lengths(self.spans, rows, context):
                    allowed = torch.ones(rows, at + rows, dtype=torch.bool, device=device).tril(at)
                    self.run(torch.zeros(1, rows, H, dtype=dtype, device=device),
                             torch.zeros(1, rows, dtype=torch.long, device=device),
                             torch.arange(at, at + rows, device=device)[None],
                             additive_mask(allowed, dtype), cache, at)  # fmt: skip

            try:
                return self.capture_buckets("draft step", passes, log)
            finally:
                self.release(cache)
