"""The GPU cost tool (eagle/evaluation/gpu_costs.py) on a CPU: every stage runs on tiny bases of the named
configurations' kind (capture off), so a lease spends its minutes measuring, not finding a broken script."""

import json

import torch

from eagle.evaluation import gpu_costs


def test_every_stage_of_the_gpu_cost_tool_runs_and_projects_a_speedup(tmp_path):
    results = gpu_costs.main(["--bases", "smollm2-135m,llama-3.1-8b", "--scale", "16", "--device", "cpu",
                              "--dtype", "float32", "--new-tokens", "8", "--contexts", "32,5000", "--rows", "1,8",
                              "--profile-rounds", "4", "--out", str(tmp_path)])  # fmt: skip
    saved = json.loads((tmp_path / "gpu_costs.json").read_text())["results"]
    assert [r["base"] for r in saved] == ["smollm2-135m", "llama-3.1-8b"] == [r["base"] for r in results]
    for r in saved:
        errors = {k: v for k, v in r.items() if isinstance(v, dict) and "error" in v}
        assert not errors
        assert r["graphs"]["in_use"] and r["vanilla"]["tokens_per_forward"] == 1.0
        assert set(r["pass_ms"]) == {"32", str(4096 - 8)}  # a context past the graphs' cache is clipped to it
        assert r["round_in_steps"] > 0 and r["projected_speedup_vs_vanilla"] == r["tau"] / r["round_in_steps"]
        assert r["runtime_calls_per_round"]["aten_ops"] > 0
        # the round's own graphs against the forwards' alone, and the round per tree
        assert r["eagle_forward_graphs"]["tokens_per_forward"] == 1.0
        assert r["eagle_random_acceptance"]["tokens_per_s"] > 0
        assert set(r["round_trees"]) == {"%d/%d/%d" % t for t in gpu_costs.ROUND_TREES}
        assert all(t["round_in_steps"] > 0 for t in r["round_trees"].values())


def test_a_random_eagle3_head_matches_its_base_and_the_reference_layout():
    base = gpu_costs.build_base("llama-3.1-8b", torch.float32, torch.device("cpu"), scale=16)
    config, state = gpu_costs.random_head_state(base, {"intermediate_size": 14336, "draft_vocab_size": 32000})
    draft = config["draft_vocab_size"]
    assert draft == min(32000, base.config.vocab_size)
    targets = torch.arange(draft) + state["d2t"]  # draft id -> target id, as the reference stores it
    assert torch.equal(state["t2d"].nonzero().flatten(), targets)
    assert state["fc.weight"].shape[1] == 3 * base.config.hidden_size
