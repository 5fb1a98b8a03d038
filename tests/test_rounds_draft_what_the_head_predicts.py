"""Greedy rounds draft exactly what the head predicts on the text they produce: a round that starts with the base
cache holding tokens 0..c-1 (the root, token c, pending) drafts, at depth k + 1, the head's chain step k from
position c - 1 of the training-time test (`eagle.train.ttt.unrolled_forward`: the base's features of the final text,
the real tokens before each step). Compared for every draft up to and including the first the base rejected (past
it, the round drafts from its own guesses, which the text does not hold). A round that drafted from a wrong head
state (a draft cache that kept a rejected node's row, a commit at the wrong position) would still be lossless, and
only slower: this is what catches it (checked: a draft step that hides the last committed row from the head fails
it, and the lossless tests pass)."""

import pytest
import torch
from lossless_checks import PROMPTS
from tiny import random_draft, save_base, tiny_base

from eagle.decoding.generate import TreeSpec
from eagle.model.ea_model import EaModel
from eagle.runtime import round_graphs
from eagle.train.ttt import unrolled_forward

DRAFTS = 5  # a chain: top_k 1, one draft per depth


@pytest.mark.parametrize("eagle3", [True, False], ids=["eagle3", "eagle12"])
def test_each_greedy_round_drafts_the_heads_chain_on_the_final_text(tmp_path, monkeypatch, eagle3):
    base = tiny_base("llama")
    save_base(base, str(tmp_path / "base"))
    # seed 5: a random head whose drafts this base takes often (127 EAGLE-3, 24 EAGLE-1/2), so deep steps are compared
    draft = random_draft(base, str(tmp_path / "draft"), eagle3=eagle3, draft_vocab=12 if eagle3 else None, seed=5)
    model = EaModel.from_pretrained(str(tmp_path / "base"), draft, dtype=torch.float32)
    drafted = []  # per round: the chain's tokens, root first
    draft_step = round_graphs.EagerRound.draft

    def recording(self, *args, **kw):
        tree = draft_step(self, *args, **kw)
        drafted.append(tree.tokens.tolist())
        return tree

    monkeypatch.setattr(round_graphs.EagerRound, "draft", recording)
    accepted = compared = starts = 0
    for prompt in PROMPTS:
        drafted.clear()
        rounds = list(model.stream(torch.tensor([prompt]), max_new_tokens=64, max_length=128, stop_token_ids=(),
                                   tree=TreeSpec(DRAFTS + 1, DRAFTS, 1)))  # fmt: skip
        assert len(drafted) == len(rounds) - 1  # the first round is the prefill's
        text = prompt + [t for r in rounds for t in r.tokens]
        predicted = chain_on(model, text)  # [DRAFTS, T]
        c = len(prompt)  # tokens in the base cache when a round starts
        for tokens, r in zip(drafted, rounds[1:]):
            checked = min(r.accepted + 1, DRAFTS)  # the accepted drafts and the first rejected one
            want = [int(predicted[k, c - 1]) for k in range(checked)]
            assert tokens[1 : 1 + checked] == want, (prompt, c, tokens, want, r.accepted)
            compared, starts, accepted, c = compared + checked, starts + 1, accepted + r.accepted, c + r.accepted + 1
    assert accepted >= 10 and compared > starts, (accepted, compared, starts)  # deeper steps were compared too


def chain_on(model, text: list[int]) -> torch.Tensor:
    """[DRAFTS, T] target ids: the head's chain step k from position j on `text`, from the base's features of it."""
    ids = torch.tensor([text])
    head = model.ea_layer
    with model.base.leased_cache(len(text) + 1) as cache, torch.inference_mode():
        _, features = model.base.forward(ids, torch.arange(len(text))[None], cache, features=True)  # [T, F]
        steps = unrolled_forward(head, model.base_model.get_input_embeddings(), features[None], ids, DRAFTS)
        return torch.stack([head.to_target_ids(head.logits(s[0], model.base.lm_head).argmax(-1)) for s in steps])
