"""A greedy EAGLE-2 round on CUDA in three graph replays: the draft step and the verify step (round_steps.py, the
same functions the CPU compiles, called with a static `span` of keys) and the keeping of the accepted path's KV
rows. The runner's interface is round_graphs.py's (`draft`, `verify`, `keep`).

A graph holds the addresses and shapes it was captured with, so the round runs on static caches: the base's is
the one its forwards' graphs own (cuda_graphs.GraphedDecode, leased per generation by `BaseModel.leased_cache`),
the head's this runner's own (`self.cache`, leased per generation by `leased_draft_cache`). The context length
enters each graph as a [] tensor copied into its buffer; keys are read over the smallest span of the cache
(cuda_graphs.SPANS) that holds the context and the rows written, so a graph per step and span serves every length.
Everything between the host's one read a round (`Verdict.packet`) and the next draft stays on the device.

Where a graph does not apply the step runs eagerly on the same caches (EagerRound): a prompt shorter than a commit,
a context chain, a cache not the runner's (a generation beside the one holding it), contexts past the last span.
`capture=False` runs the same buffers and spans without capturing: how the tests check this path on a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time

import torch

from eagle.decoding.draft import HeadStep
from eagle.decoding.round_steps import DeviceTree, TreeShape, Verdict, draft_step, verify_step

from .compiled import bucket_for
from .cuda_graphs import GraphedDecode, GraphedSteps, LeasedCache, spans_of
from .round_graphs import EagerRound


class CudaRound(EagerRound, LeasedCache):
    """The draft and verify steps of one tree shape as CUDA graphs per span, and the keep as one more; `cache` is the
    head's static cache the draft graphs run on."""

    steps_text = "three CUDA graphs (draft, verify, keep)"  # the Model panel's words

    def __init__(self, base, step: HeadStep, shape: TreeShape, capture: bool | None = None):
        super().__init__(base, step, shape)
        self.decode = base.compiled
        if not isinstance(self.decode, GraphedDecode):
            raise ValueError("the round's CUDA graphs run on the base forwards' (cuda_graphs.GraphedDecode): put "
                             "those in use first (runners.decode_graphs, or compiling.compile_rounds)")  # fmt: skip
        head = step.head
        device = head.fc.weight.device
        self.cache = head.new_cache(self.decode.capacity + shape.commit_rows + shape.draft_entries + 1, zeroed=True)
        self.cache.lent = True  # kept rows are copied in and out (prefix_cache.py), the buffers stay the graphs'
        self.capacity, self._taken = self.cache.capacity, threading.Lock()
        self.draft_spans = spans_of(self.cache.capacity)
        self.steps = GraphedSteps(device, device.type == "cuda" if capture is None else capture)
        self.inductor = self.decode.inductor  # inductor's kernels where the base's vanilla step has them

    def _empty(self) -> None:
        self.cache.length = 0

    @contextlib.contextmanager
    def leased_draft_cache(self, capacity: int, kept=None, rows: int = 0, bound: int | None = None):
        """The runner's draft cache for one generation, emptied (then holding `kept`'s first `rows`, copied), where
        it is free and large enough; else one of our own as EagerRound's (then the draft steps run eagerly)."""
        cache = self.lease(capacity)
        if cache is None:
            with super().leased_draft_cache(capacity, kept, rows, bound) as cache:
                yield cache
            return
        try:
            yield cache.start_from(kept, rows)
        finally:
            self.release(cache)

    # ---------------------------------------------------------------------------------------------------------
    def draft(self, cache, start: int, features, ids, n, root, rows: int | None = None) -> DeviceTree:
        features, ids = self.commit_of(features, ids, rows)
        C = ids.shape[0]
        span = bucket_for(start + C + self.shape.draft_entries, self.draft_spans)
        if cache is not self.cache or C not in (self.shape.commit_rows, self.shape.head_commit_rows) or not span:
            return super().draft(cache, start, features, ids, n, root)
        inputs = (_position(start, ids.device), features, ids, n, root)
        draft = functools.partial(self._draft, span=span)
        return DeviceTree(*self.steps.run(("draft", C, span), draft, inputs, self.inductor))

    def _draft(self, start, features, ids, n, root, span: int) -> DeviceTree:
        """The captured draft step: start [] long, features [C, F], ids [C], n and root [] long."""
        return draft_step(self.step, self.cache, start, features, ids, n, root, self.shape, span)

    def verify(self, cache, committed: int, tree: DeviceTree, chain=None) -> Verdict:
        N = self.shape.nodes
        span = bucket_for(committed + N, self.decode.spans)
        if chain is not None or cache is not self.decode.cache or not span:
            return super().verify(cache, committed, tree, chain)
        verify = functools.partial(self._verify, span=span)
        inputs = (_position(committed, tree.tokens.device), *tree)
        out = self.steps.run(("verify", span), verify, inputs, self.inductor)
        cache.crop_to(committed + N)  # the runner keeps the static cache's length (kv_cache: rows written at positions)
        return Verdict(*out)

    def _verify(self, committed, tokens, parents, depth, ancestors, span: int) -> Verdict:
        """The captured verify step: committed [] long, the tree's tensors [N] and [N, N]; the N rows written at
        positions committed.. of the base's static cache, its first `span` positions read."""
        cache = self.decode.cache
        cache.write_positions = committed + torch.arange(tokens.shape[0], device=tokens.device)  # [N]
        cache.read_span = span
        try:
            tree = DeviceTree(tokens, parents, depth, ancestors)
            return verify_step(self.base, cache, committed, tree, self.shape, span)
        finally:
            cache.write_positions = cache.read_span = None

    def keep(self, cache, committed: int, path: list[int], verdict: Verdict) -> None:
        if cache is not self.decode.cache or path == list(range(len(path))):  # elsewhere, or in place already
            return super().keep(cache, committed, path, verdict)
        self.steps.run(("keep",), self._keep, (_position(committed, verdict.path.device), verdict.path))
        cache.crop_to(committed + len(path))

    def _keep(self, committed, path) -> tuple:
        """The captured keep: every layer's rows committed + path[i] copied to committed + i (path [D + 1], 0 past
        the path's end: those copies land past the new length, which the next pass overwrites)."""
        target = committed + torch.arange(path.shape[0], device=path.device)  # [D + 1]
        source = committed + path  # [D + 1]
        for layer in self.decode.cache.layers:
            if layer.is_initialized:
                for buffer in (layer.keys, layer.values):  # [1, KV, capacity, D]
                    buffer.index_copy_(2, target, buffer.index_select(2, source))
        return ()

    # ---------------------------------------------------------------------------------------------------------
    def warm(self, log=None, context: int = 64) -> dict[str, float]:
        """Capture every graph now: the draft and verify steps at every span (a round over dummy rows after
        `context` positions, then at the end of each longer span) and the keep. Seconds per step."""
        shape, base = self.shape, self.base
        device = base.input_device
        commits = sorted({shape.commit_rows, shape.head_commit_rows})
        seconds = {}
        with torch.inference_mode():
            cache = self.decode.lease(context)
            if cache is None:
                raise RuntimeError("the base graphs' cache is in use: warm the round between generations")
            try:
                with self.leased_draft_cache(context) as draft_cache:
                    base.forward(torch.zeros(1, context, dtype=torch.long, device=device),
                                 torch.arange(context, device=device)[None], cache, last_logits_only=True)  # fmt: skip
                    n, root = torch.tensor(2, device=device), torch.tensor(0, device=device)
                    t0 = time.perf_counter()
                    for C in commits:
                        features = torch.zeros(C, base.feature_width, dtype=base.dtype, device=device)
                        ids = torch.zeros(C, dtype=torch.long, device=device)
                        for span in self.draft_spans:
                            tree = self.draft(draft_cache, max(context, span - C - shape.draft_entries), features,
                                              ids, n, root)  # fmt: skip
                    seconds["draft"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    for span in self.decode.spans:
                        committed = max(context, span - shape.nodes)
                        cache.crop_to(committed)  # positions past `context` hold zeros: read masked
                        verdict = self.verify(cache, committed, tree)
                    seconds["verify"] = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    self.keep(cache, context, [0, 2], verdict)  # a path of D + 1 rows fits after `context`
                    seconds["keep"] = time.perf_counter() - t0
            finally:
                self.decode.release(cache)
        if log:
            log("captured the round's draft, verify and keep steps as CUDA graphs in "
                + " + ".join(f"{s:.1f}" for s in seconds.values()) + f" s ({len(self.draft_spans)} and "
                f"{len(self.decode.spans)} spans; a tree of {shape.nodes} nodes, {shape.levels} draft levels of "
                f"width {shape.top_k})")  # fmt: skip
        return seconds


def _position(value: int, device: torch.device) -> torch.Tensor:
    """A context length as the [] long tensor a graph's buffer takes, on the host (GraphedSteps.run copies it there
    without waiting: from pinned memory where the buffer is on CUDA; a pageable source could wait for the stream)."""
    host = torch.tensor(value, dtype=torch.long)
    return host.pin_memory() if device.type == "cuda" else host
