"""Model types and loading for the evaluation tools (the same options as the app, no dependency on app/).

A model type names a default base (hub id; None = the embedded SmolLM2 default), the EAGLE head trained for it,
the prompt template kind and the system prompt the reference's evaluation scripts use. `--base-model-path` and
`--ea-model-path` override the checkpoints. Without any model option the embedded default is used: SmolLM2-135M-
Instruct with the EAGLE-3 head in assets/smollm2-eagle3/.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_HEAD_DIR = ROOT / "assets" / "smollm2-eagle3"
HEAD_FILES = ("model.safetensors", "pytorch_model.bin")
DTYPES = ("auto", "float32", "float16", "bfloat16")

# Llama-2-chat's system prompt, which the reference's llama2chat / llama3chat evaluation scripts use.
LLAMA2_SYSTEM = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being "
    "safe.  Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or illegal "
    "content. Please ensure that your responses are socially unbiased and positive in nature.\n\nIf a question "
    "does not make any sense, or is not factually coherent, explain why instead of answering something not "
    "correct. If you don't know the answer to a question, please don't share false information."
)


@dataclass(frozen=True)
class ModelType:
    name: str
    base: str | None  # hub id or folder; None = the embedded default (eagle.default_model)
    head: str  # hub id or folder
    template: str  # "chat-template" (the tokenizer's own), "vicuna", "llama-2", "mixtral" (fastchat layouts)
    system: str = ""
    gpu_dtype: str = "float16"


MODEL_TYPES: dict[str, ModelType] = {
    t.name: t
    for t in [
        ModelType("smollm2", None, str(DEFAULT_HEAD_DIR), "chat-template"),
        ModelType("llama3", "meta-llama/Meta-Llama-3-8B-Instruct", "yuhuili/EAGLE-LLaMA3-Instruct-8B",
                  "chat-template", LLAMA2_SYSTEM),
        ModelType("llama3.1", "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                  "chat-template", LLAMA2_SYSTEM),
        ModelType("vicuna", "lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", "vicuna"),
        ModelType("llama2", "meta-llama/Llama-2-7b-chat-hf", "yuhuili/EAGLE-llama2-chat-7B", "llama-2", LLAMA2_SYSTEM),
        ModelType("mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", "yuhuili/EAGLE-mixtral-instruct-8x7B", "mixtral"),
        ModelType("qwen2", "Qwen/Qwen2-7B-Instruct", "yuhuili/EAGLE-Qwen2-7B-Instruct", "chat-template",
                  "You are a helpful assistant.", gpu_dtype="bfloat16"),
    ]
}  # fmt: skip


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what is missing and what to do."""


@dataclass
class Loaded:
    model: object  # EaModel
    mtype: ModelType
    base_path: str
    head_path: str
    dtype: str
    device: str

    def describe(self) -> dict:
        return {
            "type": self.mtype.name, "base": self.base_path, "head": self.head_path, "dtype": self.dtype,
            "eagle3": bool(self.model.use_eagle3), "template": self.mtype.template,
        }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model (default: SmolLM2-135M-Instruct with the head in assets/smollm2-eagle3)")
    g.add_argument("--model-type", choices=sorted(MODEL_TYPES), default=None,
                   help="default checkpoints and prompt template (default: smollm2)")
    g.add_argument("--base-model-path", default=None, help="base model folder or hub id (overrides the type's)")
    g.add_argument("--ea-model-path", default=None, help="EAGLE head folder or hub id (overrides the type's)")
    g.add_argument("--total-token", type=int, default=60, help="EAGLE-2 tree: nodes verified per round (default: 60)")
    g.add_argument("--depth", type=int, default=7, help="EAGLE-2 tree: draft depth (default: 7)")
    g.add_argument("--top-k", type=int, default=10, help="EAGLE-2 tree: branching per node (default: 10)")
    g.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: float32 on CPU, the type's dtype on GPU")
    g.add_argument("--device-map", default=None, help="transformers device_map (default: 'auto' on GPU, CPU otherwise)")


def pick_type(args) -> ModelType:
    if args.model_type:
        return MODEL_TYPES[args.model_type]
    if args.base_model_path:  # an arbitrary base: its own chat template (or a plain prompt)
        return ModelType("custom", args.base_model_path, args.ea_model_path or "", "chat-template")
    return MODEL_TYPES["smollm2"]


def check_head(path: str, is_default: bool) -> None:
    """A local head folder must hold config.json and the weights; the default one may not be trained yet."""
    folder = Path(path)
    if not folder.exists() and not is_default:
        return  # a hub id: checked by the loader
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    if not any((folder / f).is_file() for f in HEAD_FILES):
        missing.append("model.safetensors")
    if not missing:
        return
    if is_default:
        raise ModelLoadError(
            f"the default EAGLE-3 head for SmolLM2-135M-Instruct is missing: {folder} has no "
            f"{' and '.join(missing)}.\nIt is produced by the project's EAGLE-3 training (eagle/train) and saved "
            "there. Meanwhile pass --ea-model-path <folder with config.json and model.safetensors>."
        )
    raise ModelLoadError(f"EAGLE head folder {folder} has no {' or '.join(missing)}")


def load(args, log=print) -> Loaded:
    """Load the EaModel the options describe (base, head, tree defaults, dtype, device map)."""
    import torch

    from eagle.model.ea_model import EaModel

    mtype = pick_type(args)
    base = args.base_model_path or mtype.base
    head = args.ea_model_path or mtype.head
    if not head:
        raise ModelLoadError("--base-model-path without --model-type needs --ea-model-path (the EAGLE head)")
    check_head(head, is_default=head == str(DEFAULT_HEAD_DIR) and not args.ea_model_path)
    if base is None:
        from eagle.default_model import default_base_model_path

        log("resolving the default base model SmolLM2-135M-Instruct")
        try:
            base = default_base_model_path()
        except Exception as e:
            raise ModelLoadError(
                f"could not get the default base model SmolLM2-135M-Instruct ({type(e).__name__}: {e}). "
                "Pass --base-model-path <folder>."
            ) from None
    cuda = torch.cuda.is_available()
    dtype = args.dtype if args.dtype != "auto" else (mtype.gpu_dtype if cuda else "float32")
    kwargs = {"dtype": getattr(torch, dtype)}
    device_map = args.device_map or ("auto" if cuda else None)
    if device_map and device_map != "cpu":
        kwargs["device_map"] = device_map
    log(f"loading base {base} and head {head} ({dtype}, device_map={device_map or 'cpu'})")
    try:
        model = EaModel.from_pretrained(
            base, head, total_token=args.total_token, depth=args.depth, top_k=args.top_k, **kwargs
        )
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"could not load base {base!r} with head {head!r}: {type(e).__name__}: {e}") from None
    device = str(model.base_model.get_input_embeddings().weight.device)
    return Loaded(model, mtype, str(base), str(head), dtype, device)


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
