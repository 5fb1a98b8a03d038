"""The lossless checks the decoding tests share (no tests here): greedy output against transformers' greedy
`generate` on PROMPTS, and sampled output against the base's exact distribution of two tokens, on a base of
VOCAB tokens after PROMPT."""

import torch

from eagle.decoding.generate import TreeSpec
from eagle.decoding.verify import SamplingParams, TokenPicker
from eagle.model.ea_model import EaModel, load_head

# ---------------------------------------------------------------------------------------------------- greedy
PROMPTS = [[3, 4, 5], [7, 2, 9, 9, 11, 4, 2], [15, 14, 13, 12, 6]]
NEW = 48

FITS = TreeSpec(total_token=8, depth=3, top_k=4)  # verified in an 8-row graph, drafted in a 4-row one
# the default tree (60 nodes, width 10) verifies and drafts eagerly around the graphs of vanilla-size buckets
GRAPH_TREES = {"fits": FITS, "static": TreeSpec(choices=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
               "default": TreeSpec()}  # fmt: skip


def assert_every_tree_equals_generate(model, base) -> None:
    """Greedy EAGLE equals greedy `generate` on every prompt with each of GRAPH_TREES, and some drafts were
    accepted."""
    new_tokens = forwards = 0
    for name, tree in GRAPH_TREES.items():
        model.tree = tree
        n, f = _assert_equal(model, base, name)
        new_tokens, forwards = new_tokens + n, forwards + f
    assert new_tokens / forwards > 1.05, "no drafted token was accepted: the trees were not exercised"


def assert_vanilla_equals_generate(model, base) -> None:
    ids = torch.tensor([PROMPTS[1]])
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                        min_new_tokens=32, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert model.naivegenerate(ids, max_new_tokens=32, stop_token_ids=[]).tolist() == ref.tolist()


def _assert_equal(model, base, name):
    new_tokens = rounds = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                            min_new_tokens=40, eos_token_id=None, pad_token_id=0)  # fmt: skip
        out, n, r = model.eagenerate(ids, max_new_tokens=40, stop_token_ids=[], log=True)
        assert out.tolist() == ref.tolist(), f"{name} tree diverged from greedy generate"
        new_tokens, rounds = new_tokens + n, rounds + r + 1
    return new_tokens, rounds


# -------------------------------------------------------------------------------------------------- sampling
VOCAB = 8
PROMPT = [3, 4, 5]
P_VALUE = 1e-3  # fixed seeds make the test deterministic; a correct sampler passes at this level


def make_model(checkpoint, head_dtype=None, **tree):
    base, (config, state) = checkpoint
    tree = tree or dict(total_token=16, depth=3, top_k=4)
    return EaModel(base, load_head(base, config, state, dtype=head_dtype), None, **tree)


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


def sample_pairs(model, params: SamplingParams, n: int, seed: int, **kw) -> torch.Tensor:
    """kw: more keywords of eagenerate (e.g. context_drafts)."""
    torch.manual_seed(seed)
    counts, forwards = torch.zeros(VOCAB, VOCAB), 0
    for _ in range(n):
        out, _, rounds = model.eagenerate(torch.tensor([PROMPT]), params.temperature, params.top_p, params.top_k,
                                          max_new_tokens=3, stop_token_ids=[], log=True, **kw)  # fmt: skip
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


def assert_follows_base_distribution(model, params, **kw):
    """kw: more keywords of eagenerate (e.g. context_drafts)."""
    probs = exact_pair_distribution(model, params)
    counts = sample_pairs(model, params, n=1500, seed=0, **kw)
    n = counts.sum()
    tv = 0.5 * (counts / n - probs).abs().sum()
    # Total variation that sampling noise alone gives on average: 1/2 sum_i E|p_hat_i - p_i|.
    tv_noise = 0.5 * (2 * probs * (1 - probs) / (torch.pi * n)).sqrt().sum()
    p = chi_square_p_value(counts, probs)
    assert p > P_VALUE, f"EAGLE sampling deviates from the base distribution (p={p:.2e}, TV={tv:.3f})"
    assert tv < 1.5 * tv_noise, f"TV {tv:.3f} is beyond sampling noise ({tv_noise:.3f})"
    # 1.0 = nothing accepted; 1.5 = the first verification always served both tokens.
    assert sample_pairs.tokens_per_forward > 1.1, "drafts were hardly accepted: the test would not see a bias"
