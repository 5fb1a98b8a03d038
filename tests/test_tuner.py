"""The tree tuner: expected accepted length from an acceptance profile (against a simulation), the pick (against
a hand computation and cost shapes), the per-machine/model/head cost cache, and `total_token=-1` end to end."""

import json
import os
import random

import pytest
import torch
from tiny import random_draft, save_base, tiny_base

from eagle.kernels import few_rows
from eagle.model.ea_model import EaModel
from eagle.tuning import cost_cache, tuner
from eagle.tuning.tuner import expected_tau, pick_tree


def _simulated_tau(accept, total_token, depth, top_k, rounds=40000, seed=0):
    """Monte Carlo: each level's base token is rank r with probability accept[level][r] (else none of the draft's);
    the round accepts drafts while the base's token is a verified node. Nodes are the ones `expected_tau` keeps."""
    levels = min(depth, total_token - 2) + 1
    nodes, frontier = [], [((), 1.0)]  # (rank path, chance)
    for level in range(min(levels, len(accept))):
        cands = sorted(((path + (r,), c * accept[level][r]) for path, c in frontier for r in range(top_k)),
                       key=lambda x: -x[1])  # fmt: skip
        nodes += cands
        frontier = cands[:top_k]
    kept = {path for path, _ in sorted(nodes, key=lambda x: -x[1])[: total_token - 1]}
    rng, total = random.Random(seed), 0
    for _ in range(rounds):
        path = ()
        for level in range(len(accept)):
            u, r = rng.random(), 0
            while r < len(accept[level]) and u >= accept[level][r]:
                u -= accept[level][r]
                r += 1
            if r == len(accept[level]) or path + (r,) not in kept:
                break
            path += (r,)
        total += 1 + len(path)
    return total / rounds


@pytest.mark.parametrize("tree", [(4, 3, 3), (8, 4, 2), (16, 5, 4), (60, 7, 10), (2, 7, 10)])
def test_expected_tau_matches_a_simulation_of_the_rounds(tree):
    accept = [[0.55, 0.15, 0.08, 0.05] + [0.01] * 6, *[[0.45, 0.12, 0.06, 0.04] + [0.01] * 6] * 6]
    assert expected_tau(accept, *tree) == pytest.approx(_simulated_tau(accept, *tree), abs=0.02)


def test_expected_tau_by_hand():
    accept = [[0.5, 0.2], [0.5, 0.2]]
    assert expected_tau(accept, 2, 2, 2) == pytest.approx(1.5)  # one node: the root's best child
    assert expected_tau(accept, 4, 2, 2) == pytest.approx(1 + 0.5 + 0.25 + 0.2)
    assert expected_tau(accept, 4, 2, 1) == pytest.approx(1 + 0.5 + 0.25)  # width 1: a chain


def test_pick_follows_the_cost_shape():
    accept = [[0.6, 0.15, 0.05] + [0.02] * 7] * 7
    draft = {(d, k): 0.001 * d * (1 + 0.1 * k) for d in range(1, 8) for k in (1, 2, 3, 4, 6, 8, 10)}
    flat = {n: 0.020 for n in tuner.SIZES}  # a GPU: verifying 60 rows costs what 4 do
    steep = {n: 0.020 * (1 + 0.25 * (n - 1)) for n in tuner.SIZES}  # a small CPU: each row costs a quarter step
    big, small = pick_tree(accept, flat, draft), pick_tree(accept, steep, draft)
    # steep: 3 nodes (a chain of two, 1.96 tokens for 0.0311 s) beat 2 (1.6 for 0.0261) and 4 (1.96 for 0.0372)
    assert big.total_token == 60 and (small.total_token, small.depth, small.top_k) == (3, 1, 1)
    for choice, verify in ((big, flat), (small, steep)):  # the best of the whole grid, and its figures add up
        assert choice.tokens_per_s == max(expected_tau(accept, n, d, k) / (verify[n] + s)
                                          for n in verify for (d, k), s in draft.items())  # fmt: skip
        assert choice.tokens_per_s == pytest.approx(choice.tau / choice.seconds)


