"""What a base's `*ForCausalLM.forward` does to its logits after the lm_head, as a callable on a logits tensor.

The engine calls the decoder and the lm_head itself (eagle/models/base.py), so it must apply this processing too:
sampling follows softmax(processed logits), and the losslessness promise is about that distribution.

Found by reading the forwards of the `AutoModelForCausalLM` classes of transformers 5.23 (the lines after
`logits = self.lm_head(...)`), keyed here by the loaded model's `config.model_type`, values read from its
`get_text_config()`:

- soft-capping, tanh(x / c) * c, off when `final_logit_softcapping` is None: gemma2, gemma3_text (Gemma3ForCausalLM;
  Gemma3ForConditionalGeneration, "gemma3", applies none), gemma3n, gemma3n_text, gemma4, gemma4_text,
  gemma4_unified, gemma4_unified_text, vaultgemma, nanochat; beam the same, computed in float32;
- division by `logits_scaling`: granite, granite_swa, granitemoe, granitemoe_swa, granitemoehybrid,
  granitemoeshared; minicpm3 divides the hidden state by its `logits_scaling` (hidden_size / dim_model_base)
  before its bias-free lm_head: the same up to float rounding;
- multiplication: cohere, cohere2, cohere2_moe, cohere_compass_text by `logit_scale` (None = 1 in
  cohere_compass_text); hyperclovax by `logits_scaling`; falcon_h1 by `lm_head_multiplier`.

Not listed, and refused by `BaseModel`'s load-time check where they change the logits: inkling_text, inkling2_text
(logits cut to an unpadded vocabulary, inkling2 also soft-capped), modernbert-decoder (a dense + norm head before the
output embedding), prophetnet (n-gram streams), and the recurrent recurrent_gemma and xlstm (soft-capped, but the
engine cannot run a recurrent decoder). Classes that only upcast logits to float32 (mamba, mllama, nemotron_h, blt,
...) need nothing: the engine samples in float32 and an upcast never changes an argmax.

Every transform here is elementwise and increasing (positive scales, tanh caps): it commutes with selecting
vocabulary rows, and it never reorders a row's tokens (16-bit rounding of a cap can tie them), only changes their
probabilities.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

LogitTransform = Callable[[torch.Tensor], torch.Tensor]


def _softcap(cap, float32: bool = False) -> LogitTransform | None:
    if cap is None:
        return None

    def softcap(logits: torch.Tensor) -> torch.Tensor:
        x = logits.float() if float32 else logits
        return torch.tanh(x / cap) * cap  # the forwards' op order, so the result is bitwise theirs

    return softcap


def _divide(scale) -> LogitTransform | None:
    return None if scale is None or scale == 1 else lambda logits: logits / scale


def _multiply(scale) -> LogitTransform | None:
    return None if scale is None or scale == 1 else lambda logits: logits * scale


def _gemma(get) -> LogitTransform | None:
    return _softcap(get("final_logit_softcapping"))


def _beam(get) -> LogitTransform | None:
    return _softcap(get("final_logit_softcapping"), float32=True)


def _granite(get) -> LogitTransform | None:
    return _divide(get("logits_scaling"))


def _minicpm3(get) -> LogitTransform | None:
    return _divide(get("hidden_size") / (get("dim_model_base") or get("hidden_size")))


def _cohere(get) -> LogitTransform | None:
    return _multiply(get("logit_scale"))


def _hyperclovax(get) -> LogitTransform | None:
    return _multiply(get("logits_scaling"))


def _falcon_h1(get) -> LogitTransform | None:
    return _multiply(get("lm_head_multiplier"))


# model_type -> (config attribute getter -> transform or None)
TRANSFORMS: dict[str, Callable] = {
    **dict.fromkeys(("gemma2", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4", "gemma4_text", "gemma4_unified",
                     "gemma4_unified_text", "vaultgemma", "nanochat"), _gemma),
    "beam": _beam,
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
                     "granitemoeshared"), _granite),
    "minicpm3": _minicpm3,
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass_text"), _cohere),
    "hyperclovax": _hyperclovax,
    "falcon_h1": _falcon_h1,
}


def logit_transform(config, model_type: str | None = None) -> LogitTransform | None:
    """The post-lm_head processing of a base, or None when its forward has none.

    `config`: the model's config (a `PretrainedConfig`; values are read from `get_text_config()`), or a text
    config as a dict (what a training cache stores as `meta["base_config"]`). `model_type`: the loaded model's
    own type when it differs from the config's (a multimodal model's text config names the text model).
    The callable maps logits [..., V] to processed logits [..., V] in the same dtype (beam: float32)."""
    if isinstance(config, dict):
        get = config.get
    else:
        model_type = model_type or config.model_type
        text = config.get_text_config()

        def get(name):
            return getattr(text, name, None)

    entry = TRANSFORMS.get(model_type or get("model_type"))
    return entry(get) if entry is not None else None
