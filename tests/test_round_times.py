"""The round-by-round tool (eagle/evaluation/round_times.py) on a CPU, over the graphed path with capture off (the
runners a GPU lease uses): each of a prompt's three EAGLE runs decodes vanilla's tokens, every round timed."""

import torch

from eagle.evaluation import gpu_costs, round_times


def test_three_eagle_runs_of_a_prompt_time_every_round_of_the_cuda_round_runner_and_decode_vanillas_tokens():
    model = gpu_costs.build_model("smollm2-135m", torch.float32, torch.device("cpu"), scale=16)
    gpu_costs.graph(model, capture=False)
    assert round_times.runner_name(model) == "CudaRound"
    prompts = [[1, 5, 9, 14, 3, 7], [1, 30, 2000, 41, 8]]
    results = round_times.three_runs(model, prompts, max_new_tokens=12)
    for ids, r in zip(prompts, results):
        vanilla = model.naivegenerate(torch.tensor([ids]), max_new_tokens=12, max_length=len(ids) + 12)[0, len(ids):]
        runs = [r[run]["tokens"] for run in round_times.RUNS]
        assert runs == [vanilla.tolist()] * 3 and r["same_tokens"]
        for run in round_times.RUNS:
            d = r[run]
            assert len(d["round_ms"]) == len(d["round_tokens"]) >= 1 and sum(d["round_tokens"]) + 1 == 12
            assert all(ms > 0 for ms in d["round_ms"]) and d["prefill_ms"] > 0
            assert "steps), slowest #" in round_times.summary(r, run)
        assert r["vanilla_step_ms"] > 0 and r["prompt_tokens"] == len(ids)