def test_the_two_node_tree_is_priced_by_its_draft_phase_without_expansion():
    """A 2-node tree drafts the root's best child and expands nothing: its phase is (0, 1), which prices it alone;
    with deeper phases dearer, a machine whose every verify row costs a lot picks it."""
    accept = [[0.6, 0.15, 0.05]] * 4
    draft = {(0, 1): 0.0005, **{(d, k): 0.003 * d * (1 + 0.1 * k) for d in range(1, 4) for k in (1, 2, 3)}}
    steep = {n: 0.010 * (1 + 0.5 * (n - 1)) for n in tuner.SIZES}  # each row half a step
    choice = pick_tree(accept, steep, draft)
    assert (choice.total_token, choice.depth, choice.top_k) == (2, 1, 1)  # a TreeSpec of depth 1 expands nothing
    assert choice.tau == pytest.approx(1.6) and choice.seconds == pytest.approx(0.015 + 0.0005)
    flat = {n: 0.010 for n in tuner.SIZES}  # the root-only phase never prices a larger tree
    assert pick_tree(accept, flat, draft).total_token > 2
    assert pick_tree(accept, {n: 0.010 for n in (4, 8)}, draft).seconds > 0.010 + 0.0005


def test_verify_sizes_interpolate_the_sizes_a_compiled_forward_pads_into_a_larger_graph():
    from eagle.runtime.compiled import bucket_for

    rows = sorted({1, *tuner.SIZES})
    # compiled graphs of 1/4/8/16 rows: a pass of n rows costs its graph's (padded); past 16 rows, eager
    padded = {n: 0.001 * (bucket_for(n) or n) for n in rows}
    verify = tuner.verify_sizes(padded, bucket_for)
    assert set(verify) == set(tuner.SIZES)  # 1 (the vanilla step) only anchors the line
    assert verify[2] == pytest.approx(0.002) and verify[3] == pytest.approx(0.003)  # between 1 and 4 rows
    assert verify[6] == pytest.approx(0.006) and verify[12] == pytest.approx(0.012)
    assert all(verify[n] == padded[n] for n in (4, 8, 16, 24, 60))  # timed at their own rows
    assert tuner.verify_sizes(padded) == {n: padded[n] for n in tuner.SIZES}  # eager: every size as timed


@pytest.fixture()
def folders(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    base = tiny_base("llama")
    save_base(base, str(tmp_path / "base"))
    head = random_draft(base, str(tmp_path / "head"), eagle3=True)
    profile = {"accept": {"0": [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.5, 0.2, 0.1]]}}
    (tmp_path / "head" / "acceptance.json").write_text(json.dumps(profile))
    return str(tmp_path / "base"), head


def test_total_token_minus_one_tunes_with_the_profile_and_stays_lossless(folders, monkeypatch):
    calls = []
    measure = tuner.draft_seconds
    monkeypatch.setattr(tuner, "draft_seconds", lambda *a, **k: calls.append(1) or measure(*a, **k))
    model = EaModel.from_pretrained(*folders, total_token=-1, dtype=torch.float32)
    c = model.tree_choice
    assert (model.tree.total_token, model.tree.depth, model.tree.top_k) == (c.total_token, c.depth, c.top_k)
    assert c.top_k <= 3 and c.depth <= 3 and c.tokens_per_s > 0
    ids = torch.tensor([[3, 4, 5, 6]])
    ref = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                    min_new_tokens=24)  # fmt: skip
    assert model.eagenerate(ids, max_new_tokens=24, stop_token_ids=[]).tolist() == ref.tolist()
    measured = len(calls)  # one call per draft shape
    EaModel.from_pretrained(*folders, total_token=-1, dtype=torch.float32)  # the same machine, model and head
    assert len(calls) == measured  # costs came from the cache the second time


def test_cost_cache_key_changes_with_machine_model_and_head(folders, monkeypatch):
    model = EaModel.from_pretrained(*folders, dtype=torch.float32)
    key = cost_cache.key(model)
    assert cost_cache.key(model) == key
    model.ea_layer.to(torch.bfloat16)
    assert cost_cache.key(model) != key  # the head's dtype
    model.ea_layer.to(torch.float32)
    model.base_model.config.rms_norm_eps = 1e-3
    assert cost_cache.key(model) != key  # the model
    model.base_model.config.rms_norm_eps = 1e-5
    monkeypatch.setattr(few_rows, "kernels_id", lambda: "linear,wxt;panel_linear.cpp changed")
    assert cost_cache.key(model) != key  # the kernels (a new or changed one is timed again)
    monkeypatch.undo()
    monkeypatch.setattr(cost_cache, "cpu_description", lambda: {"model": "another CPU"})
    assert cost_cache.key(model) != key  # the machine


