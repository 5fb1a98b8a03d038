"""Compiled graphs saved whole, so that a later process loads them without tracing (torch's `aot_compile`).

Inductor's own cache keeps a graph's lowered code, but every process still traces the function again to find its
entry (dynamo, then AOT autograd): tens of seconds for a 30-layer base on a small CPU, the bulk of a second start.
Here a graph is compiled once with `aot_compile` (dynamo's trace, the compiled code and the glue between them,
serialised together) and saved under `cache_dir()/aot`; a later process loads the file in about a second and calls
it directly: no trace, and no guard evaluation per call either.

Invariants:
- A compiled function keeps its models and settings in its closure (to dynamo those are constants: a tree's sizes
  stay static). The file holds no closure object: they are handed to it again where it loads (`external_data`,
  by the cell's index), and the graph reads the weights of the loading process's models. Nothing of a weight's
  value is in the file (no freezing), so a file serves every model of the same structure.
- A file is keyed on everything that shapes the graph and is not a tensor's value: the function, the rows, the
  structure of its closure's objects (modules' classes, tensors' names, dtypes and shapes, plain settings,
  configs, a tree's shape), torch's and transformers' versions, this package's model sources, inductor's options
  and the CPU's instruction sets. Guards are not kept (the callers pass the same kinds of arguments on every call,
  as they do for `BucketGraphs`' unchecked calls), so the key is what keeps a file to the graph it was made for.
- A file that fails to load is compiled again and replaced.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

PLAIN = (int, float, str, bool, type(None))
# where a model came from, not what it is: the same model loaded from two paths makes one graph
PLACES = {"name_or_path", "_name_or_path", "eagle_weights_gguf"}
# what a model runs on in this process (`BaseModel.compiled`: the graphs in use, or None), not what a graph of it
# computes: a round's graph compiled by a child (no graphs in use there) is the file the app loads beside its own
RUNNERS = {"compiled"}
# the panel kernels' operators: functional, so two calls with the same arguments give the same product
KERNELS = ("panel_linear", "quant_panel_linear")


def _no_guards(entries):
    return [False] * len(entries)


class SameKernelCalls(CustomGraphPass):
    """Inductor post-grad pass: calls of the panel kernels with the same arguments made once. Sibling layers (q/k/v,
    gate/up: few_rows.SIBLINGS) each call the kernel on their shared panels and input and keep their own columns;
    in a frozen graph freezing's common-subexpression pass leaves one call, here this pass does (7 -> 4 calls a
    layer)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        targets = {getattr(torch.ops.eagle, name).default for name in KERNELS if hasattr(torch.ops.eagle, name)}
        first = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in targets:
                continue
            same = (node.target, node.args, tuple(sorted(node.kwargs.items())))
            if same in first:
                node.replace_all_uses_with(first[same])
                graph.erase_node(node)
            else:
                first[same] = node

    def uuid(self) -> str:
        return f"{__name__}.SameKernelCalls:{sources_digest()}"


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    """A hash of the engine's sources that graphs are built from (eagle/{model,models,decoding,runtime,kernels}/*.py,
    *.cpp and eagle/timing.py, transfer.py): a change to any of them is a new key."""
    digest = hashlib.blake2b(digest_size=16)
    eagle = Path(__file__).parent.parent
    folders = [eagle / name for name in ("model", "models", "decoding", "runtime", "kernels")]
    files = [eagle / "timing.py", eagle / "transfer.py"]
    for path in sorted([*files, *(p for folder in folders for p in (*folder.glob("*.py"), *folder.glob("*.cpp")))]):
        digest.update(str(path.relative_to(eagle)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def machine() -> str:
    """The CPU's instruction sets as compiled code depends on them: torch's capability and the kernel's flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()} {flags}"


def structure(obj, depth: int = 0, seen: set | None = None) -> object:
    """What of `obj` shapes a compiled graph, without tensor values: for a module, each submodule's class, its
    tensors' names, dtypes and shapes and its plain settings, and its config; for other objects, the same of their
    attributes; plain values as they are."""
    seen = set() if seen is None else seen
    if isinstance(obj, PLAIN):
        return obj
    if isinstance(obj, torch.Tensor):
        return ["tensor", str(obj.dtype), list(obj.shape), str(obj.device)]
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, (list, tuple)):
        return [structure(x, depth + 1, seen) for x in obj]
    if isinstance(obj, dict):
        return {str(k): structure(v, depth + 1, seen) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if id(obj) in seen or depth > 6:
        return type(obj).__qualname__
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: structure(getattr(obj, f.name), depth + 1, seen) for f in dataclasses.fields(obj)}
        return [type(obj).__qualname__, fields]
    if hasattr(obj, "to_dict") and hasattr(obj, "model_type"):  # a transformers config
        settings = {k: v for k, v in obj.to_dict().items() if k not in PLACES}
        return ["config", json.dumps(settings, sort_keys=True, default=str)]
    if isinstance(obj, torch.nn.Module):
        out = []
        for name, module in obj.named_modules():
            entry = {"class": f"{type(module).__module__}.{type(module).__qualname__}"}
            for key, value in vars(module).items():
                if key.startswith("_") or key == "training" or key in PLACES:
                    continue
                if isinstance(value, (*PLAIN, torch.Tensor, torch.dtype, tuple, list)):
                    entry[key] = structure(value, depth + 1, seen)
                elif (hasattr(value, "to_dict") and hasattr(value, "model_type")) or (
                    dataclasses.is_dataclass(value) and not isinstance(value, type)
                ):  # configs: a transformers one, a draft head's
                    entry[key] = structure(value, depth + 1, seen)
            for key, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                entry[key] = structure(t)
            out.append([name, entry])
        return out
    if callable(obj) and not hasattr(obj, "__dict__"):
        return getattr(obj, "__qualname__", type(obj).__qualname__)
    attrs = getattr(obj, "__dict__", {})
    return [type(obj).__qualname__, {k: structure(v, depth + 1, seen) for k, v in sorted(attrs.items())
                                     if not k.startswith("_") and k not in RUNNERS}]  # fmt: skip


def closure(fn) -> dict[str, object]:
    """The objects of `fn`'s closure by cell index: what its saved graph is handed where it loads."""
    return {f"cell{i}": cell.cell_contents for i, cell in enumerate(fn.__closure__ or ())}


def key(fn, rows: int, options: dict) -> str:
    """The file name of `fn`'s graph for `rows`, compiled with inductor `options`."""
    return name_of(describe(fn, rows, options))


def name_of(description: str) -> str:
    """The file name of the graph `describe` described."""
    return hashlib.blake2b(description.encode(), digest_size=20).hexdigest()


def describe(fn, rows: int, options: dict) -> str:
    """What `key` hashes, as JSON (written beside each saved graph: what it was made for)."""
    import transformers

    described = {
        "fn": f"{fn.__module__}.{fn.__qualname__}",
        "rows": rows,
        "closure": structure(list(closure(fn).values())),
        "options": {k: v.uuid() if isinstance(v, CustomGraphPass) else str(v) for k, v in sorted(options.items())},
        "versions": [torch.__version__, transformers.__version__, sources_digest()],
        "machine": machine(),
    }
    return json.dumps(described, sort_keys=True, default=str)


def folder() -> Path:
    from eagle.fetch import cache_dir

    path = Path(os.environ.get("EAGLE_AOT_DIR") or cache_dir() / "aot")
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(name: str, fn):
    """The saved graph `name` (a `key` of `fn`) on `fn`'s closure, ready to call; None where there is none or it does
    not load."""
    path = folder() / f"{name}.bin"
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            graph = torch.compiler.load_compiled_function(f, external_data=closure(fn))
    except Exception:  # noqa: BLE001 - a file from another build or a torn write: compiled again
        path.unlink(missing_ok=True)
        return None
    graph.disable_guard_check()
    return graph


def compile_and_save(fn, example_args: tuple, name: str, description: str = ""):
    """`fn` traced on `example_args` and compiled as one graph under the caller's inductor settings, saved as
    `name`, then loaded back from the file: the saving process runs what later ones will. Raises what dynamo or
    inductor raise (a graph break, an unsupported guard, a failed kernel)."""
    compiled = torch.compile(fn, dynamic=True, fullgraph=True, options={"guard_filter_fn": _no_guards})
    with torch._dynamo.config.patch(specialize_float=True):
        artifact = compiled.aot_compile((example_args, {}))
    artifact.save_compiled_function(str(folder() / f"{name}.bin"), external_data=closure(fn))
    (folder() / f"{name}.json").write_text(description)
    loaded = load(name, fn)
    if loaded is None:
        raise RuntimeError(f"the compiled graph saved as {folder() / name}.bin does not load back")
    return loaded
