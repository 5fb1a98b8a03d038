"""Round by round: EAGLE on the bench's prompts, each prompt decoded three times (its first run right after vanilla's,
as the bench times it; a repeat right after it; a third run after vanilla decoded the prompt again), every round's
seconds, beside vanilla's step on the same prompt.

    python -m eagle.evaluation.round_times --limit 3 --max-new-tokens 256 --compile on \
        --total-token 60 --depth 7 --top-k 10 --out out/round_times

A cost that only a prompt's first run pays (a graph captured lazily, a kernel plan built for a new shape, host
memory pinned for the first time) shows as first-run rounds slower than the repeat's and the third run's at the
same tokens; a cost of following vanilla shows in the first and third; a cost every round pays shows in all three.
The round runner in use is named (round_graphs.py / cuda_round.py, or none: the forwards' graphs). Greedy only:
every run decodes the same tokens, so the runs compare round for round.

A model on CUDA attends without cuDNN's kernel (runners.device_settings: cuDNN builds a plan per new shape);
`--cudnn-attention` turns it back on once the model is loaded and its graphs captured, so that one lease measures
what the eager parts of a round would pay for those plans.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from eagle.evaluation.bench import add_question_args, load_questions
from eagle.evaluation.models import add_model_args, device_name, exit_on_bad_options, load_from_args, log
from eagle.evaluation.prompts import build_prompts
from eagle.timing import timed


def runner_name(model) -> str:
    """The class of the greedy round runner that `EaModel.stream` uses for the tree in use ('none': the forwards')."""
    from eagle.decoding.verify import SamplingParams, TokenPicker

    runner = model.round_runner(model.tree, TokenPicker(SamplingParams(0.0, 0.0, 0)))
    return type(runner).__name__ if runner is not None else "none"


def decode(model, ids: list[int], max_new_tokens: int, eagle: bool) -> dict:
    """One greedy generation through `EaModel.stream`, as the bench runs it: wall seconds, and per round after the
    prefill its seconds and tokens."""
    device = model.base_model.get_input_embeddings().weight.device
    x = torch.tensor([ids])
    rounds, seconds = timed(device, lambda: list(model.stream(
        x, eagle=eagle, temperature=0.0, max_new_tokens=max_new_tokens, max_length=len(ids) + max_new_tokens)))
    tokens = [t for r in rounds for t in r.tokens]
    return {"seconds": seconds, "tokens": tokens, "prefill_ms": rounds[0].seconds * 1e3,
            "round_ms": [r.seconds * 1e3 for r in rounds[1:]], "round_tokens": [len(r.tokens) for r in rounds[1:]]}


RUNS = ("first", "repeat", "after_vanilla")  # EAGLE's runs of a prompt, in order (module docstring)


def three_runs(model, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Per prompt: vanilla's run (its ms per step), EAGLE's first run and a repeat, vanilla again, EAGLE again."""
    out = []
    for ids in prompts:
        vanilla = decode(model, ids, max_new_tokens, eagle=False)
        first, repeat = (decode(model, ids, max_new_tokens, eagle=True) for _ in range(2))
        decode(model, ids, max_new_tokens, eagle=False)
        after_vanilla = decode(model, ids, max_new_tokens, eagle=True)
        step = statistics.median(vanilla["round_ms"]) if vanilla["round_ms"] else float("nan")
        same = first["tokens"] == repeat["tokens"] == after_vanilla["tokens"]
        out.append({"prompt_tokens": len(ids), "vanilla_step_ms": step, "vanilla_seconds": vanilla["seconds"],
                    "same_tokens": same, "first": first, "repeat": repeat, "after_vanilla": after_vanilla})
    return out


def summary(r: dict, run: str) -> str:
    d = r[run]
    ms = d["round_ms"] or [float("nan")]
    slowest = sorted(range(len(ms)), key=lambda i: -ms[i])[:3]
    worst = ", ".join(f"#{i} {ms[i]:.1f} ms ({d['round_tokens'][i]} tokens)" for i in slowest if d["round_ms"])
    tau = len(d["tokens"]) / (len(d["round_ms"]) + 1)
    return (f"{run:13s} {len(d['tokens']):4d} tokens in {d['seconds'] * 1e3:7.1f} ms, prefill {d['prefill_ms']:6.1f} "
            f"ms, {len(d['round_ms'])} rounds (tau {tau:.2f}): median {statistics.median(ms):.2f} ms, mean "
            f"{statistics.fmean(ms):.2f} ({statistics.fmean(ms) / r['vanilla_step_ms']:.2f} steps), slowest {worst}")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_question_args(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default="out/round_times", help="folder for round_times.json")
    p.add_argument("--cudnn-attention", action="store_true",
                   help="CUDA: cuDNN's attention allowed again after loading (the eager passes then use it)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with exit_on_bad_options():
        questions, source = load_questions(args)
        loaded = load_from_args(args, log)
    model = loaded.model
    if args.cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(True)
    prompts = build_prompts(questions, model.tokenizer, loaded.mtype.template, loaded.mtype.system_prompt)
    runner = runner_name(model)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    tree = [model.tree.total_token, model.tree.depth, model.tree.top_k]
    print(f"{device_name(loaded.device)}; tree {'/'.join(map(str, tree))}; round runner: {runner}; cuDNN attention "
          f"{'allowed' if cudnn else 'off'}; {len(prompts)} prompts from {source}")
    results = three_runs(model, [list(q.ids) for q in prompts], args.max_new_tokens)
    for q, r in zip(prompts, results):
        print(f"question {q.question_id} ({r['prompt_tokens']} prompt tokens): vanilla step {r['vanilla_step_ms']:.2f} "
              f"ms; every EAGLE run decodes the same tokens: {r['same_tokens']}")
        for run in RUNS:
            print("  " + summary(r, run))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"device": device_name(loaded.device), "runner": runner, "cudnn_attention": cudnn, "tree": tree,
              "results": [{"question_id": q.question_id, **r} for q, r in zip(prompts, results)]}
    (out / "round_times.json").write_text(json.dumps(record, indent=1))
    return results


if __name__ == "__main__":
    main()