def test_verify_costs_are_measured_once_for_heads_of_two_dtypes_and_draft_costs_per_dtype(folders, monkeypatch):
    """The base's pass does not depend on the head: its costs are keyed without it, so heads of two dtypes are
    compared on the very same verify timings and the pass is timed once."""
    import copy

    model = EaModel.from_pretrained(*folders, dtype=torch.float32)
    model.draft_options = [(model.ea_layer, None), (copy.deepcopy(model.ea_layer).to(torch.bfloat16), None)]
    verify_calls, draft_dtypes = [], []
    pass_seconds = model.base.pass_seconds
    monkeypatch.setattr(model.base, "pass_seconds", lambda rows: verify_calls.append(1) or pass_seconds(rows))
    monkeypatch.setattr(tuner, "draft_seconds", lambda m, depths, top_ks, head_and_graphs: draft_dtypes.append(
        head_and_graphs[0].dtype_name) or {(d, k): 1e-3 * d * k for d in depths for k in top_ks})  # fmt: skip
    accept = [[0.6, 0.2], [0.5, 0.2], [0.4, 0.2]]
    tuner.tune(model, accept)
    shapes = 1 + len(accept) * len(tuner.TOP_KS)  # the 2-node tree's phase, then every depth and width
    # both dtypes in one sitting, shape by shape in turn
    assert verify_calls == [1] and draft_dtypes == ["float32", "bfloat16"] * shapes
    tuner.tune(model, accept)  # everything from the cache now
    assert verify_calls == [1] and len(draft_dtypes) == 2 * shapes
    verify_key, draft_key = cost_cache.key(model, head=False), cost_cache.key(model)
    (fp32, _), (bf16, _) = model.draft_options
    other = (bf16 if model.ea_layer is fp32 else fp32, None)  # the other head
    assert cost_cache.key(model, head=False, draft=other) == verify_key
    assert cost_cache.key(model, draft=other) != draft_key


def test_draft_dtype_auto_keeps_the_faster_dtype_measured_here(folders, monkeypatch):
    timings = {torch.float32: 0.002, torch.bfloat16: 0.001}
    monkeypatch.setattr(tuner, "draft_seconds", lambda m, *a, head_and_graphs=None, **k: {
        (3, 4): timings[(head_and_graphs or (m.ea_layer,))[0].fc.weight.dtype]})  # fmt: skip

    def head_dtype():
        return EaModel.from_pretrained(*folders, draft_dtype="auto", dtype=torch.float32).ea_layer.fc.weight.dtype

    model = EaModel.from_pretrained(*folders, draft_dtype="auto", dtype=torch.float32)
    assert model.ea_layer.fc.weight.dtype == torch.bfloat16
    assert model.ea_layer.rotary_emb.inv_freq.dtype == torch.float32
    timings[torch.bfloat16] = 0.003  # slower now, but the cached measurement of this machine + model + head holds
    assert head_dtype() == torch.bfloat16
    monkeypatch.setenv("EAGLE_CACHE", str(folders[0]) + "-other-cache")  # a fresh measurement
    assert head_dtype() == torch.float32


def test_no_tree_option_means_tuned_when_the_head_ships_a_profile(folders):
    from eagle.chat.model_types import ModelType, load

    mtype = ModelType("custom", *folders, "chat-template")
    tuned = load(mtype, dtype="float32", log=lambda *a: None).model
    assert tuned.tree_choice is not None
    given = load(mtype, total_token=6, dtype="float32", log=lambda *a: None).model
    assert given.tree_choice is None and given.tree.total_token == 6  # an explicit option wins
    os.remove(os.path.join(folders[1], "acceptance.json"))
    plain = load(mtype, dtype="float32", log=lambda *a: None).model
    assert plain.tree_choice is None and plain.tree.total_token == mtype.cpu_tree[0]


def test_the_shipped_head_carries_a_usable_acceptance_profile():
    from eagle.chat.model_types import DEFAULT_HEAD_DIR
    from eagle.models.checkpoint import read_acceptance_profile

    profile = read_acceptance_profile(str(DEFAULT_HEAD_DIR))
    for key in ("0", "0.7"):
        rows = profile["accept"][key]
        assert len(rows) == 7 and all(len(r) == 10 and 0 < sum(r) <= 1 for r in rows)
        assert all(r[0] >= r[1] >= r[2] for r in rows)  # the draft's ranking is the base's, on average
    assert 1.5 < expected_tau(profile["accept"]["0"], 4, 3, 3) < 2.5


