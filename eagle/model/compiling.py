"""Compiled forwards put in use for a loaded model: the base's graphs (`runners.decode_graphs`), the head's compiled
draft steps in each dtype worth offering (its own, the base's, a copy in GGUF blocks), the faster draft for the tree
configured now, and a verdict on compiled against eager forwards (timed once per machine + model, cached like the
tuner's costs). This module assigns the model's runners (`base.compiled`, `ea_layer`, `compiled_draft`,
`draft_options`); the tuner only measures and returns choices.
"""

from __future__ import annotations

import hashlib

import torch

from eagle.kernels import few_rows, quant_panels
from eagle.tuning import cost_cache, tuner


def compile_rounds(model, log, swap=None) -> bool | None:
    """Compiled base forwards (`compiled.py`) and draft steps (`compiled_draft.py`), on CUDA CUDA graphs of them
    (`cuda_graphs.py`), as the model's `runtime` says: for compile "on", or for "auto" where they measure faster than
    eager here (their forwards per bucket, timed once per machine + model, cached).

    Compiling takes minutes on a CPU (capturing CUDA graphs, seconds); the graphs are built and warmed beside the
    eager model, then `swap(install)` is called: `install()` puts them in use (call it when no generation runs),
    times them against eager the first time on this machine, keeps eager for "auto" if that is faster, and returns
    whether they are in use (default: at once). Without `swap`, "auto" on a CPU compiles only once an earlier start
    measured it (a load is not made to wait minutes by default); with one (the app, serving eagerly meanwhile), it
    compiles to measure. Failures stay eager with one line in `log`. Returns whether the base's forwards are
    compiled in the end, or what `swap` returns. Compile "inductor": "on", with inductor's kernels in the CUDA
    graphs (runners.decode_graphs)."""

    base, runtime = model.base, model.runtime
    mode, cuda = runtime.compile, runtime.cuda
    if mode == "off":
        return False
    # keyed on the eager model, as it is before compiling, and on how it compiles (a change re-measures)
    kernels = "inductor" if runtime.inductor_kernels else ""  # CUDA graphs of inductor's kernels measure apart
    how = hashlib.sha256(f"{cost_cache.compiled_options()}{runtime.base_buckets}{kernels}".encode()).hexdigest()[:8]
    path = cost_cache.path(model, f"-compiled-{how}")
    saved = cost_cache.load(path)
    if mode == "auto" and saved is None and swap is None and not cuda:
        log("compiled rounds: not measured on this machine yet (run once with --compile on, minutes the first "
            "time); decoding eagerly")  # fmt: skip
        return False
    if mode == "auto" and saved is not None and not saved["compiled_pays"]:
        return False
    log(f"compiling the base's 1-row step and verify passes, then the draft steps ({runtime.backend})")
    try:
        graphs = model.compile_base()
        graphs.warm(log)
    except Exception as e:  # noqa: BLE001 - any compiler failure means: stay eager, say why
        base.decompile()
        log(f"compiling failed ({type(e).__name__}: {_first_line(e)}); decoding eagerly")
        return False
    drafts = _compiled_drafts(model, log)
    shape = (model.tree.depth, model.tree.top_k)  # the tree that runs next (tune_tree may re-pick it after)
    draft_path = cost_cache.path(model, f"-compiled-draft-{how}-{shape[0]}x{shape[1]}")

    def install() -> bool:
        nonlocal saved
        eager_head = model.ea_layer
        base.compiled = graphs
        if drafts:  # the faster for the tree configured now; a tuned tree then picks among all (`tune`)
            model.ea_layer, model.compiled_draft = _faster_draft(model, drafts, shape, draft_path, log)
            model.draft_options = drafts
        if saved is None:
            saved = compiled_vs_eager(base)
            cost_cache.save(path, saved)
            rows, ms = list(saved["ms"]["compiled"]), saved["ms"]
            log("compiled vs eager, ms per forward over " + "/".join(map(str, rows)) + " rows: "
                + "/".join(f"{ms['compiled'][n]:.0f}" for n in rows) + " vs "
                + "/".join(f"{ms['eager'][n]:.0f}" for n in rows))  # fmt: skip
        if not saved["compiled_pays"]:
            if mode == "auto":
                base.decompile()
                model.ea_layer, model.compiled_draft, model.draft_options = eager_head, None, None
                log("compiled forwards measured slower than eager here: decoding eagerly")
                return False
            log("note: compiled forwards measured slower than eager here; kept because --compile on")
        return True

    return install() if swap is None else swap(install)


