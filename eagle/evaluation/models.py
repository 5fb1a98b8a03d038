"""Model options of the evaluation tools: the same model types and loading as the app (`eagle.chat.model_types`).

`--model-type` picks a default base, the EAGLE head trained for it, the prompt template kind and the system
prompt the reference's evaluation scripts use. `--base-model-path` and `--ea-model-path` override the
checkpoints; a `--base-model-path` without `--model-type` is prompted with its own chat template. Without any
model option the embedded default is used: SmolLM2-135M-Instruct with the EAGLE-3 head in assets/smollm2-eagle3/.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from eagle.chat.model_types import (
    ALIASES, COMPILE_MODES, DTYPES, MODEL_TYPES, WEIGHTS, LoadedModel, ModelLoadError, ModelType, load, model_type,
)  # fmt: skip


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model (default: SmolLM2-135M-Instruct with the head in assets/smollm2-eagle3)")
    g.add_argument("--model-type", default=None, metavar="TYPE",
                   help=f"default checkpoints and prompt template: {', '.join([*sorted(MODEL_TYPES), *ALIASES])} "
                   "(default: smollm2)")  # fmt: skip
    g.add_argument("--base-model-path", default=None, help="base model folder or hub id (overrides the type's)")
    g.add_argument("--ea-model-path", default=None, help="EAGLE head folder or hub id (overrides the type's)")
    g.add_argument("--total-token", type=int, default=None,
                   help="EAGLE-2 tree: nodes verified per round (default: 60 on GPU, 4 on CPU; -1 = by timing)")
    g.add_argument("--depth", type=int, default=None, help="EAGLE-2 tree: draft depth (default: 7 on GPU, 3 on CPU)")
    g.add_argument("--top-k", type=int, default=None, help="EAGLE-2 tree: branching (default: 10 on GPU, 3 on CPU)")
    g.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: float32 on CPU, the type's dtype on GPU")
    g.add_argument("--draft-dtype", choices=DTYPES, default="auto",
                   help="the head's dtype; auto: under a float32 base on CPU, float32 or bfloat16, whichever "
                   "drafts faster on this machine (timed once, cached), else the base's")  # fmt: skip
    g.add_argument("--weights", choices=WEIGHTS, default="fp32",
                   help="the base's weights on CPU: fp32 (default), or q4_1 = its GGUF's own blocks read by the panel "
                   "kernel (the embedded default; auto = q4_1 where the default base was converted from its GGUF)")
    g.add_argument("--device-map", default=None, help="transformers device_map (default: 'auto' on GPU, CPU otherwise)")
    g.add_argument("--compile", choices=COMPILE_MODES, default="auto",
                   help="compiled rounds (CPU: eagle/runtime/compiled.py; CUDA: cuda_graphs.py): on (minutes on a "
                   "CPU the first time, cached), off, auto = on where a start with 'on' measured them faster "
                   "(default), or inductor = on, and on CUDA with inductor's kernels in the graphs")  # fmt: skip


def pick_type(args) -> ModelType:
    if args.model_type:
        return model_type(args.model_type)
    if args.base_model_path:  # an arbitrary base: its own chat template (or a plain prompt)
        if not args.ea_model_path:
            raise ModelLoadError("--base-model-path without --model-type needs --ea-model-path (the EAGLE head)")
        return ModelType("custom", args.base_model_path, args.ea_model_path, "chat-template")
    return MODEL_TYPES["smollm2"]


def load_from_args(args, log=print, few_row_kernels: bool | str = "auto") -> LoadedModel:
    """Load the EaModel the options describe (base, head, tree defaults, dtype, device map)."""
    return load(pick_type(args), args.base_model_path, args.ea_model_path, args.total_token, args.depth,
                args.top_k, args.dtype, args.device_map, log=log, draft_dtype=args.draft_dtype,
                few_row_kernels=few_row_kernels, compile=getattr(args, "compile", "auto"),
                weights=getattr(args, "weights", "fp32"))  # fmt: skip


def device_name(device: str) -> str:
    """A human description of the machine the benchmark ran on."""
    import platform

    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA {torch.version.cuda})"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"CPU: {cpu}, torch threads: {torch.get_num_threads()}"


def log(msg: str) -> None:
    """Progress of a tool: on stderr, so that stdout keeps its results."""
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def exit_on_bad_options():
    """A model that cannot be loaded or a bad option ends the tool with one line on stderr and status 2."""
    try:
        yield
    except (ModelLoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
