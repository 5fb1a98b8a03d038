"""Compiling the rounds in child processes, so that no reply shares the cores with the compiler.

The app serves eagerly from the start. Two child processes (`python -m app.precompile SPEC SHARE`) load the same
model and compile the graphs of their share of the spec (one core each), which fills inductor's on-disk cache; the
app loads each graph from that cache on its model thread as soon as it is compiled (`app/idle_work.py`). The
children run at the lowest CPU priority, each in a process group of its own, and `ChildCompile.pause` stops the
whole groups (the compiler's own processes too) while a reply or a measurement runs: a reply decodes as on an idle
machine, and the compile goes on between replies. A child reports on stdout, one JSON object a line:
  {"event": "loaded", "seconds": s}
  {"event": "compiled", "graph": "8-row base forward", "done": i, "total": n of its share, "seconds": s}
  {"event": "done"}  or  {"event": "failed", "error": "..."}
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class CompileSpec:
    """What to compile: the model as the app loaded it (so that every graph's cache key, which covers the
    weights, matches the app's) and the graphs' row buckets."""

    base_path: str
    head_path: str
    dtype: str  # the base's, e.g. "float32"
    draft_dtype: str  # the compiled head's
    few_row_plan: dict[int, str] | None  # the base's eager few-row plan (base.compile starts from it); None = none
    base_buckets: tuple[int, ...]
    draft_buckets: tuple[int, ...]
    threads: int
    extra: dict = field(default_factory=dict)  # from_pretrained keywords of the app's load (gguf_file, ...)
    # (total_token, depth, top_k): the greedy round's draft and verify steps for this tree (round_graphs.py)
    round_tree: tuple[int, int, int] | None = None
    # the round's shape with context chains of these sizes (context drafts), and its third step: verify with one
    # (a graph per size); () = none
    round_chains: tuple[int, ...] = ()

    def to_json(self) -> str:
        d = asdict(self)
        if not d["round_chains"]:
            del d["round_chains"]  # a spec without a chain keeps the key (and the manifest) it had before chains
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CompileSpec":
        d = json.loads(text)
        plan = d["few_row_plan"]
        d["few_row_plan"] = None if plan is None else {int(k): v for k, v in plan.items()}
        d["base_buckets"], d["draft_buckets"] = tuple(d["base_buckets"]), tuple(d["draft_buckets"])
        d["round_tree"] = None if d.get("round_tree") is None else tuple(d["round_tree"])
        d["round_chains"] = tuple(d.get("round_chains", ()))
        return cls(**d)

    def graphs(self) -> list[tuple[str, int]]:
        """("base" | "draft", rows), then ("round_verify" | "round_verify_chain" | "round_draft", the head's tree
        nodes), in the order they are compiled and loaded (round_verify_chain, with `round_chains` only, is a graph
        per chain size)."""
        from eagle.decoding.round_steps import TreeShape

        rounds = []
        if self.round_tree is not None:
            nodes = TreeShape.of(*self.round_tree).nodes
            chain = [("round_verify_chain", nodes)] if self.round_chains else []
            rounds = [("round_verify", nodes), *chain, ("round_draft", nodes)]
        return [("base", r) for r in self.base_buckets] + [("draft", r) for r in self.draft_buckets] + rounds

    def key(self) -> str:
        """The spec, torch, the compiled code and options, and this machine: a manifest under this name says the
        graphs are in the caches (aot_store's saved graphs, inductor's)."""
        import torch

        from eagle.tuning.cost_cache import compiled_options, cpu_description

        what = [self.to_json(), torch.__version__, compiled_options(), cpu_description()]
        return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


def manifest_path(spec: CompileSpec) -> Path:
    from eagle.fetch import cache_dir

    return cache_dir() / "compiled" / f"{spec.key()}.json"


def compiled_before(spec: CompileSpec) -> bool:
    """Whether a child compiled these graphs to the caches that are still there (the saved graphs' and inductor's)."""
    path = manifest_path(spec)
    if not path.is_file():
        return False
    try:
        manifest = json.loads(path.read_text())
        return all(Path(manifest[k]).is_dir() for k in ("inductor_cache", "saved_graphs"))
    except (ValueError, KeyError, OSError):
        return False


# the app's side ------------------------------------------------------------------------------------------
class ChildCompile:
    """Child processes compiling `spec`'s graphs, `workers` at once (each graph's compile runs on one core: its
    tracing and lowering in Python, then one C++ build); `pause()` / `resume()` stop and continue them all."""

    def __init__(self, spec: CompileSpec, workers: int = 2):
        self.spec = spec
        self.started = time.monotonic()
        self.compiled: list[str] = []  # graphs compiled so far, in the order they finished
        self.error: str | None = None
        self.paused = False
        self._lock = threading.Lock()
        self._ended = 0  # children whose output has been read to the end
        graphs = spec.graphs()
        shares = [graphs[i::workers] for i in range(max(1, min(workers, len(graphs))))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.processes = [subprocess.Popen(
            [sys.executable, "-m", "app.precompile", spec.to_json(), json.dumps(share)], cwd=str(ROOT), env=env,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        ) for share in shares]  # fmt: skip
        self._readers = [threading.Thread(target=self._read, args=(p,), name="precompile-reader", daemon=True)
                         for p in self.processes]  # fmt: skip
        for reader in self._readers:
            reader.start()

    def _read(self, process) -> None:
        for line in process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a library's print
            with self._lock:
                if event.get("event") == "compiled":
                    self.compiled.append(event["graph"])
                elif event.get("event") == "failed":
                    self.error = self.error or event.get("error") or "unknown error"
        code = process.wait()
        with self._lock:
            if code != 0 and self.error is None:
                self.error = f"a compiling process exited with code {code}"
            self._ended += 1
            if self.finished and self.error is None:
                self._write_manifest()

    @property
    def finished(self) -> bool:
        """Every child has ended and said so (a manifest is written first when all succeeded)."""
        return self._ended == len(self.processes)

    def _write_manifest(self) -> None:
        from eagle.runtime import aot_store
        from eagle.runtime.compiled import use_project_inductor_cache

        manifest = manifest_path(self.spec)
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({"spec": json.loads(self.spec.to_json()),
                                        "inductor_cache": use_project_inductor_cache(),
                                        "saved_graphs": str(aot_store.folder())}))  # fmt: skip

    @property
    def ok(self) -> bool:
        return self.finished and self.error is None

    def _signal(self, sig) -> None:
        for p in self.processes:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # ended

    def pause(self) -> None:
        with self._lock:
            if not self.paused:
                self._signal(signal.SIGSTOP)
                self.paused = True

    def resume(self) -> None:
        with self._lock:
            if self.paused:
                self._signal(signal.SIGCONT)
                self.paused = False

    def stop(self) -> None:
        """End the children (and their compiler workers) for good."""
        self._signal(signal.SIGKILL)
        self.paused = False

    def progress(self) -> str:
        n, total = len(self.compiled), len(self.spec.graphs())
        elapsed = time.monotonic() - self.started
        state = " (paused while the model works)" if self.paused else ""
        return (f"compiling graphs in {len(self.processes)} background process"
                f"{'es' if len(self.processes) > 1 else ''}: {n} of {total} graphs done, "
                f"{elapsed // 60:.0f}:{elapsed % 60:02.0f} elapsed{state}")  # fmt: skip


ROUND_STEPS = {"round_draft": "draft step", "round_verify": "verify step",
               "round_verify_chain": "verify step with a context chain"}  # fmt: skip


def graph_name(kind: str, rows: int, chains: tuple[int, ...] = ()) -> str:
    """A graph as the log and the Model panel name it; `chains`: the round's context chain sizes (none: ())."""
    if kind in ROUND_STEPS:
        shape = f" (with context drafts of {' / '.join(map(str, chains))})" if chains else ""
        return f"{rows}-node round's {ROUND_STEPS[kind]}{shape}"
    return f"{rows}-row {'base forward' if kind == 'base' else 'draft step'}"


