"""Load a draft checkpoint, unmodified, from a folder or a hub id: the reference project's layouts, and EAGLE-3
heads of other producers (SpecForge, speculators/vLLM, ModelOpt, AngelSlim: eagle/models/head_formats.py).

Files: `config.json` plus `model.safetensors` or `pytorch_model.bin` (pickles load with weights_only=True).
The format is detected from the keys: `midlayer.*`, `d2t` or a layer with a `hidden_norm` means EAGLE-3, `layers.0.*`
without them EAGLE-1/2.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from .draft_head import DraftConfig, DraftHead
from .head_formats import HeadFormatError, is_eagle3_layout, normalize

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
IGNORED_PREFIXES = ("target_model.",)  # training states may carry the frozen target's buffers
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
OPTIONAL_KEYS = {"embed_tokens.weight", "t2d", "d2t"}


class CheckpointError(ValueError):
    pass


def _resolve(path: str, filename: str) -> str | None:
    """A file of the checkpoint: from the folder if `path` is one, else from the hub (None if absent)."""
    if os.path.isdir(path):
        f = os.path.join(path, filename)
        return f if os.path.exists(f) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    try:
        return hf_hub_download(path, filename)
    except EntryNotFoundError as e:
        if isinstance(e, LocalEntryNotFoundError) and not _cached_repo(path):
            raise CheckpointError(
                f"cannot read draft checkpoint '{path}': it is not a local folder, the hub is unreachable (or "
                "HF_HUB_OFFLINE is set) and it is not in the hub cache. Pass --ea-model-path / ea_model_path="
                "<folder with config.json and model.safetensors or pytorch_model.bin>."
            ) from None
        return None  # the repo exists but lacks this file
    except Exception as e:  # offline, unknown repo, auth
        raise CheckpointError(
            f"cannot read draft checkpoint '{path}': it is not a local folder and the hub gave "
            f"{type(e).__name__}: {e}. Pass --ea-model-path / ea_model_path=<folder with config.json and "
            f"model.safetensors or pytorch_model.bin>."
        ) from None


def _cached_repo(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def read_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict on CPU)."""
    config_file = _resolve(path, "config.json")
    if config_file is None:
        raise CheckpointError(f"draft checkpoint '{path}' has no config.json")
    with open(config_file) as f:
        config = json.load(f)
    for name in WEIGHT_FILES:
        weights = _resolve(path, name)
        if weights is None:
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return config, load_file(weights)
        return config, torch.load(weights, map_location="cpu", weights_only=True)
    raise CheckpointError(f"draft checkpoint '{path}' has neither of {WEIGHT_FILES}")


def read_context_profile(path: str) -> dict | None:
    """How far copies of earlier text are accepted for this head's base (`context_profile.json` beside the head,
    written by eagle/train/context_profile.py; see context_draft.pick_chains), or None."""
    found = _resolve(path, "context_profile.json")
    if found is None:
        return None
    with open(found) as f:
        profile = json.load(f)
    if not all(isinstance(profile.get(key), list) for key in ("buckets", "share", "survival")):
        raise CheckpointError(f"{found}: expected lists 'buckets', 'share' and 'survival' "
                              "(python -m eagle.train.context_profile writes it)")  # fmt: skip
    return profile


def read_acceptance_profile(path: str) -> dict | None:
    """The head's acceptance profile (`acceptance.json` beside its weights, see eagle/train/acceptance.py), or None."""
    found = _resolve(path, "acceptance.json")
    if found is None:
        return None
    with open(found) as f:
        profile = json.load(f)
    rows = profile.get("accept", {}).get("0")
    if not rows or not all(isinstance(r, list) and r for r in rows):
        raise CheckpointError(f"{found}: expected accept['0'] as a list of per-depth lists (eagle/train/acceptance.py)")
    return profile


def detect_eagle3(config: dict, state: dict, use_eagle3: bool | None) -> bool:
    has3 = is_eagle3_layout(state)
    has12 = not has3 and any(k.startswith("layers.0.") for k in state)
    if has3 == has12:
        raise CheckpointError(
            "cannot tell the draft format: expected `layers.0.*` keys (EAGLE-1/2) or `midlayer.*` keys (EAGLE-3)"
        )
    if use_eagle3 is not None and use_eagle3 != has3:
        found = "EAGLE-3 (midlayer.*)" if has3 else "EAGLE-1/2 (layers.0.*)"
        raise CheckpointError(
            f"use_eagle3={use_eagle3} but the checkpoint is {found}; drop use_eagle3 to detect the format"
        )
    return has3


