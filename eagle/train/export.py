"""Draft config and export in the official layout (`config.json` + `model.safetensors`).

The config carries the Llama fields with `num_hidden_layers: 1` and
- EAGLE-3: `draft_vocab_size`, `architectures: ["LlamaForCausalLMEagle3"]` (the name vLLM maps to its
  Eagle3LlamaForCausalLM and SGLang registers), `tie_word_embeddings: false` (SGLang would otherwise use the
  embedding as the draft lm_head), no `bias` key (vLLM and SGLang read `bias: true` as o_proj / fc biases);
- EAGLE-1/2: `bias` (whether fc has a bias; the reference reads an absent key as true).

Weights (fp16 by default, like the official checkpoints):
- EAGLE-3: fc.weight [H, 3H], midlayer.* (q/k/v_proj over 2H), norm.weight, lm_head.weight [Vd, H], d2t [Vd] int64,
  t2d [V] bool; no embedding (the base's is used);
- EAGLE-1/2: fc.weight [H, 2H] (+ fc.bias), layers.0.* (no input_layernorm), and embed_tokens.weight (a copy of the
  base embedding, as the reference ships it) unless `include_embedding=False`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from eagle.models.draft_head import DraftHead

EXPORT_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                 "fp32": torch.float32, "float32": torch.float32}  # fmt: skip


def _rope_theta(base: dict) -> float:
    params = base.get("rope_parameters") or {}
    return float(base.get("rope_theta") or params.get("rope_theta") or 10000.0)


def draft_config(base: dict, recipe: str, draft_vocab_size: int | None = None, intermediate_size: int | None = None,
                 bias: bool = True, dtype: str = "float16") -> dict:  # fmt: skip
    """The draft's config.json for a base whose (text) config dict is `base`."""
    H, heads = base["hidden_size"], base["num_attention_heads"]
    eagle3 = recipe == "eagle3"
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": intermediate_size or base["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": base.get("num_key_value_heads") or heads,
        "head_dim": H // heads,  # the reference computes H / heads whatever the base's head_dim
        "num_hidden_layers": 1,
        "hidden_act": base.get("hidden_act", "silu"),
        "rms_norm_eps": base.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": base.get("max_position_embeddings", 2048),
        "rope_theta": _rope_theta(base),
        "vocab_size": base["vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": base.get("bos_token_id"),
        "eos_token_id": base.get("eos_token_id"),
        "pad_token_id": base.get("pad_token_id"),
        "torch_dtype": dtype,
    }
    if eagle3:
        cfg["draft_vocab_size"] = min(draft_vocab_size or base["vocab_size"], base["vocab_size"])
    else:
        cfg["bias"] = bool(bias)
    return cfg


def head_state(head: DraftHead, dtype: torch.dtype = torch.float16,
               embedding: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The official keys: floats in `dtype`, d2t int64, t2d bool; EAGLE-1/2 gets `embedding` as embed_tokens."""
    state = {}
    for k, v in head.state_dict().items():
        if k == "d2t":
            state[k] = v.detach().long().cpu()
        elif k == "t2d":
            state[k] = v.detach().bool().cpu()
        else:
            state[k] = v.detach().to(device="cpu", dtype=dtype)
    if not head.eagle3 and embedding is not None:
        state["embed_tokens.weight"] = embedding.detach().to(device="cpu", dtype=dtype)
    return {k: v.contiguous().clone() for k, v in state.items()}


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write `path` atomically: to a temporary file beside it, then renamed over it (never half-written)."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def export_head(head: DraftHead, config: dict, folder: str | os.PathLike, dtype: str = "fp16",
                embedding: torch.Tensor | None = None) -> Path:  # fmt: skip
    """Write `folder/config.json` and `folder/model.safetensors` (atomically replaced)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch_dtype = EXPORT_DTYPES[dtype]
    config = dict(config, torch_dtype=str(torch_dtype).removeprefix("torch."))
    state = head_state(head, torch_dtype, embedding)
    write_safetensors(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
