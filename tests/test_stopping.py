"""Stops (stop tokens, max_new_tokens, max_length), the typed stream, and the log=True counters."""

import itertools

import pytest
import torch
from tiny import random_draft, tiny_base

from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import read_checkpoint

PROMPT = torch.tensor([[5, 3, 9, 2]])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    base = tiny_base("llama", seed=7)
    config, state = read_checkpoint(random_draft(base, str(tmp_path_factory.mktemp("d"))))
    return EaModel(base, load_head(base, config, state), None)


def test_no_token_after_a_stop_token_even_mid_round(model):
    vanilla = model.naivegenerate(PROMPT, max_new_tokens=40, stop_token_ids=[])[0, 4:].tolist()
    rounds = list(model.stream(PROMPT, max_new_tokens=40, stop_token_ids=[]))
    # Pick as stop a token that EAGLE emits inside a multi-token round (not as its last token).
    inner = [r.tokens[i] for r in rounds if len(r.tokens) > 1 for i in range(len(r.tokens) - 1)]
    assert inner, "no multi-token round: acceptance did not happen"
    stop = inner[0]
    out = model.eagenerate(PROMPT, max_new_tokens=40, stop_token_ids=[stop])[0, 4:].tolist()
    assert out == vanilla[: vanilla.index(stop) + 1]


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_exactly_max_new_tokens_are_returned(model, n):
    out, new_tokens, _ = model.eagenerate(PROMPT, max_new_tokens=n, stop_token_ids=[], log=True)
    assert out.shape[1] == 4 + n == 4 + new_tokens
    assert model.naivegenerate(PROMPT, max_new_tokens=n, stop_token_ids=[]).shape[1] == 4 + n


def test_max_length_caps_prompt_plus_new_tokens(model):
    rounds = list(model.stream(PROMPT, max_new_tokens=100, max_length=23, stop_token_ids=[]))
    assert sum(len(r.tokens) for r in rounds) == 19
    assert rounds[-1].stop == "max_length" and all(r.stop is None for r in rounds[:-1])


def test_rounds_report_drafted_and_base_tokens(model):
    rounds = list(model.stream(PROMPT, max_new_tokens=30, stop_token_ids=[]))
    assert rounds[0].accepted == 0 and len(rounds[0].tokens) == 1  # prefill: the base's own token
    for r in rounds:
        assert r.from_draft == [True] * r.accepted + [False] * (len(r.tokens) - r.accepted)
        assert r.seconds > 0
    assert rounds[-1].stop == "max_new_tokens"
    ids = list(model.ea_generate(PROMPT, max_new_tokens=30, stop_token_ids=[]))
    assert len(ids) == len(rounds) and ids[-1][0, 4:].tolist() == [t for r in rounds for t in r.tokens]


def test_log_gives_tokens_per_base_forward(model):
    _, new_tokens, rounds = model.eagenerate(PROMPT, max_new_tokens=30, stop_token_ids=[], log=True)
    forwards = len(list(model.stream(PROMPT, max_new_tokens=30, stop_token_ids=[])))  # prefill + verifications
    assert rounds + 1 == forwards and new_tokens == 30
    _, n, r = model.naivegenerate(PROMPT, max_new_tokens=30, stop_token_ids=[], log=True)
    assert n / (r + 1) == 1.0


def test_interleaved_streams_do_not_share_state(model):
    other = torch.tensor([[9, 9, 4]])
    expected_a = model.eagenerate(PROMPT, max_new_tokens=20, stop_token_ids=[])[0, 4:].tolist()
    expected_b = model.eagenerate(other, max_new_tokens=20, stop_token_ids=[])[0, 3:].tolist()
    a = model.stream(PROMPT, max_new_tokens=20, stop_token_ids=[])
    b = model.stream(other, max_new_tokens=20, stop_token_ids=[])
    got_a, got_b = [], []
    for ra, rb in itertools.zip_longest(a, b):  # alternate rounds of the two generations
        got_a += ra.tokens if ra else []
        got_b += rb.tokens if rb else []
    assert (got_a, got_b) == (expected_a, expected_b)
