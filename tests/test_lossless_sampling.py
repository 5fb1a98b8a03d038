"""Sampled EAGLE output has exactly the base model's distribution (temperature, top-p, top-k)."""

from dataclasses import replace

import pytest
import torch
from lossless_checks import (
    P_VALUE,
    PROMPT,
    VOCAB,
    assert_follows_base_distribution,
    chi_square_p_value,
    exact_pair_distribution,
    make_model,
    sample_pairs,
)
from tiny import random_draft, tiny_base

import eagle.decoding.generate as generate
from eagle.decoding.context_draft import ContextStats
from eagle.decoding.tree import TreeDraft
from eagle.decoding.verify import SamplingParams
from eagle.models.checkpoint import read_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    base = tiny_base("llama", vocab=VOCAB, seed=5)
    with torch.no_grad():  # flatter logits: many outcomes have visible probability
        base.get_output_embeddings().weight.mul_(0.3)
    return base, read_checkpoint(random_draft(base, str(tmp_path_factory.mktemp("d")), seed=2))


@pytest.fixture(scope="module")
def eagle3_checkpoint(checkpoint, tmp_path_factory):
    """An EAGLE-3 head over the same base whose draft vocabulary is 6 of the 8 ids (d2t maps them)."""
    base, _ = checkpoint
    return base, read_checkpoint(random_draft(base, str(tmp_path_factory.mktemp("d3")), eagle3=True, draft_vocab=6, seed=2))


@pytest.fixture(scope="module")
def model(checkpoint):
    return make_model(checkpoint)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(1.0), SamplingParams(0.8, top_p=0.9, top_k=5)],
    ids=["T1", "T0.8-top_p0.9-top_k5"],
)
def test_sampled_tokens_follow_the_base_distribution(model, params):
    assert_follows_base_distribution(model, params)


def test_sampling_with_a_bfloat16_head_under_a_float32_base_follows_the_base_distribution(checkpoint):
    model = make_model(checkpoint, torch.bfloat16)
    assert model.ea_layer.fc.weight.dtype == torch.bfloat16 and model.base.dtype == torch.float32
    assert_follows_base_distribution(model, SamplingParams(1.0))


def test_sampling_with_an_eagle3_head_and_a_reduced_draft_vocabulary_follows_the_base_distribution(eagle3_checkpoint):
    model = make_model(eagle3_checkpoint)
    assert model.use_eagle3 and model.ea_layer.config.draft_vocab_size == 6
    assert_follows_base_distribution(model, SamplingParams(1.0))


@pytest.mark.parametrize("tree_choices", [None, [[0], [1], [0, 0], [1, 0], [0, 0, 0]]], ids=["dynamic", "static"])
def test_sampling_with_batched_draws_follows_the_base_distribution(checkpoint, tree_choices):
    """The GPU's way (`RuntimeConfig.batched_draws`: one draw for every tree node at once), chosen on this CPU."""
    model = make_model(checkpoint, **({"tree_choices": tree_choices} if tree_choices else {}))
    model.runtime = replace(model.runtime, batched_draws=True)
    assert_follows_base_distribution(model, SamplingParams(0.8, top_p=0.9, top_k=5))


def test_sampling_on_the_static_tree_follows_the_base_distribution(checkpoint):
    model = make_model(checkpoint, tree_choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert model.tree.choices is not None
    assert_follows_base_distribution(model, SamplingParams(0.8, top_k=5))


def test_sampling_with_context_drafts_follows_the_base_distribution(checkpoint):
    model = make_model(checkpoint)
    model.context_stats = ContextStats(always=True)  # a chain wherever the text so far has a match
    assert_follows_base_distribution(model, SamplingParams(1.0), context_drafts=True)
    torch.manual_seed(1)
    copies = sum(r.context for _ in range(200) for r in model.stream(
        torch.tensor([PROMPT]), temperature=1.0, max_new_tokens=16, stop_token_ids=[], context_drafts=True))
    assert copies >= 20, "context drafts were hardly accepted: the distribution check saw little of them"


def test_the_distribution_check_catches_a_lossy_verifier(model, monkeypatch):
    """A verifier that always accepts the first drafted child is lossy: the same check must reject it."""

    def accept_first_child(tree, logits, picker):
        tree = tree.read()[0] if isinstance(tree, TreeDraft) else tree
        path, node = [0], 0
        while tree.children[node]:
            node = min(tree.children[node].values())
            path.append(node)
        return tree, path, picker.node_picker(logits)(node)

    monkeypatch.setattr(generate, "accept", accept_first_child)
    params = SamplingParams(1.0)
    counts = sample_pairs(model, params, n=300, seed=0)
    assert chi_square_p_value(counts, exact_pair_distribution(model, params)) < P_VALUE


def test_the_exponential_race_draws_each_token_with_its_probability():
    """The batched draw of the CUDA path (no host sync): each row's token x comes with probability p(x), tokens
    of probability 0 never; the same check rejects a race run the wrong way round (argmax p * E)."""
    from eagle.decoding.verify import exponential_race

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 12, generator=g) * 1.5, -1)
    probs[:, :3] = 0  # filtered out (top-k / top-p)
    probs /= probs.sum(-1, keepdim=True)
    n = 20000
    draws = torch.stack([exponential_race(probs, g) for _ in range(n)])  # [n, 3]
    for row in range(3):
        counts = torch.bincount(draws[:, row], minlength=12)
        assert counts[:3].sum() == 0
        assert chi_square_p_value(counts, probs[row]) > P_VALUE
    wrong = torch.stack([(probs * torch.empty_like(probs).exponential_(generator=g)).argmax(-1) for _ in range(n)])
    assert chi_square_p_value(torch.bincount(wrong[:, 0], minlength=12), probs[0]) < P_VALUE
