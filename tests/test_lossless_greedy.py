"""Greedy EAGLE output equals transformers' greedy `generate`, token for token, with acceptance happening."""

import pytest
import torch
from lossless_checks import NEW, PROMPTS
from tiny import VOCAB, random_draft, save_base, tiny_base

from eagle.decoding.generate import TreeSpec
from eagle.decoding.tree import MC_SIM_7B_63
from eagle.model.ea_model import EaModel

TREES = {
    "default": None,  # total_token=60, depth=7, top_k=10
    "small": TreeSpec(total_token=12, depth=3, top_k=4),
    "static": TreeSpec(choices=tuple(map(tuple, MC_SIM_7B_63))),
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "mixtral", "llama31"])
def base_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    base = tiny_base(request.param)
    save_base(base, str(folder / "base"))
    return folder, base


def load(folder, base, eagle3, draft_dtype=None):
    draft = random_draft(base, str(folder / f"draft{int(eagle3)}"), eagle3=eagle3, draft_vocab=12 if eagle3 else None)
    return EaModel.from_pretrained(str(folder / "base"), draft, dtype=torch.float32, draft_dtype=draft_dtype)


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
def test_greedy_eagle_equals_hf_generate_and_accepts_drafts(base_folder, eagle3):
    folder, base = base_folder
    if eagle3 and base.config.model_type == "mixtral":
        pytest.skip("EAGLE-3 heads exist for Llama and Qwen targets")
    assert_greedy_equals_generate(load(folder, base, eagle3), base)


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
def test_bfloat16_head_under_float32_base_stays_lossless(tmp_path, eagle3):
    base = tiny_base("llama")  # one architecture: the head's dtype does not touch the base
    save_base(base, str(tmp_path / "base"))
    model = load(tmp_path, base, eagle3, draft_dtype="bfloat16")
    assert model.ea_layer.fc.weight.dtype == torch.bfloat16 and model.base.dtype == torch.float32
    assert_greedy_equals_generate(model, base)


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
def test_greedy_eagle_equals_hf_generate_after_a_1100_token_prompt(tmp_path, eagle3):
    base = tiny_base("llama", max_position_embeddings=2048)
    save_base(base, str(tmp_path / "base"))
    model = load(tmp_path, base, eagle3)
    ids = torch.randint(0, VOCAB, (1, 1100), generator=torch.Generator().manual_seed(0))
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                        min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)  # fmt: skip
    out, n, rounds = model.eagenerate(ids, max_new_tokens=NEW, stop_token_ids=[], log=True)
    assert out.tolist() == ref.tolist()
    assert n / (rounds + 1) > 1.05, "no drafted token was accepted: the long-context tree was not exercised"


def test_eagle3_head_wider_than_its_base_stays_lossless(tmp_path):
    """target_hidden_size (the base's width) != hidden_size (the head's): fc takes 3 base widths, and the head
    embeds tokens with its own table."""
    base = tiny_base("llama")
    save_base(base, str(tmp_path / "base"))
    draft = random_draft(base, str(tmp_path / "draft"), eagle3=True, embed=True, hidden_size=48, target_hidden_size=32)
    model = EaModel.from_pretrained(str(tmp_path / "base"), draft, dtype=torch.float32)
    assert tuple(model.ea_layer.fc.weight.shape) == (48, 3 * 32)
    assert tuple(model.ea_layer.embed_tokens.weight.shape) == (VOCAB, 48)
    assert_greedy_equals_generate(model, base)


def assert_greedy_equals_generate(model, base):
    for name, tree in TREES.items():
        new_tokens = rounds = 0
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)  # fmt: skip
            out, n, r = model.eagenerate(ids, max_new_tokens=NEW, stop_token_ids=[], log=True, tree=tree)
            assert out.tolist() == ref.tolist(), f"{name} tree diverged from greedy generate"
            new_tokens, rounds = new_tokens + n, rounds + r + 1
        assert new_tokens / rounds > 1.05, f"{name} tree: no drafted token was accepted"


def test_naivegenerate_equals_hf_generate(base_folder):
    folder, base = base_folder
    model = load(folder, base, False)
    ids = torch.tensor([PROMPTS[1]])
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                        min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)  # fmt: skip
    out, n, r = model.naivegenerate(ids, max_new_tokens=NEW, stop_token_ids=[], log=True)
    assert out.tolist() == ref.tolist()
    assert (n, r + 1) == (NEW, NEW)  # one token per base forward


def test_greedy_stops_like_hf_generate_at_eos(tmp_path):
    base = tiny_base("llama", seed=3)
    prompts = [[first, 5, 9] for first in range(2, VOCAB)]
    # Use as eos a token the greedy base does produce for the first prompt, a few tokens in.
    ids = torch.tensor([prompts[0]])
    eos = int(base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)[0, -1])
    save_base(base, str(tmp_path / "base"), eos=eos)
    model = EaModel.from_pretrained(str(tmp_path / "base"), random_draft(base, str(tmp_path / "d")))
    model.stop_token_ids = {eos}
    stopped = 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64,
                            eos_token_id=eos, pad_token_id=0)  # fmt: skip
        out = model.eagenerate(ids, max_new_tokens=64)
        assert out.tolist() == ref.tolist()
        stopped += int(out[0, -1] == eos and out.shape[1] < 3 + 64)
    assert stopped > 0, "no prompt reached eos: the stop path was not exercised"
