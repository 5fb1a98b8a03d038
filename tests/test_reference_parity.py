"""Parity with the reference implementation (SafeAILab/EAGLE) on tiny random weights.

tests/fixtures/reference_parity/ holds a tiny Llama base and an EAGLE-1/2 and an EAGLE-3 draft in the reference's
layouts, and goldens.json: what the reference's own code drafted, verified and accepted on them in two greedy
rounds (make_goldens.py and README.md there say how). Here the same files are loaded through
`EaModel.from_pretrained` and decoded by this project's engine; a spy on the drafter and on verification records
each round's tree and accepted path, which must be the reference's, node for node.

The trees compare directly: both order nodes the same way (the pool of candidates in drafting order, the chosen
ones sorted by pool index, root first). The reference returns a float mask, depths and leaf paths
(`retrieve_indices`); our `DraftTree` holds parents, from which the mask, the depths and the leaf paths (leaves in
node order, each path root first, padded with -1) are derived and compared to the reference's.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import eagle.decoding.generate as generate
from eagle.decoding.draft import Drafter
from eagle.decoding.generate import TreeSpec
from eagle.decoding.tree import TreeDraft
from eagle.model.ea_model import EaModel
from eagle.runtime.round_graphs import EagerRound

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "reference_parity")
with open(os.path.join(FIXTURES, "goldens.json")) as f:
    GOLDENS = json.load(f)
CASES = sorted(GOLDENS["cases"])  # "eagle3-60-7-10": format, total_token, depth, top_k


def leaf_paths(parents: list[int], depths: list[int]) -> list[list[int]]:
    """The reference's retrieve_indices from parents: one row per leaf in node order, root..leaf, -1 padded."""
    inner = set(parents[1:])
    width = max(depths) + 1
    rows = []
    for node in range(len(parents)):
        if node in inner:
            continue
        path = [node]
        while path[-1] != 0:
            path.append(parents[path[-1]])
        rows.append(path[::-1] + [-1] * (width - len(path)))
    return rows


def mask_rows(mask: torch.Tensor) -> list[str]:
    return ["".join("1" if v else "0" for v in row) for row in mask.tolist()]


@pytest.fixture(scope="module")
def models():
    loaded = {}
    for fmt in ("eagle2", "eagle3"):
        loaded[fmt] = EaModel.from_pretrained(
            base_model_path=os.path.join(FIXTURES, "base"), ea_model_path=os.path.join(FIXTURES, f"draft_{fmt}")
        )
        assert loaded[fmt].use_eagle3 == (fmt == "eagle3")  # detected from the checkpoint's keys
    return loaded


@pytest.fixture(scope="module", params=["two_step", "general"])
def runs(models, request):
    """Per case: the first token, and per round the drafted tree, the accepted path and the round's tokens; on the
    round in two steps (round_steps.py, what greedy dynamic trees run) or on the general loop (eagle_rounds)."""
    results = {}
    mp = pytest.MonkeyPatch()
    trees, paths = [], []
    dynamic_tree, accept = Drafter.dynamic_tree, generate.accept
    draft_step, verify_step = EagerRound.draft, EagerRound.verify

    def spy_tree(self, *args, **kwargs):
        draft = dynamic_tree(self, *args, **kwargs)
        trees.append(draft.read()[0])
        return draft

    def spy_accept(tree, logits, picker):
        tree, path, token = accept(tree, logits, picker)
        paths.append(path)
        return tree, path, token

    def spy_draft_step(self, *args, **kwargs):
        tree = draft_step(self, *args, **kwargs)
        trees.append(TreeDraft(*tree).read()[0])
        return tree

    def spy_verify_step(self, *args):
        verdict = verify_step(self, *args)
        paths.append(verdict.path[: int(verdict.length)].tolist())
        return verdict

    if request.param == "general":
        mp.setattr(Drafter, "dynamic_tree", spy_tree)
        mp.setattr(generate, "accept", spy_accept)
        for model in models.values():
            mp.setattr(model, "round_runner", lambda *a: None)
    else:
        mp.setattr(EagerRound, "draft", spy_draft_step)
        mp.setattr(EagerRound, "verify", spy_verify_step)
    try:
        for name in CASES:
            case = GOLDENS["cases"][name]
            trees.clear(), paths.clear()
            if request.param == "two_step":
                paths.append([0])  # the prefill's root-only pick, which the general loop's accept records
            tree = TreeSpec(case["total_token"], case["depth"], case["top_k"])
            stream = models[case["format"]].stream(GOLDENS["prompt"], tree=tree, stop_token_ids=(), max_new_tokens=100)
            rounds = [next(stream) for _ in range(3)]  # the prefill's token, then two verification rounds
            stream.close()
            # paths[0] is the prefill's root-only pick; paths[1:] follow the two drafted trees
            results[name] = {"first": rounds[0].tokens, "trees": trees[:2], "paths": paths[1:3], "rounds": rounds[1:]}
    finally:
        mp.undo()
    return results


def check_tree(tree, golden) -> None:
    assert tree.tokens[0] == golden["root"], "root (the base's last token)"
    assert tree.tokens == golden["draft_tokens"], "drafted token ids, in node order"
    assert tree.parents == golden["parents"], "parent of each node"
    assert tree.depth == golden["tree_position_ids"], "depth of each node (the reference's tree_position_ids)"
    assert mask_rows(tree.ancestor_mask()) == golden["tree_mask"], "tree attention mask"
    assert leaf_paths(tree.parents, tree.depth) == golden["retrieve_indices"], "leaf paths (retrieve_indices)"


@pytest.mark.parametrize("name", CASES)
def test_prefill_picks_the_reference_first_token(runs, name):
    assert runs[name]["first"] == [GOLDENS["cases"][name]["first_token"]]


@pytest.mark.parametrize("name", CASES)
def test_first_round_draft_tree_matches_the_reference(runs, name):
    check_tree(runs[name]["trees"][0], GOLDENS["cases"][name]["rounds"][0])


@pytest.mark.parametrize("name", CASES)
def test_second_round_draft_tree_from_the_continued_draft_cache_matches_the_reference(runs, name):
    check_tree(runs[name]["trees"][1], GOLDENS["cases"][name]["rounds"][1])


@pytest.mark.parametrize("name", CASES)
def test_greedy_verification_accepts_the_reference_path_and_tokens(runs, name):
    for r, (path, got, golden) in enumerate(zip(runs[name]["paths"], runs[name]["rounds"], GOLDENS["cases"][name]["rounds"])):
        assert path == golden["accepted_path"], f"round {r + 1}: accepted tree nodes"
        assert got.tokens == golden["accepted_tokens"] + [golden["next_token"]], f"round {r + 1}: tokens"
        assert got.accepted == golden["accept_length"], f"round {r + 1}: accepted drafted tokens"


def test_goldens_exercise_acceptance_and_deep_trees():
    """The fixture is only as strong as what it covers: every case accepts a drafted token in round 1 (so round 2
    drafts from a draft cache that took in more than the root), trees go deeper than two levels, and the
    reference's choices were the same in float64 (no recorded choice hangs on a float32 rounding)."""
    for name in CASES:
        case = GOLDENS["cases"][name]
        assert case["rounds"][0]["accept_length"] >= 1, name
        assert all(max(r["tree_position_ids"]) >= 4 for r in case["rounds"]), name
        assert all(len(r["draft_tokens"]) == case["total_token"] for r in case["rounds"]), name
        assert case["float64_agrees"], name
