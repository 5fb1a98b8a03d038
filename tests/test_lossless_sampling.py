"""Sampled EAGLE output has exactly the base model's distribution (temperature, top-p, top-k)."""

import pytest
import torch
from tiny import random_draft, tiny_base

import eagle.model.generate as generate
from eagle.model.checkpoint import read_checkpoint
from eagle.model.ea_model import EaModel, load_head
from eagle.model.tree import TreeDraft
from eagle.model.verify import SamplingParams, TokenPicker

VOCAB = 8
PROMPT = [3, 4, 5]
P_VALUE = 1e-3  # fixed seeds make the test deterministic; a correct sampler passes at this level


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


def make_model(checkpoint, head_dtype=None, **tree):
    base, (config, state) = checkpoint
    tree = tree or dict(total_token=16, depth=3, top_k=4)
    return EaModel(base, load_head(base, config, state, dtype=head_dtype), None, **tree)


@pytest.fixture(scope="module")
def model(checkpoint):
    return make_model(checkpoint)


def exact_pair_distribution(model, params: SamplingParams) -> torch.Tensor:
    """[V, V] probability of the 2nd and 3rd generated tokens under plain sampling from the base."""
    picker, base = TokenPicker(params), model.base_model
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        p1 = picker.probs(base(prompt).logits[:, -1])[0]  # [V]
        seq2 = torch.cat([prompt.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], 1)  # [V, 4]
        p2 = picker.probs(base(seq2).logits[:, -1])  # [V(x1), V(x2)]
        seq3 = torch.cat([seq2.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], 1)
        p3 = picker.probs(base(seq3).logits[:, -1]).view(VOCAB, VOCAB, VOCAB)  # [x1, x2, x3]
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # [x2, x3]


def sample_pairs(model, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    counts, forwards = torch.zeros(VOCAB, VOCAB), 0
    for _ in range(n):
        out, _, rounds = model.eagenerate(torch.tensor([PROMPT]), params.temperature, params.top_p, params.top_k,
                                          max_new_tokens=3, stop_token_ids=[], log=True)  # fmt: skip
        x2, x3 = out[0, len(PROMPT) + 1 :].tolist()
        counts[x2, x3] += 1
        forwards += rounds + 1
    sample_pairs.tokens_per_forward = 3 * n / forwards
    return counts


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; bins with expected count < 5 are pooled into one."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


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


def test_sampling_on_the_static_tree_follows_the_base_distribution(checkpoint):
    model = make_model(checkpoint, tree_choices=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert model.tree.choices is not None
    assert_follows_base_distribution(model, SamplingParams(0.8, top_k=5))


def assert_follows_base_distribution(model, params):
    probs = exact_pair_distribution(model, params)
    counts = sample_pairs(model, params, n=1500, seed=0)
    n = counts.sum()
    tv = 0.5 * (counts / n - probs).abs().sum()
    # Total variation that sampling noise alone gives on average: 1/2 sum_i E|p_hat_i - p_i|.
    tv_noise = 0.5 * (2 * probs * (1 - probs) / (torch.pi * n)).sqrt().sum()
    p = chi_square_p_value(counts, probs)
    assert p > P_VALUE, f"EAGLE sampling deviates from the base distribution (p={p:.2e}, TV={tv:.3f})"
    assert tv < 1.5 * tv_noise, f"TV {tv:.3f} is beyond sampling noise ({tv_noise:.3f})"
    # 1.0 = nothing accepted; 1.5 = the first verification always served both tokens.
    assert sample_pairs.tokens_per_forward > 1.1, "drafts were hardly accepted: the test would not see a bias"


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
