"""What a greedy round costs, in vanilla steps, on each round path, measured in one process on the same graphs:

    python -m eagle.evaluation.round_ab --threads 2 --compile on --max-new-tokens 128 [--limit 20]

Paths, run in turn on every prompt (interleaved, so that drifting machine load hits all alike): `vanilla` (one
token per base forward), `general` (the round as `eagle_rounds` runs it: the base's forward graphs and the draft's
step graphs with eager work between them) and `two_step` (round_steps.py: the draft step and the verify step, each
one graph when compiled). A round's cost in vanilla steps is tau / speedup, the speedup taken per prompt against
vanilla on the same prompt just before (the median of those ratios: a stall of the machine spoils one pair, not the
figure; the totals' ratio is printed too). Prompts are
MT-bench first turns (or --question-file) with the chat template; outputs are compared with vanilla's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from eagle.tuning.cost_cache import cpu_description

from .bench import add_question_args, load_questions
from .models import add_model_args, exit_on_bad_options, load_from_args, log
from .prompts import build_prompts

PATHS = ("vanilla", "general", "two_step")


def decode(model, ids, path: str, max_new_tokens: int) -> tuple[list[int], int, float]:
    """(new tokens, base forwards after the prefill, seconds after the prefill's round) on one path."""
    if path == "general":
        model.round_runner = lambda *a: None  # eagle_rounds for this generation
    try:
        stream = model.stream(ids, max_new_tokens=max_new_tokens, eagle=path != "vanilla")
        first = next(stream)
        tokens, rounds, t0 = list(first.tokens), 0, time.perf_counter()
        for r in stream:
            tokens += r.tokens
            rounds += 1
        return tokens, rounds, time.perf_counter() - t0
    finally:
        model.__dict__.pop("round_runner", None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle.evaluation.round_ab", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    add_question_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with exit_on_bad_options():
        questions, _ = load_questions(args)
        loaded = load_from_args(args, log)
    model = loaded.model
    if not model.compiled_rounds and model.base.compiled is not None:
        log("note: the round's two steps are not compiled; two_step runs them eagerly")
    prompts = build_prompts(questions, model.tokenizer, loaded.mtype.template, loaded.mtype.system_prompt)
    for path in PATHS:  # one untimed generation each: first calls of the graphs
        decode(model, torch.tensor([prompts[0].ids]), path, 16)
    seconds = {k: 0.0 for k in PATHS}
    tokens = {k: 0 for k in PATHS}
    forwards = {k: 0 for k in PATHS}
    identical = {k: 0 for k in PATHS}
    per_prompt = {k: [] for k in PATHS}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt.ids])
        outs = {}
        for path in PATHS:
            out, n, s = decode(model, ids, path, args.max_new_tokens)
            outs[path] = out
            seconds[path] += s
            tokens[path] += len(out) - 1
            forwards[path] += n
            per_prompt[path].append((len(out) - 1) / s)
            identical[path] += out == outs["vanilla"]
        log(f"[{i + 1}/{len(prompts)}] " + ", ".join(f"{k} {per_prompt[k][-1]:.1f}" for k in PATHS) + " tokens/s")
    vanilla = tokens["vanilla"] / seconds["vanilla"]
    rows = []
    for path in PATHS:
        tps = tokens[path] / seconds[path]
        tau = tokens[path] / forwards[path]
        # per prompt, against vanilla on the same prompt moments before: a stall of the machine hits one pair
        paired = statistics.median(a / b for a, b in zip(per_prompt[path], per_prompt["vanilla"]))
        rows.append({"path": path, "tokens_per_s": tps, "median_prompt_tokens_per_s": statistics.median(per_prompt[path]),
                     "tau": tau, "speedup": tps / vanilla, "median_paired_speedup": paired,
                     "round_in_vanilla_steps": tau / paired, "round_ms": 1e3 * seconds[path] / forwards[path],
                     "identical": f"{identical[path]}/{len(prompts)}"})  # fmt: skip
    tree = model.tree
    print(f"CPU: {cpu_description()}; threads {torch.get_num_threads()}; tree {tree.total_token}/{tree.depth}/"
          f"{tree.top_k}; head {model.ea_layer.dtype_name}; {len(prompts)} prompts x {args.max_new_tokens} tokens")
    print("| path | tokens/s | median per prompt | tau | x vanilla | x vanilla, median per prompt | round, vanilla "
          "steps | round ms | identical |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['path']} | {r['tokens_per_s']:.1f} | {r['median_prompt_tokens_per_s']:.1f} | {r['tau']:.2f} | "
              f"{r['speedup']:.2f} | {r['median_paired_speedup']:.2f} | {r['round_in_vanilla_steps']:.2f} | "
              f"{r['round_ms']:.1f} | {r['identical']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_description(), "rows": rows, "argv": sys.argv}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
