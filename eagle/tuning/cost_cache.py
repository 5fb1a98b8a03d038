"""Measurements cached per machine: a key naming the CPU (or GPU), threads, torch, the base and how its forwards run,
and with a head, the head and how its steps run; JSON files under `cache_dir()/tuner` keyed on it. A second start on
the same machine reads what the first measured; any change to what was measured measures again.
"""

from __future__ import annotations

import hashlib
import json

import torch

from eagle.kernels import few_rows, panel_kernel, quant_panels


def cpu_description() -> dict:
    """The CPU as lscpu would name it: model name, logical CPUs, and the SIMD flags that shape kernel choice."""
    import os

    info = {"model": None, "cpus": os.cpu_count(), "flags": []}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and info["model"] is None:
                    info["model"] = value.strip()
                elif key.strip() == "flags" and not info["flags"]:
                    wanted = ("avx", "fma", "amx", "bf16", "vnni", "f16c", "sse4")
                    info["flags"] = sorted(x for x in value.split() if x.startswith(wanted) or "bf16" in x)
    except OSError:
        pass
    return info


def compiled_options() -> str:
    """How compiled graphs are built, for cache keys: compiled.py's inductor options and GEMM backends, and the
    code of compiled.py, compiled_draft.py, aot_store.py and cuda_graphs.py (timings of graphs built by other code
    are not reused)."""
    import inspect

    from eagle.runtime import aot_store, compiled, compiled_draft, cuda_graphs

    sources = "".join(map(inspect.getsource, (compiled, compiled_draft, aot_store, cuda_graphs)))
    code = hashlib.sha256(sources.encode()).hexdigest()[:12]
    return json.dumps({**compiled.OPTIONS, "gemm_backends": compiled.GEMM_BACKENDS, "code": code}, sort_keys=True)


def key(model, head: bool = True, draft: tuple | None = None) -> str:
    """The machine, the base and how its forwards run; with `head`, the draft head and how its steps run too: `draft`
    (a head and its compiled draft steps or None), by default the model's in use."""
    base = model.base_model
    head_in_use, draft_graphs = draft or (model.ea_layer, model.compiled_draft)
    device = str(model.base.lm_head.weight.device)
    what = {
        "cpu": cpu_description(), "device": device, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "base": getattr(base.config, "_name_or_path", ""), "base_config": base.config.to_json_string(),
        "base_dtype": str(model.base.dtype), "few_row_plan": few_rows.plan_of(base),
        "few_row_kernels": few_rows.kernels_id(),
        "tiling": quant_panels.tiling() if panel_kernel.loaded() else None,
        "compiled": model.base.compiled.buckets if model.base.compiled is not None else None,
        "spans": getattr(model.base.compiled, "spans", None),  # CUDA graphs: the cache spans they attend over
    }  # fmt: skip
    if head:
        what |= {
            "head": str(head_in_use.config), "head_dtype": head_in_use.dtype_name,
            "compiled_draft": draft_graphs.buckets if draft_graphs is not None else None,
        }  # fmt: skip
    compiled = model.base.compiled is not None or (head and draft_graphs is not None)
    what["compile_options"] = compiled_options() if compiled else None
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:20]


def folder():
    """Where the measurements are kept."""
    from eagle.fetch import cache_dir

    return cache_dir() / "tuner"


def path(model, suffix: str = "", head: bool = True, draft: tuple | None = None):
    return folder() / f"{key(model, head, draft)}{suffix}.json"


def load(file) -> dict | None:
    return json.loads(file.read_text()) if file.is_file() else None


def save(file, data: dict) -> None:
    """Written whole or not at all (a temporary file renamed into place)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(file)
