"""Compiled base forwards: the vanilla step and the tree verify pass as inductor graphs (torch.compile).

What is compiled is `BaseModel.decode`, transformers' own decoder plus the lm_head and the base's logit processing,
for a fixed number of new rows, a *bucket*: 1 (the vanilla step), 8 and 16 (tree verification). The rows are
static in each graph, the context length symbolic, so a bucket compiles once and never again as the context grows
or a new cache is allocated. A tree with fewer rows than its bucket is padded with rows that see only the committed
prefix and themselves; their logits, features and cache rows are dropped before anyone sees them, so padding never
changes the output. Prefill, and trees wider than the largest bucket, run eagerly.

The linears are the panel kernel (panel_kernel.py), called by the graphs as an operator on weight panels made once:
every weight is streamed once per forward whatever the rows. The small operations between the matmuls fuse into C++
loops, the graph's kernel calls are made from C++ (`cpp_wrapper`), the other weights are frozen into the graph
(inductor's `freezing`), and once a bucket has run dynamo checks only the guards that tell the graphs apart
(`BucketGraphs.call`). Where the panel kernel cannot be built, the matmuls are inductor's own C++ GEMM micro-kernels
(`max_autotune`, backend CPP), packed at compile time for the bucket's rows; where no CPP kernel applies to a shape
(odd sizes, as in tiny test models) or its template fails on one, that bucket's graph is compiled again with MKL's
kernels as candidates too, then with MKL's alone (`GEMM_BACKENDS`). Frozen CPP GEMMs hold their own packed copy of
the weights, as the panels do.

Where the linears run the panel kernel, each bucket's graph is compiled whole with `aot_compile` and saved
(aot_store.py, `cache_dir()/aot`): the weights stay inputs (no freezing; sibling layers' identical kernel calls are
merged by `aot_store.SameKernelCalls` instead of freezing's common-subexpression pass), and a later process loads
the graph without tracing and calls it without dynamo's guards. Otherwise (inductor's own GEMMs, or a graph that
`aot_compile` cannot take) the graph is traced in each process with the weights frozen, and inductor's graph cache
under `cache_dir()/inductor` (TORCHINDUCTOR_CACHE_DIR if set) keeps each bucket's lowered graph, C++ library and
frozen weights, so a later start skips lowering, autotuning and the C++ build and only traces again. That needs
`freeze_without_mkl_packing` (a graph holding MKL's packed weights, mkldnn tensors, is never cached), and each entry
is keyed on the weights themselves (`weights_fingerprint`): inductor's key covers only their shapes. The app
compiles in child processes and swaps the graphs in when they are ready (app/precompile.py, app/idle_work.py). On
CUDA, runners.py builds CUDA graphs instead (cuda_graphs.py). docs/benchmarks.md has what each of these choices measured.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time

import torch

from eagle.kernels import few_rows
from eagle.models.masks import additive_mask

from . import aot_store

BUCKETS = (1, 4, 8, 16)
# inductor's GEMM backends, tried in order: the first whose graphs compile is kept (see the module docstring)
GEMM_BACKENDS = ("CPP", "CPP,ATEN", "ATEN")
# inductor options of every graph (with the bucket's GEMM backends). cpp_wrapper: the graph's kernel calls are
# made from C++, not from a Python function. No size, alignment or scalar asserts: the runners give every graph
# row-major inputs of its bucket's shapes (`fresh`, `pad_rows`) and the weights are fixed, so the checks of each of
# some 280 inputs and of every kernel's output at each call would never fail. Timings measured with other options
# are not reused (the tuner's cache keys name them).
OPTIONS = {"freezing": True, "max_autotune": True, "cpp_wrapper": True,
           "size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}  # fmt: skip
# graphs dynamo keeps per function: at least every bucket of every model and head a process compiles (three draft
# heads of four buckets each exceed its default of 8, and a function past the limit runs eagerly)
RECOMPILE_LIMIT = 64


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


def freeze_without_mkl_packing() -> None:
    """Register inductor's freezing passes without the one that packs float32 linear weights for MKL.

    Freezing packs every float32 linear weight for MKL's GEMM; where the CPP GEMM template is chosen, it packs the
    original weight its own way and MKL's copy goes unused, but it stays in the graph as an mkldnn tensor, and
    inductor's graph cache skips any graph holding one ("mkldnn tensors unpickleable"): every start compiled anew.
    The passes are registered once per process, when the first graph freezes, and the packing ones only if oneDNN
    is enabled then: registering them now with it off leaves that pass out for the process (no effect if a graph
    has already frozen). GEMMs that fall back to ATen (GEMM_BACKENDS) run on the unpacked weight."""
    from torch._inductor.fx_passes import freezing_patterns

    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        freezing_patterns.lazy_init()
    finally:
        torch.backends.mkldnn.enabled = enabled


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


def weights_fingerprint(*modules: torch.nn.Module) -> str:
    """A hash of the modules' parameters and buffers (names, dtypes, bytes): 0.6-0.7 s for the default model (AMD EPYC).

    Inductor keys a frozen graph's cache entry on its weights' shapes only, yet the entry holds the CPP GEMMs'
    packed copies of them: another model of the same shapes would load the first one's weights. The fingerprint,
    made part of every key (`torch.compiler.config.cache_key_tag`), keeps each model's graphs apart."""
    digest = hashlib.blake2b(digest_size=16)
    for module in modules:
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


