"""eagle/train/batch_generate.py: batched greedy output equals transformers' generate on each prompt alone (left
pads, positions, stop ids, KV buckets), sampling follows softmax(logits / T), results come back in order."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_base

from eagle.train.batch_generate import BatchDecoder, batches_by_length, generate_all, generate_batch

VOCAB = 64
NEW = 24


def _sharp_base(**kw):
    """tiny_base with q/k weights x16: random-init attention is near uniform, blind to positions; this one is not
    (a position off by one moves logits by ~0.5, a logit's spread)."""
    model = tiny_base(**kw)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(16.0)
            layer.self_attn.k_proj.weight.mul_(16.0)
    return model


@pytest.fixture(scope="module")
def model():
    return _sharp_base(vocab=VOCAB, layers=3, seed=0)


def _prompts(lengths, vocab=VOCAB, seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model, prompt: list[int], new: int, stop: int | None = None) -> list[int]:
    """transformers' greedy generate on one prompt alone (no padding), stopping after `stop`."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         eos_token_id=stop, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _stop_for_some(references: list[list[int]]) -> int:
    """A token that some rows emit after their first token and others never: stopping at it cuts some rows only."""
    for t in range(VOCAB):
        hits = [t in ref[1:] and t != ref[0] for ref in references]
        if any(hits) and not all(t in ref for ref in references):
            return t
    raise AssertionError("no token stops some rows only: pick other prompts")


def test_greedy_equals_hf_alone_with_left_pads_and_stop(model):
    prompts = _prompts([3, 9, 5, 12, 1])  # widths differ: every row but the longest is left-padded
    alone = [_hf_greedy(model, p, NEW) for p in prompts]
    assert all(len(set(a)) >= 4 for a in alone)  # replies that depend on more than the last token
    assert generate_batch(model, prompts, NEW, set()) == alone
    stop = _stop_for_some(alone)
    expected = [_hf_greedy(model, p, NEW, stop) for p in prompts]
    assert any(len(e) < NEW for e in expected) and any(len(e) == NEW for e in expected)
    assert all(e[-1] == stop for e in expected if len(e) < NEW)
    assert generate_batch(model, prompts, NEW, {stop}) == expected


def test_bucket_crossing(model):
    """A bucket of 4 columns: the live width crosses a boundary every 4 steps, each crossing a new width."""
    prompts = _prompts([6, 2, 10], seed=2)
    decoder = BatchDecoder(model, rows=len(prompts), capacity=10 + NEW, bucket=4, capture=False)
    out = decoder.generate(prompts, NEW, set())
    widths = sorted({width for width, _ in decoder.graphs})
    assert widths == list(range(12, 37, 4))  # steps write columns 10 .. 32 and read up to 11 .. 33 of them
    assert out == [_hf_greedy(model, p, NEW) for p in prompts]
    # the decoder serves a second, narrower batch on the same cache (stale columns of the first are masked)
    again = _prompts([4, 7], seed=3)
    assert decoder.generate(again, 10, set()) == [_hf_greedy(model, p, 10) for p in again]


def test_stops_reading_early_once_every_row_is_done(model):
    """Every id a stop id: each row ends at its first token and the decoder runs no step (the host checks)."""
    prompts = _prompts([3, 7], seed=11)
    decoder = BatchDecoder(model, rows=2, capacity=7 + NEW, capture=False)
    out = decoder.generate(prompts, NEW, set(range(VOCAB)))
    assert out == [_hf_greedy(model, p, 1) for p in prompts]
    assert int(decoder.n) == 1 and not decoder.graphs


def test_sampling_is_reproducible(model):
    prompts = _prompts([4, 8, 2], seed=4)
    first = generate_batch(model, prompts, NEW, set(), temperature=1.0, seed=7)
    assert generate_batch(model, prompts, NEW, set(), temperature=1.0, seed=7) == first
    assert generate_batch(model, prompts, NEW, set(), temperature=1.0, seed=8) != first


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_tokens_follow_softmax(temperature):
    """4096 rows of one prompt: the first token's frequencies against softmax(logits / T) of the prompt, the
    second's against the mixture over first tokens t of p(t) * softmax(logits(prompt + t) / T) (a decode step)."""
    vocab, rows = 32, 4096
    model = _sharp_base(vocab=vocab, layers=2, seed=5)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2.0)  # T = 0.5 vs 1: total variation 0.2 at the first token
    prompt = _prompts([5], vocab=vocab, seed=6)[0]
    out = generate_batch(model, [prompt] * rows, 2, set(), temperature=temperature, seed=0)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)  # [V]
        seconds = torch.tensor([prompt + [t] for t in range(vocab)])  # [V, T + 1]
        second = first @ torch.softmax(model(seconds).logits[:, -1] / temperature, -1)  # [V]
    assert first.max() < 0.5  # a sampler stuck on the argmax would be far (total variation > 0.5)
    for column, expected in ((0, first), (1, second)):
        counts = torch.bincount(torch.tensor([o[column] for o in out]), minlength=vocab).double()
        total_variation = 0.5 * (counts / rows - expected.double()).abs().sum()
        assert total_variation < 0.08  # ~0.03 expected from 4096 draws


def test_generate_all_keeps_the_order(model):
    prompts = _prompts([5, 1, 11, 3, 8, 2, 6], seed=9)
    batches = batches_by_length(prompts, 3)
    assert sorted(i for b in batches for i in b) == list(range(len(prompts)))
    lengths = [len(prompts[i]) for b in batches for i in b]
    assert lengths == sorted(lengths, reverse=True)
    out = generate_all(model, prompts, batch_size=3, max_new_tokens=12, stop_ids=set(), bucket=8)
    assert out == [_hf_greedy(model, p, 12) for p in prompts]


def test_refuses_other_rope_types():
    with pytest.raises(ValueError, match="llama3"):
        generate_batch(tiny_base("llama31", vocab=VOCAB, layers=1), [[1, 2]], 2, set())


@pytest.mark.gpu
def test_cuda_graphs_equal_eager_steps():
    model = tiny_base(vocab=VOCAB, layers=3, seed=0).cuda()
    prompts = _prompts([3, 9, 5, 12], seed=10)
    for temperature in (0.0, 1.0):
        runs = [generate_all(model, prompts, 3, NEW, {1}, temperature, seed=3, capture=c, bucket=8)
                for c in (False, True)]  # fmt: skip
        assert runs[0] == runs[1]
