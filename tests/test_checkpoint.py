"""Draft checkpoints in the reference layouts load unmodified, whatever the file format and config variant."""

import math

import pytest
import torch
from tiny import random_draft, tiny_base

from eagle.model.ea_model import load_head
from eagle.models.checkpoint import CheckpointError, build_draft_head, read_checkpoint


def head_for(base, folder, **kw):
    config, state = read_checkpoint(folder)
    return load_head(base, config, state, **kw)


def drafted(head, base):
    """The head's output on fixed inputs (a fingerprint of all its weights)."""
    torch.manual_seed(0)
    feats = torch.randn(1, 5, head.config.feature_size)
    ids = torch.randint(0, base.config.vocab_size, (1, 5))
    mask = torch.zeros(1, 1, 5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), torch.finfo(torch.float32).min)
    return head(feats, ids, torch.arange(5)[None], mask, head.new_cache(8), 0)


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
def test_bin_and_safetensors_give_the_same_head(tmp_path, eagle3):
    base = tiny_base("llama")
    a = head_for(base, random_draft(base, str(tmp_path / "a"), eagle3=eagle3, fmt="safetensors"))
    b = head_for(base, random_draft(base, str(tmp_path / "b"), eagle3=eagle3, fmt="bin"))
    assert torch.equal(drafted(a, base), drafted(b, base))


def test_fc_bias_follows_the_config_key(tmp_path):
    base = tiny_base("llama")
    assert head_for(base, random_draft(base, str(tmp_path / "a"))).fc.bias is not None  # absent key = bias
    assert head_for(base, random_draft(base, str(tmp_path / "b"), bias=False)).fc.bias is None


def test_qkv_bias_is_loaded_for_qwen2_drafts(tmp_path):
    base = tiny_base("qwen2")
    head = head_for(base, random_draft(base, str(tmp_path / "a"), qkv_bias=True))
    assert head.layer.self_attn.q_proj.bias is not None and head.layer.self_attn.o_proj.bias is None


def test_eagle3_without_rope_theta_uses_base_10000(tmp_path):
    base = tiny_base("llama", rope_theta=500000.0)
    head = head_for(base, random_draft(base, str(tmp_path / "a"), eagle3=True))
    d = head.config.head_dim
    expected = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    torch.testing.assert_close(head.rotary_emb.inv_freq.float(), expected)
    assert not math.isclose(head.rotary_emb.inv_freq[1].item(), 1 / 500000 ** (2 / d))


def test_llama31_rope_scaling_in_a_draft_config_is_accepted(tmp_path):
    base = tiny_base("llama31")
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # fmt: skip
    head = head_for(base, random_draft(base, str(tmp_path / "a"), rope_theta=500000.0, rope_scaling=rope))
    assert head.rotary_emb.rope_type == "llama3"


def test_eagle3_maps_draft_ids_to_target_ids_with_d2t(tmp_path):
    base = tiny_base("llama")
    head = head_for(base, random_draft(base, str(tmp_path / "a"), eagle3=True, draft_vocab=8))
    used = torch.arange(0, 16, 2)  # tiny.random_draft keeps every other target id
    assert head.to_target_ids(torch.arange(8)).tolist() == used.tolist()
    assert head.t2d.nonzero().flatten().tolist() == used.tolist()


def test_eagle3_shares_the_frozen_base_embedding(tmp_path):
    base = tiny_base("llama")
    head = head_for(base, random_draft(base, str(tmp_path / "a"), eagle3=True))
    assert "embed_tokens.weight" not in head.state_dict()
    torch.testing.assert_close(head.embed(torch.tensor([3])), base.get_input_embeddings().weight[3:4])


def test_training_state_extras_are_ignored(tmp_path):
    base = tiny_base("llama")
    config, state = read_checkpoint(random_draft(base, str(tmp_path / "a"), eagle3=True))
    clean = drafted(load_head(base, config, dict(state)), base)
    state["target_model.model.rotary_emb.inv_freq"] = torch.ones(4)
    state["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    assert torch.equal(drafted(load_head(base, config, state), base), clean)


def test_format_is_detected_from_keys_not_flags(tmp_path):
    base = tiny_base("llama")
    for eagle3 in (False, True):
        config, state = read_checkpoint(random_draft(base, str(tmp_path / str(eagle3)), eagle3=eagle3))
        config.pop("draft_vocab_size", None)
        head = build_draft_head(config, state, base.get_input_embeddings(), 32, 16)
        assert head.eagle3 == eagle3


def test_a_head_wider_than_its_base_without_its_own_embedding_is_refused_naming_the_key(tmp_path):
    base = tiny_base("llama")
    folder = random_draft(base, str(tmp_path / "a"), eagle3=True, hidden_size=48, target_hidden_size=32)
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight` \[16, 48\]"):
        head_for(base, folder)
