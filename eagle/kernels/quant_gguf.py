"""The GGUF blocks of a model's linear layers, for the quantized panel kernel (quant_panels.py, few_rows.py).

A base folder converted from a GGUF (eagle/default_model.py) names its GGUF in config.json under CONFIG_KEY;
`few_rows.install` then gives each linear layer whose weight the file keeps as Q4_1 or Q8_0 those blocks
(`blocks_for`), and its panel copy is made of them. Invariant, checked here for every layer: the blocks dequantize
(as gguf-py does) to exactly the layer's float32 weight, so both copies hold the same weights (the quantized kernel
rounds the inputs to 8 or 16 bits a block: quant_linear.cpp). A layer whose weight the file keeps in another type (F32,
a K-quant) keeps float32 panels.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from . import quant_panels

CONFIG_KEY = "eagle_weights_gguf"  # config attribute: the GGUF whose blocks the CPU kernels read


class GgufMismatch(ValueError):
    """The model's weights are not the GGUF's dequantized blocks."""


def gguf_path_of(model: nn.Module) -> Path | None:
    """The GGUF named by the model's config (CONFIG_KEY), or None."""
    path = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    return Path(path) if path else None


def _reverse_permute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves the rotary halves of each head's q/k rows; transformers undoes it at load
    (LlamaTensorProcessor). The same permutation of the rows, applied to the blocks [N, bytes]."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, -1).transpose(1, 2).reshape(n, -1)


@torch.no_grad()
def blocks_for(model: nn.Module, gguf_path: str | Path) -> dict[str, tuple[int, torch.Tensor]]:
    """{module name: (qtype, blocks uint8 [N, K / 32 * bytes per block])} for the nn.Linear layers of `model` whose
    weight `gguf_path` keeps as Q4_1 or Q8_0, rows in the model's order. Raises GgufMismatch when a layer's weight
    is not the dequantized blocks (the folder was not converted from this file)."""
    import gguf

    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} (the GGUF whose blocks config.json's {CONFIG_KEY} names) is missing: fetch it again "
            "(eagle.default_model.default_base_model_path) or load the base with float32 weights (--weights fp32)"
        )
    reader = gguf.GGUFReader(str(path))
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name)
    config = model.config.get_text_config()
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}
    out = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        name = names.get_name(module_name)
        if module_name.endswith("lm_head") and f"{name}.weight" not in tensors:
            name = "token_embd"  # tied to the embedding, which the file keeps once
        tensor = tensors.get(f"{name}.weight")
        if tensor is None or int(tensor.tensor_type) not in quant_panels.BLOCK_BYTES:
            continue
        qtype = int(tensor.tensor_type)
        blocks = torch.from_numpy(tensor.data.copy()).reshape(module.out_features, -1)  # [N, bytes]
        weight = module.weight.detach()
        if not torch.equal(quant_panels.dequantize(qtype, blocks), weight):
            heads = config.num_attention_heads if name.endswith("attn_q") else config.num_key_value_heads
            blocks = _reverse_permute(blocks, heads).contiguous()
            if not torch.equal(quant_panels.dequantize(qtype, blocks), weight):
                raise GgufMismatch(
                    f"{module_name}'s float32 weight is not {path.name}'s {tensor.name} dequantized: the base folder "
                    f"was not converted from that file. Remove {CONFIG_KEY} from its config.json, or load it with "
                    "--weights fp32"
                )
        out[module_name] = (qtype, blocks)
    return out


def _cache_key(model: nn.Module, gguf_path: Path) -> str | None:
    """The file of `blocks_for`'s result for this GGUF and the model's weights as saved in its folder (each file's
    path, size and modification time), or None where the model was not loaded from a folder."""
    import hashlib

    folder = Path(getattr(model.config, "_name_or_path", "") or "")
    weights = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not weights:
        return None
    parts = [str(p.resolve()) + f":{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in [gguf_path, *weights]]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def cached_blocks_for(model: nn.Module, gguf_path: str | Path) -> dict[str, tuple[int, torch.Tensor]]:
    """`blocks_for`, kept under `cache_dir()/gguf-blocks` once checked (the check, 2-3 s for the default model, is
    made once per GGUF and weights file)."""
    from safetensors.torch import load_file, save_file

    from eagle.fetch import cache_dir

    key = _cache_key(model, Path(gguf_path))
    path = None if key is None else cache_dir() / "gguf-blocks" / f"{key}.safetensors"
    if path is not None and path.is_file():
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            types = f.metadata()
        return {name: (int(types[name]), t) for name, t in load_file(str(path)).items()}
    found = blocks_for(model, gguf_path)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({n: b for n, (_, b) in found.items()}, str(tmp), metadata={n: str(q) for n, (q, _) in found.items()})
        tmp.chmod(0o644)  # safetensors leaves owner-only modes
        tmp.replace(path)
    return found