class AotUnavailable(Exception):
    """A graph that `aot_compile` cannot take (a graph break, a guard it cannot save): traced the usual way."""


class BucketGraphs:
    """`fn` compiled once per bucket of rows: the rows static in each graph, every other size symbolic. Where the
    linears run the panel kernel, each graph is compiled whole and saved (aot_store.py), so a later process loads
    it without tracing; otherwise, and where that fails, it is traced with the weights frozen and inductor's cache
    keeps its code (`_traced_graph`). `call` runs the bucket's graph and, where no CPP GEMM applies to one of its
    shapes, compiles it again with the next GEMM backends (`undo` first puts back any state the failed call
    changed)."""

    def __init__(self, fn, buckets, weights: tuple[torch.nn.Module, ...], what: str):
        """fn: a function whose models and settings are its closure's (constants to dynamo: a tree's sizes stay
        static); weights: the modules whose weights it reads (inductor's C++ graphs are for CPU), the one whose
        linears the graphs run first; what: named in the refusal."""
        if any(t.device.type != "cpu" for module in weights for t in module.parameters()):
            raise ValueError(f"{what} are built for CPU (inductor) only; on CUDA, cuda_graphs.py builds them")
        use_project_inductor_cache()
        freeze_without_mkl_packing()
        self.weights = weights
        self.cache_key_tag: str | None = None  # weights_fingerprint, made when a graph is first traced
        self.model = weights[0]
        self.fn = fn
        # saved whole where no weight needs freezing: the linears' panels are the kernel's own operands
        self.aot = bool(few_rows.plan_of(self.model)) and os.environ.get("EAGLE_AOT_GRAPHS", "1") != "0"
        self.buckets = tuple(sorted(buckets))
        self.backend: dict[int, int] = {}  # rows -> index into GEMM_BACKENDS
        self.graphs: dict[int, object] = {}  # rows -> compiled fn
        self.saved: set[int] = set()  # buckets whose graph came from aot_store: it evaluates no guard on any call
        self.ran: set[int] = set()  # buckets whose graph has run (compiled) at least once

    def bucket(self, rows: int) -> int | None:
        return bucket_for(rows, self.buckets)

    def gemms(self, rows: int) -> str:
        return GEMM_BACKENDS[self.backend.get(rows, 0)]

    def linears(self, rows: int) -> str:
        """What the graph of `rows` runs its linears on, for the compile log."""
        return "panel kernel" if few_rows.plan_of(self.model) else f"GEMMs: {self.gemms(rows)}"

    def _graph(self, rows: int):
        if rows not in self.graphs:
            self.graphs[rows] = self._saved_graph(rows) if self.aot else self._traced_graph(rows)
        return self.graphs[rows]

    def _saved_graph(self, rows: int):
        """The bucket's graph from aot_store, or, at its first call, compiled whole on that call's arguments,
        saved and loaded back. Raises AotUnavailable where aot_compile cannot take it."""
        # ATen's GEMMs for any linear off the panel kernel: the CPP template packs only frozen weights
        options = {**OPTIONS, "freezing": False, "max_autotune_gemm_backends": "ATEN",
                   "post_grad_custom_post_pass": aot_store.SameKernelCalls()}  # fmt: skip
        description = aot_store.describe(self.fn, rows, options)
        name = aot_store.name_of(description)
        loaded = aot_store.load(name, self.fn)
        if loaded is not None:
            self.saved.add(rows)
            return loaded

        def first(*args):
            try:
                with torch._inductor.config.patch(options):
                    graph = aot_store.compile_and_save(self.fn, args, name, description)
            except Exception as e:  # noqa: BLE001 - traced the usual way instead (`call`)
                raise AotUnavailable(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
            self.graphs[rows] = graph
            self.saved.add(rows)
            return graph(*args)

        return first

    def _traced_graph(self, rows: int):
        """The bucket's graph as torch.compile traces it in this process, the weights frozen into it (inductor's
        cache keeps the lowered code, keyed on the weights too: `weights_fingerprint`)."""
        options = {**OPTIONS, "max_autotune_gemm_backends": self.gemms(rows)}
        graph = torch.compile(self.fn, dynamic=True)
        if self.cache_key_tag is None:
            self.cache_key_tag = weights_fingerprint(*self.weights)
        tag = self.cache_key_tag

        def call(*args):
            # a config scope, not torch.compile's options=: freezing is decided while dynamo traces, before
            # those options apply (with them the weights stayed graph inputs and the GEMMs plain MKL calls)
            with torch._inductor.config.patch(options), torch.compiler.config.patch(cache_key_tag=tag):
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    return graph(*args)

        return call

    def call(self, rows: int, args: tuple, undo=lambda: None):
        """The graph of `rows` (a bucket) on `args`; tensors among them must be `rows` long where marked static.
        A bucket whose first call fails to compile is compiled again with the next GEMM backends (GEMM_BACKENDS).

        A graph from aot_store checks no guard. Once a traced bucket's graph has run, dynamo checks only the guards
        that tell its graphs apart (which bucket, which model), not all of them: what else the guards
        cover (dtypes, the cache's structure, the ranks of every tensor) is the same on every call by
        construction (`CompiledDecode.run`, `CompiledDraft.run`), and a call that matches no graph still
        compiles one."""
        if rows in self.saved and rows in self.ran:  # no guard to skip: the stance would be a cost for nothing
            return self.graphs[rows](*args)
        if rows in self.ran:
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return self._graph(rows)(*args)
            except RuntimeError as e:  # raised before the graph runs: a call unlike the warm-up's (a cache made
                if "skip_guard_eval_unsafe" not in str(e):  # outside inference_mode, ...) compiles a graph of its own
                    raise
        try:
            out = self._graph(rows)(*args)
        except AotUnavailable:  # this function's graphs are traced from now on
            self.aot = False
            del self.graphs[rows]
            self.saved.discard(rows)
            undo()
            return self.call(rows, args, undo)
        except torch._dynamo.exc.BackendCompilerFailed:  # inductor's errors (NoValidChoicesError, an assertion)
            if self.backend.get(rows, 0) + 1 == len(GEMM_BACKENDS):
                raise
            self.backend[rows] = self.backend.get(rows, 0) + 1  # this bucket compiles again with the next backend
            del self.graphs[rows]
            self.saved.discard(rows)
            undo()
            return self.call(rows, args, undo)
        self.ran.add(rows)
        return out


def static_rows(*tensors_and_dims) -> None:
    """Mark each (tensor, dim) static: one graph per bucket, its GEMMs built for that many rows."""
    for t, dim in tensors_and_dims:
        torch._dynamo.mark_static(t, dim)


def timed_buckets(buckets, passes, log=None, line=None) -> dict[int, float]:
    """Seconds of `passes(rows)` (what compiles or captures that bucket's graphs) for each of `buckets`; after each,
    `line(rows, seconds)` said in `log`."""
    seconds = {}
    for rows in buckets:
        t0 = time.perf_counter()
        passes(rows)
        seconds[rows] = time.perf_counter() - t0
        if log:
            log(line(rows, seconds[rows]))
    return seconds


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A row-major copy: a slice of a longer tensor keeps its strides, and strides are guarded (a recompile)."""
    return t.new_empty(t.shape).copy_(t)


class BucketRunner:
    """The CPU graphs' side of runners.py's interface, shared by the base's and the head's: graphs per bucket of
    rows (`self.graphs`) that take any cache (the context length is symbolic in them), none of their own."""

    kind = "inductor"
    graphs: BucketGraphs

    def bucket(self, rows: int) -> int | None:
        return self.graphs.bucket(rows)

    def takes(self, cache, rows: int, at: int) -> bool:
        """Whether `run` takes `rows` rows written at `at` in `cache`: a bucket holds the rows, and they are written
        at 2 or later (dynamo specialises an int of 0 or 1, which would compile a graph of its own)."""
        return at > 1 and self.bucket(rows) is not None

    def lease(self, capacity: int) -> None:
        """No cache of its own (the caller makes one: `BaseModel.leased_cache`, the `Drafter`)."""
        return None

    def release(self, cache) -> None:
        pass


class CompiledDecode(BucketRunner):
    """`BaseModel.decode` compiled for each bucket; `run` pads, calls the graph and drops the pads."""

    def __init__(self, base, buckets=BUCKETS):
        self.base = base
        def forward(input_ids, position_ids, mask, cache, features, last_logits_only):
            return base.decode(input_ids, position_ids, mask, cache, features, last_logits_only)

        self.graphs = BucketGraphs(forward, buckets, (base.model,), "compiled rounds")
        self.buckets = self.graphs.buckets

    def run(self, input_ids, position_ids, mask, cache, features: bool):
        """Like `BaseModel.decode` on q <= max bucket rows, with the cache left at length L + q."""
        q = input_ids.shape[1]
        rows = self.bucket(q)
        ids, positions, mask = map(fresh, pad_rows(input_ids, position_ids, mask, rows))
        static_rows((ids, 1), (positions, 1), (mask, 2))
        length = cache.length
        logits, feats = self.graphs.call(
            rows, (ids, positions, mask, cache, features, False), undo=lambda: cache.crop_to(length)
        )
        cache.crop_to(cache.length - (rows - q))  # the pads' rows
        return logits[:q], None if feats is None else feats[:q]

    def warm(self, log=None, context: int = 64, rows: list[int] | None = None) -> dict[int, float]:
        """Compile every bucket (or those in `rows`) now, a forward over dummy tokens; returns seconds per bucket."""
        buckets = self.buckets if rows is None else rows
        with torch.inference_mode():
            # room beyond the largest bucket, as every cache of a generation has (BaseModel.new_cache): a pass that
            # fills its cache exactly would be traced with the cache's size tied to its length, a graph of its own
            cache = self.base.new_cache(context + 2 * max(self.buckets))
            ids = torch.zeros(1, context, dtype=torch.long)
            # eager, with features: transformers installs its hidden-state hooks on first use (a graph break if
            # that happened inside the graph)
            self.base.forward(ids, torch.arange(context)[None], cache, features=True, last_logits_only=True)

            def passes(rows: int) -> None:
                ids = torch.zeros(1, rows, dtype=torch.long)
                positions = torch.arange(context, context + rows)[None]
                allowed = torch.ones(rows, context + rows, dtype=torch.bool).tril(context)
                # the vanilla step (1 row) needs no features, a verify pass (more rows) does
                self.run(ids, positions, additive_mask(allowed, self.base.dtype), cache, features=rows > 1)
                cache.crop_to(context)

            return timed_buckets(buckets, passes, log, lambda n, s: (
                f"compiled the {n}-row forward in {s:.1f} s (linears: {self.graphs.linears(n)})"))  # fmt: skip
