"""Rotary tables stay float32 whatever the dtype of the draft head (and of the base): at position 2000 the
angles of a bf16/fp16 head equal the float32 ones, so cos/sin differ only by the rounding of their values."""

import pytest
import torch
from tiny import draft_config, save_base, tiny_base
from transformers import AutoModelForCausalLM

from eagle.models.draft_head import DraftConfig, DraftHead

POSITION = 2000


def _tables(rope, dtype):
    x = torch.zeros(1, dtype=dtype)
    return rope(x, torch.tensor([[POSITION]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_draft_head_in_half_precision_keeps_float32_rotary_angles(dtype):
    base = tiny_base("llama", vocab=64)
    cfg = DraftConfig.from_dict(draft_config(base, eagle3=True, rope_theta=100000.0), True)
    ref = DraftHead(cfg, own_embedding=False)
    head = DraftHead(cfg, own_embedding=False).to(dtype)
    assert head.fc.weight.dtype == dtype and head.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(head.rotary_emb.inv_freq, ref.rotary_emb.inv_freq)
    cos, sin = _tables(head.rotary_emb, dtype)
    ref_cos, ref_sin = _tables(ref.rotary_emb, torch.float32)
    # only the rounding of values in [-1, 1] to `dtype` remains (bf16: 2^-9 relative), not an angle error
    tol = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
    assert (cos.float() - ref_cos).abs().max() <= tol and (sin.float() - ref_sin).abs().max() <= tol
    rounded = ref.rotary_emb.inv_freq.to(dtype).float()  # what the cast used to leave: angles off by radians
    assert (POSITION * (rounded - ref.rotary_emb.inv_freq)).abs().max() > 0.01  # > tol: the test can tell


def test_base_loaded_in_bf16_keeps_float32_rotary_frequencies(tmp_path):
    save_base(tiny_base("llama", vocab=64), str(tmp_path / "b"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