def build_draft_head(
    config: dict, state: dict[str, torch.Tensor], base_embedding: nn.Embedding, base_hidden: int,
    base_vocab: int, use_eagle3: bool | None = None,
) -> DraftHead:  # fmt: skip
    """Validate the checkpoint against the base and return the head (on CPU, in the checkpoint's dtype)."""
    state = {
        k: v for k, v in state.items() if not k.startswith(IGNORED_PREFIXES) and not k.endswith(IGNORED_SUFFIXES)
    }
    eagle3 = detect_eagle3(config, state, use_eagle3)
    try:
        config, state, _ = normalize(config, state)
    except HeadFormatError as e:
        raise CheckpointError(str(e)) from None
    cfg = DraftConfig.from_dict(config, eagle3)
    if eagle3 and "d2t" not in state and cfg.draft_vocab_size != cfg.vocab_size:
        raise CheckpointError("EAGLE-3 checkpoint with a reduced draft vocabulary lacks the `d2t` buffer")
    target_hidden = cfg.feature_size // (cfg.num_features if eagle3 else 1)
    if target_hidden != base_hidden:
        raise CheckpointError(
            f"draft expects base hidden size {target_hidden} (config.json hidden_size"
            f"{'/target_hidden_size' if eagle3 else ''}) but the base model has {base_hidden}: "
            "this head was trained for another base model"
        )
    if eagle3 and "fc.weight" in state and state["fc.weight"].shape[1] != cfg.feature_size:
        raise CheckpointError(
            f"draft fc.weight takes {state['fc.weight'].shape[1]} features but config.json implies "
            f"{cfg.num_features} feature layers x {target_hidden} = {cfg.feature_size}: set target_hidden_size or "
            "eagle_aux_hidden_state_layer_ids in config.json to match the weights"
        )
    if cfg.vocab_size != base_vocab:
        raise CheckpointError(
            f"draft config.json vocab_size={cfg.vocab_size} but the base lm_head has {base_vocab} rows: "
            "this head was trained for another base model"
        )
    own_embedding = "embed_tokens.weight" in state
    if not own_embedding and cfg.hidden_size != base_hidden:
        raise CheckpointError(
            f"the draft's hidden_size is {cfg.hidden_size} (config.json) but its base's is {base_hidden}, and the "
            "checkpoint has no `embed_tokens.weight`: the base's token embeddings are too narrow for it. Add the "
            f"head's own `embed_tokens.weight` [{cfg.vocab_size}, {cfg.hidden_size}] to the checkpoint (the reference "
            "trainer saves it whenever target_hidden_size is set)"
        )
    with torch.device("meta"):  # no allocation or random init: every weight comes from the checkpoint
        head = DraftHead(cfg, own_embedding=own_embedding)
    expected = set(head.state_dict())
    missing = sorted(expected - set(state) - OPTIONAL_KEYS)
    unexpected = sorted(set(state) - expected - OPTIONAL_KEYS)
    if missing or unexpected:
        hint = ' (set "bias" in config.json to match fc.bias)' if "fc.bias" in missing + unexpected else ""
        raise CheckpointError(
            f"draft checkpoint keys do not match the {'EAGLE-3' if eagle3 else 'EAGLE-1/2'} layout: "
            f"missing {missing}, unexpected {unexpected}{hint}"
        )
    own = head.state_dict()
    for k, v in state.items():
        if k in own and own[k].shape != v.shape:
            raise CheckpointError(
                f"draft checkpoint key {k} has shape {list(v.shape)}, config.json implies {list(own[k].shape)}"
            )
    head.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False, assign=True)
    head.rotary_emb = LlamaRotaryEmbedding(cfg.rope_config())  # buffers built on meta: rebuild for real
    if eagle3:
        vocab = torch.arange(cfg.draft_vocab_size)
        d2t = state.get("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        head.d2t = d2t.long()
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[vocab + head.d2t] = True
        head.t2d = state["t2d"].bool() if "t2d" in state else t2d
    if not own_embedding:
        head.share_embedding(base_embedding)
    return head