# a float32 head of at least this many bytes is also offered with its linears in GGUF blocks of QUANTIZED_HEAD's type
# (smaller heads stay in the caches): Q4_1, 20 bytes per 32 weights, where Q8_0 reads 34 (docs/benchmarks.md compares them)
QUANTIZED_HEAD_MIN_BYTES = 8 << 20
QUANTIZED_HEAD = quant_panels.Q4_1


def quantized_head_pays(base_dtype: torch.dtype, head) -> bool:
    """Whether a float32 copy of `head` with QUANTIZED_HEAD blocks (few_rows.quantize) may draft faster: under a
    float32 base on CPU, where the panel kernel runs, for a head whose float32 weights outgrow the caches."""

    float32_bytes = 4 * sum(p.numel() for p in head.parameters())
    return (base_dtype == torch.float32 and head.fc.weight.device.type == "cpu"
            and float32_bytes >= QUANTIZED_HEAD_MIN_BYTES and "panel" in few_rows.usable_kernels())  # fmt: skip


def _compiled_drafts(model, log) -> list[tuple]:
    """(head, its CompiledDraft) in the head's dtype and, where that is not the base's (a bfloat16 head under a
    float32 base, picked by eager timing), in the base's: compiled kernels rank the two otherwise than eager ones
    (docs/benchmarks.md); and a float32 copy with QUANTIZED_HEAD blocks where `quantized_head_pays`. A head whose graphs
    fail to compile is left out, with one line in `log`."""
    import copy

    heads = [model.ea_layer]
    if model.ea_layer.fc.weight.dtype != model.base.dtype:
        heads.append(copy.deepcopy(model.ea_layer).to(model.base.dtype))
    if quantized_head_pays(model.base.dtype, heads[-1]):
        # and in GGUF blocks: a draft step reads the head's weights at every level, a sixth of the bytes
        quantized = copy.deepcopy(heads[-1])
        few_rows.quantize(quantized, QUANTIZED_HEAD)
        heads.append(quantized)
    drafts = []
    for head in heads:
        try:
            graphs = model.compile_draft(head=head)
            graphs.warm(log)
            drafts.append((head, graphs))
        except Exception as e:  # noqa: BLE001 - as for the base: this dtype's draft steps stay eager
            log(f"compiling the {head.dtype_name} draft steps failed ({type(e).__name__}: {_first_line(e)})")
    if not drafts:
        log("no compiled draft steps: drafting eagerly")
    return drafts


def _faster_draft(model, drafts: list[tuple], shape: tuple[int, int], path, log) -> tuple:
    """The (head, CompiledDraft) whose draft phase for a tree of `shape` (depth, top_k) is faster here, timed once
    (cached at path). The tree matters: which dtype drafts faster changes with its depth and width."""
    if len(drafts) == 1:
        return drafts[0]
    names = [head.dtype_name for head, _ in drafts]
    seconds = cost_cache.load(path)
    if seconds is None or set(seconds) != set(names):
        seconds = {name: tuner.draft_seconds(model, [shape[0]], [shape[1]], repeats=9, head_and_graphs=d)[shape]
                   for name, d in zip(names, drafts)}  # fmt: skip
        cost_cache.save(path, seconds)
        log(f"compiled draft phase (depth {shape[0]}, width {shape[1]}): "
            + ", ".join(f"{1e3 * s:.1f} ms in {n}" for n, s in seconds.items()))  # fmt: skip
    return drafts[names.index(min(names, key=seconds.get))]


def compiled_vs_eager(base) -> dict:
    """ms per forward over each bucket's rows with the compiled graphs in use and without them."""
    rows = list(base.compiled.buckets)
    ms = {"compiled": {n: 1e3 * t for n, t in base.pass_seconds(rows).items()}}
    compiled, base.compiled = base.compiled, None
    try:
        ms["eager"] = {n: 1e3 * t for n, t in base.pass_seconds(rows).items()}
    finally:
        base.compiled = compiled
    return {"ms": ms, "compiled_pays": sum(ms["compiled"].values()) < sum(ms["eager"].values())}


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else ""