# the child's side ----------------------------------------------------------------------------------------
def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def end_with_parent() -> None:
    """This process is killed when the app that started it ends (Linux; elsewhere it ends after its compile)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def lowest_priority() -> None:
    """This process (and what it starts) runs only on cycles no one else wants."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass
    try:
        os.nice(19)
    except OSError:
        pass


def load_compiled_head(base_model, head_path: str, dtype_name: str):
    """The head as the compiled draft steps freeze it: read from its checkpoint in `dtype_name` ("float32",
    "bfloat16", ...; never a cast of another dtype's copy, whose rounding would change the weights and so the
    graphs' cache keys), or a GGUF block type ("q4_1", "q8_0"): in float32, its linears then rounded to those blocks
    (few_rows.quantize)."""
    import torch

    from eagle.kernels import few_rows, quant_panels
    from eagle.model.ea_model import load_head
    from eagle.models.checkpoint import read_checkpoint

    qtype = {name: q for q, name in quant_panels.NAMES.items()}.get(dtype_name)
    config, state = read_checkpoint(head_path)
    dtype = torch.float32 if qtype is not None else getattr(torch, dtype_name)
    head = load_head(base_model, config, state, None, dtype)
    if qtype is not None:
        few_rows.quantize(head, qtype)
    return head


