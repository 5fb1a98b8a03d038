"""The trees tool (eagle/evaluation/trees.py) on a tiny model: every tree decodes vanilla's tokens, the round
runner's calls are timed apart and unwrapped afterwards, and the table adds up."""

import torch
from tiny import random_draft, save_base, tiny_base

from eagle.decoding.generate import TreeSpec
from eagle.evaluation import trees
from eagle.model.ea_model import EaModel
from eagle.runtime import round_graphs


def test_trees_race_vanilla_on_the_same_tokens_and_time_the_runners_calls(tmp_path):
    base = tiny_base("llama")
    save_base(base, str(tmp_path / "base"))
    head = random_draft(base, str(tmp_path / "head"), eagle3=True)
    model = EaModel.from_pretrained(str(tmp_path / "base"), head, dtype=torch.float32, total_token=8, depth=3,
                                    top_k=2)  # fmt: skip
    originals = {n: round_graphs.EagerRound.__dict__[n] for n in trees.CALLS}
    shapes = [TreeSpec(2, 1, 1), TreeSpec(4, 2, 2)]
    prompts = [[1, 5, 9, 14, 3, 7], [1, 3, 12, 4, 8]]
    (totals,) = trees.race(model, prompts, shapes, max_new_tokens=12, passes=1)
    assert model.tree == TreeSpec(8, 3, 2)  # the tree in use is restored
    assert {n: round_graphs.EagerRound.__dict__[n] for n in trees.CALLS} == originals  # unwrapped
    v = totals["vanilla"]
    assert 2 <= v["new"] == v["rounds"] <= 2 * 11  # up to 12 tokens a prompt (a stop token ends one), 1 a round
    for shape in shapes:
        t = totals[trees.name(shape)]
        assert t["identical"] == 2 and t["new"] == v["new"]
        assert 1 <= t["rounds"] <= v["rounds"]
        assert set(t["calls"]) == set(trees.CALLS) and sum(t["calls"].values()) < t["seconds"]
    text = trees.table(totals, len(prompts))
    assert text.count("\n") == 6 and text.startswith("a vanilla step: ") and "| 2/1/1 |" in text and "| 2/2 |" in text
