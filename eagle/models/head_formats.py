"""EAGLE-3 heads as other producers write them, brought to the reference layout that `DraftHead` loads.

Every producer keeps the reference's core (fc over the base features, one layer attending over
[input_layernorm(embed); hidden_norm(h)], norm, lm_head over a draft vocabulary, d2t) and adds its own names and
switches. `normalize` renames the keys to the reference's (`midlayer.*`) and states the switches in the config
dict under the names `DraftConfig` reads:

- SafeAILab, this project, AngelSlim (`target_model_type`): `midlayer.*`, no switches.
- speculators / vLLM (`speculators_model_type`): `layers.0.*` and the layer's config nested in
  `transformer_layer_config`; input_norm (norm_before_fc), fc_norm, norm_before_residual (vLLM reads an absent key
  as true), norm_output = the next step gets the normed state.
- SpecForge (`fc_norm.*` keys, or `eagle_config` without ModelOpt's keys): `midlayer.*`; fc_norm ("EAGLE-3.1");
  norm_output=false = lm_head(out) without the final norm.
- ModelOpt (`eagle_config.use_last_layernorm`): `midlayer.*` until 2026-03 (the reference's layer), `layers.0.*`
  after, whose stock first layer norms h twice: hidden_norm(input_layernorm(h)); d2t in frequency order, no t2d.

Feature layers, as indices into transformers' `hidden_states` (entry i = the input of decoder layer i):
speculators' top-level `eagle_aux_hidden_state_layer_ids` count layer inputs (used as given);
`eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge, ModelOpt) count layer outputs (index id + 1).
Without ids: (2, L // 2, L - 3), the tensors every producer's default selects.
"""

from __future__ import annotations

import re

import torch

LAYER_KEY = re.compile(r"^(?:layers|midlayer)\.(\d+)\.(.*)$")


class HeadFormatError(ValueError):
    pass


def producer(config: dict, state: dict) -> str:
    if "speculators_model_type" in config:
        return "speculators"
    eagle_config = config.get("eagle_config") or {}
    if "use_last_layernorm" in eagle_config or "use_aux_hidden_state" in eagle_config:
        return "modelopt"
    if any(k.startswith("fc_norm.") for k in state) or eagle_config.get("eagle_aux_hidden_state_layer_ids"):
        return "specforge"
    if "target_model_type" in config:
        return "angelslim"
    return "reference"


def is_eagle3_layout(state: dict) -> bool:
    """EAGLE-3 keys of any producer: the reference's `midlayer.*`, a d2t map, or a layer with a hidden_norm."""
    return any(k.startswith("midlayer.") or k.endswith(".hidden_norm.weight") for k in state) or "d2t" in state


def normalize(config: dict, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor], str]:
    """(config, state) of an EAGLE-3 head of any producer above -> (config, state) in the reference layout with the
    switches spelled out, and the producer's name. EAGLE-1/2 heads are returned unchanged."""
    if not is_eagle3_layout(state):
        return _head_dim_from_weights(dict(config), state, "layers.0."), state, "reference"
    who = producer(config, state)
    cfg = dict(config)
    if who == "speculators":
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise HeadFormatError("speculators config.json lacks `transformer_layer_config` (the draft layer's config)")
        cfg = {**layer, **{k: v for k, v in config.items() if k != "transformer_layer_config" and v is not None}}
        cfg["norm_before_residual"] = bool(config.get("norm_before_residual", True))  # vLLM's default when absent
        cfg["feed_back_normed"] = bool(config.get("norm_output", False))
        if config.get("eagle_aux_hidden_state_layer_ids"):
            cfg["feature_layers"] = list(config["eagle_aux_hidden_state_layer_ids"])
    elif who == "specforge":
        cfg["norm_before_lm_head"] = bool(config.get("norm_output", True))
    if who in ("specforge", "modelopt"):
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids:
            cfg["feature_layers"] = [i + 1 for i in ids]  # layer outputs -> the next layer's input
    cfg.pop("norm_output", None)  # two producers, two meanings: spelled out above
    if cfg.get("rope_parameters") and "rope_theta" not in cfg:  # transformers 5 configs
        params = cfg["rope_parameters"]
        cfg["rope_theta"] = params.get("rope_theta", 10000.0)
        if params.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = params
    state = _unit_norms_where_missing(config, dict(state))
    cfg["fc_norm"] = any(k.startswith("fc_norm.") for k in state)
    cfg["norm_before_fc"] = "input_norm.weight" in state
    cfg["qk_norm"] = any(k.endswith("self_attn.q_norm.weight") for k in state)  # Qwen3-style drafts
    cfg["qkv_bias"] = any(k.endswith("self_attn.q_proj.bias") for k in state)
    cfg["o_bias"] = any(k.endswith("self_attn.o_proj.bias") for k in state)

    numbered = sorted({int(m.group(1)) for k in state if (m := LAYER_KEY.match(k))})
    if numbered not in ([], [0]):
        raise HeadFormatError(
            f"this {who} head has draft layers {numbered}: only one-layer EAGLE-3 heads are supported (no trained "
            "multi-layer head is published, and runtimes disagree on how its later layers are normed)"
        )
    renamed = {}
    for k, v in state.items():
        m = LAYER_KEY.match(k)
        renamed[f"midlayer.{m.group(2)}" if m else k] = v
    if who == "modelopt" and any(k.startswith("layers.0.") for k in state):
        cfg["hidden_input_norm"] = True  # the stock first layer norms h with input_layernorm, then hidden_norm
    if "d2t" in renamed and "t2d" not in renamed:  # ModelOpt: d2t in frequency order, t2d derived
        t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
        d2t = renamed["d2t"].long()
        t2d[torch.arange(d2t.numel()) + d2t] = True
        renamed["t2d"] = t2d
    for k in [k for k in renamed if k.startswith(("verifier_lm_head.", "verifier_norm."))]:
        del renamed[k]  # speculators training states: the verifier's own weights
    return _head_dim_from_weights(cfg, renamed, "midlayer."), renamed, who


def _unit_norms_where_missing(config: dict, state: dict) -> dict:
    """A config that asks for the feature norms of speculators/SpecForge without their weights (the speculators
    converter drops them) gets unit weights, as vLLM serves it: the normalisation itself is kept."""
    width = state["fc.weight"].shape[1] if "fc.weight" in state else None
    if config.get("norm_before_fc") and "input_norm.weight" not in state and width:
        state["input_norm.weight"] = torch.ones(width)
    blocks = len(config.get("eagle_aux_hidden_state_layer_ids") or ()) or 3
    if config.get("fc_norm") and not any(k.startswith("fc_norm.") for k in state) and width:
        state.update({f"fc_norm.{i}.weight": torch.ones(width // blocks) for i in range(blocks)})
    return state


def _head_dim_from_weights(cfg: dict, state: dict, layer: str) -> dict:
    """The weights say the attention head width, whatever a `head_dim` key says or omits (the reference ignores
    the key and divides; SpecForge, speculators and ModelOpt honour it)."""
    q = state.get(f"{layer}self_attn.q_proj.weight")
    if q is not None and cfg.get("num_attention_heads"):
        cfg["head_dim_from_weights"] = q.shape[0] // cfg["num_attention_heads"]
    return cfg