def compile_graphs(spec: CompileSpec, share: list[tuple[str, int]], on_graph=lambda kind, rows, seconds: None) -> None:
    """Compile the graphs of `share` (part of `spec.graphs()`) for the model `spec` names."""
    import torch

    from eagle.model.ea_model import EaModel

    torch.set_num_threads(spec.threads)
    t0 = time.perf_counter()
    plan = False if spec.few_row_plan is None else spec.few_row_plan
    model = EaModel.from_pretrained(spec.base_path, spec.head_path, total_token=8, depth=2, top_k=2,
                                    dtype=getattr(torch, spec.dtype), few_row_kernels=plan, **spec.extra)  # fmt: skip
    _emit(event="loaded", seconds=round(time.perf_counter() - t0, 1))
    head = load_compiled_head(model.base_model, spec.head_path, spec.draft_dtype)
    base_graphs = model.compile_base(spec.base_buckets)
    draft_graphs = model.compile_draft(spec.draft_buckets, head=head)
    rounds = round_graphs(model, head, spec.round_tree, spec.round_chains) if spec.round_tree is not None else None
    for kind, rows in share:
        if kind.startswith("round_"):
            seconds = rounds.warm(steps=(kind.removeprefix("round_"),))[kind.removeprefix("round_")]
        else:
            seconds = (base_graphs if kind == "base" else draft_graphs).warm(rows=[rows])[rows]
        on_graph(kind, rows, seconds)


def round_graphs(model, head, tree: tuple[int, int, int], chains: tuple[int, ...] = ()):
    """The CompiledRound of `model`'s base (its graphs' kernels set: runners.decode_graphs) and `head` for a tree
    (total_token, depth, top_k) with context chains of the sizes `chains` (none: ()), not yet compiled."""
    from eagle.decoding.draft import HeadStep
    from eagle.decoding.round_steps import TreeShape
    from eagle.runtime import runners

    shape = TreeShape.of(*tree).with_chains(chains)
    return runners.round_graphs(model.base, HeadStep(head, model.base.lm_head), shape)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    end_with_parent()
    lowest_priority()
    spec = CompileSpec.from_json(argv[0])
    share = [tuple(g) for g in json.loads(argv[1])] if len(argv) > 1 else spec.graphs()
    done = []

    def on_graph(kind: str, rows: int, seconds: float) -> None:
        done.append(rows)
        _emit(event="compiled", graph=graph_name(kind, rows, spec.round_chains), done=len(done), total=len(share),
              seconds=round(seconds, 1))  # fmt: skip

    try:
        compile_graphs(spec, share, on_graph)
    except Exception as e:  # noqa: BLE001 - reported to the app, which keeps decoding eagerly
        _emit(event="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise SystemExit(1) from None
    _emit(event="done")


if __name__ == "__main__":
    main()