def test_few_row_kernels_auto_takes_the_fastest_kernel_per_row_count_as_timed_here(folders, monkeypatch):
    from eagle.kernels import few_rows
    from eagle.models.base import BaseModel

    def plan(model):
        return few_rows.plan_of(model.base_model)

    ms = {"linear": {1: 1, 2: 2, 4: 4, 8: 8, 16: 16}, "wxt": {1: 3, 2: 1, 4: 3, 8: 9, 16: 9},
          "packed": {1: 5, 2: 5, 4: 5, 8: 5, 16: 5}, "panel": {1: 7, 2: 7, 4: 7, 8: 7, 16: 7}}  # fmt: skip

    def timed(self, rows, *a, **k):
        kernel = few_rows.plan_of(self.model)[1]  # the tuner times one kernel for every row count at a time
        return {n: ms[kernel][n] / 1e3 for n in rows}

    monkeypatch.setattr(BaseModel, "pass_seconds", timed)
    auto = plan(EaModel.from_pretrained(*folders, few_row_kernels="auto", dtype=torch.float32))
    want = {1: "linear", 2: "wxt", 3: "wxt", 4: "wxt"} if few_rows.packed_kernel_available() else None
    if want:
        assert {n: auto[n] for n in (1, 2, 3, 4)} == want
        assert {auto[n] for n in range(5, 17)} == {"packed"}  # 5-8 rows take the 8-row timing, 9-16 the 16-row
    monkeypatch.setenv("EAGLE_CACHE", str(folders[0]) + "-other")  # another machine, where F.linear wins
    ms["wxt"] = ms["packed"] = ms["panel"] = {n: 99 for n in ms["linear"]}
    slow = EaModel.from_pretrained(*folders, few_row_kernels="auto", dtype=torch.float32)
    assert plan(slow) is None  # all F.linear: the layers go back to nn.Linear
    ids = torch.tensor([[3, 4, 5, 6]])
    ref = slow.base_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                                   min_new_tokens=16)  # fmt: skip
    assert slow.eagenerate(ids, max_new_tokens=16, stop_token_ids=[]).tolist() == ref.tolist()
    assert plan(EaModel.from_pretrained(*folders, dtype=torch.float32)) == few_rows.DEFAULT_PLAN  # True: the default
    assert plan(EaModel.from_pretrained(*folders, few_row_kernels=False, dtype=torch.float32)) is None


def test_with_heads_of_two_dtypes_the_tuner_picks_tree_and_dtype_together(folders, monkeypatch):
    """Where compiling left the head in two dtypes (`draft_options`), each dtype's measured costs give its best tree;
    the faster pair is the choice (`option`), which the tuner leaves to the model to put in use (`tune_tree`)."""
    import copy

    model = EaModel.from_pretrained(*folders, dtype=torch.float32)
    fp32 = model.ea_layer
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    model.draft_options = [(bf16, None), (fp32, None)]
    accept = [[0.6, 0.2], [0.5, 0.2], [0.4, 0.2]]
    verify = {4: 0.020, 8: 0.030}
    level_s = {torch.bfloat16: 0.002, torch.float32: 0.004}

    def costs(dtype, depth_max):
        return {(d, k): level_s[dtype] * d * k for d in range(1, depth_max + 1) for k in (1, 2)}

    monkeypatch.setattr(tuner, "verify_costs", lambda m, log: verify)
    monkeypatch.setattr(tuner, "draft_costs", lambda m, options, depth_max, log: [
        costs(head.fc.weight.dtype, depth_max) for head, _ in options])  # fmt: skip
    choice = tuner.tune(model, accept)
    best = pick_tree(accept, verify, costs(torch.bfloat16, 3))
    assert choice.draft_dtype == "bfloat16" and model.draft_options[choice.option][0] is bf16
    assert model.ea_layer is fp32  # tuning measures and returns; it changes nothing
    assert (choice.total_token, choice.depth, choice.top_k, choice.tokens_per_s) == (
        best.total_token, best.depth, best.top_k, best.tokens_per_s)  # fmt: skip
    model.acceptance, model.context_profile = accept, None
    model.tune_tree()
    assert model.ea_layer is bf16 and model.tree.total_token == best.total_token
    level_s[torch.float32] = 0.001  # now float32 drafts faster
    model.tune_tree()
    assert model.tree_choice.draft_dtype == "float32" and model.ea_layer is fp32


def test_verify_costs_are_timed_with_the_row_counts_taking_turns(monkeypatch):
    """A VM's speed drifts within minutes: row counts timed in blocks one after another would carry that drift into
    their ratios, which pick the tree. Each repeat times every row count once, and each call sees the same cache."""
    from eagle.models.base import BaseModel

    base = BaseModel(tiny_base("llama", layers=1), eagle3=False, few_row_plan=False)
    calls, forward = [], base.forward

    def recorded(input_ids, position_ids, cache, **kw):
        if input_ids.shape[1] <= 8:  # not the prefill
            calls.append((input_ids.shape[1], cache.length))
        return forward(input_ids, position_ids, cache, **kw)

    monkeypatch.setattr(base, "forward", recorded)
    seconds = base.pass_seconds([1, 4, 8], context=16, repeats=3)
    assert calls == [(1, 16), (4, 16), (8, 16)] * 4  # an untimed first turn, then three timed ones
    assert sorted(seconds) == [1, 4, 8] and all(s > 0 for s in seconds.values())
