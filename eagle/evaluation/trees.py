"""Trees side by side: greedy EAGLE rounds of several tree shapes against vanilla, in one process, on the same prompts,
with where each round's time goes (the round runner's draft, verify and keep calls, and the rest).

    python -m eagle.evaluation.trees --weights q4_1 --compile on --threads 2 --limit 16 --trees 2/1/1,3/2/1,4/2/1

One load (the bench's options); with compiled forwards each tree's round is compiled first (minutes per new shape,
cached). Then, per pass and prompt: vanilla, then every tree in turn, each decoding the prompt (first turns, chat
template applied) with `EaModel.stream` at temperature 0. Per tree: tokens/s, x vanilla, tokens per base forward, a
round in vanilla steps (seconds per round / seconds per vanilla step; prefill excluded from both), how many answers
equal vanilla's, and per round the ms of `runner.draft`, `runner.verify`, `runner.keep` (round_graphs.py) and of the
rest (profile.py's clock: on CUDA each call synchronises the device). The runner's methods are wrapped for the run
and restored afterwards; the engine is not modified.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eagle.decoding.generate import TreeSpec
from eagle.runtime import round_graphs

from . import round_times
from .bench import add_question_args, load_questions
from .models import add_model_args, device_name, exit_on_bad_options, load_from_args, log
from .profile import PhaseClock, wrapped
from .prompts import build_prompts

CALLS = ("draft", "verify", "keep")  # the round runner's calls timed apart


def runner_calls() -> list[tuple]:
    """profile.wrapped's patches that time every round runner's `draft`, `verify` and `keep` (CompiledRound's keep is
    EagerRound's; a compiled step falling back to the eager one counts once, as the clock takes self time)."""
    eager, compiled = round_graphs.EagerRound, round_graphs.CompiledRound
    return [(eager, c, c) for c in CALLS] + [(compiled, c, c) for c in CALLS if c in compiled.__dict__]


def decode(model, ids: list[int], max_new_tokens: int, tree: TreeSpec | None) -> dict:
    """One greedy generation (tree None: vanilla; round_times.decode): its tokens, and rounds and seconds after the
    prefill."""
    if tree is not None:
        model.tree = tree
    run = round_times.decode(model, ids, max_new_tokens, eagle=tree is not None)
    return {"tokens": run["tokens"], "rounds": len(run["round_ms"]), "new": sum(run["round_tokens"]),
            "seconds": sum(run["round_ms"]) / 1e3}  # fmt: skip


def race(model, prompts: list[list[int]], trees: list[TreeSpec], max_new_tokens: int, passes: int = 2) -> list[dict]:
    """Per pass: {"vanilla": totals, "<n>/<d>/<k>": totals with "identical" (answers equal to vanilla's) and "calls"
    (seconds in each runner call)}. Totals count new tokens, rounds and seconds after each prompt's prefill. One
    untimed warm-up prompt first."""
    used = model.tree
    for tree in [None, *trees]:  # warm-up: every graph and plan in use before the timing
        decode(model, prompts[0], min(16, max_new_tokens), tree)
    out = []
    for _ in range(passes):
        totals = {"vanilla": {"new": 0, "rounds": 0, "seconds": 0.0}}
        for ids in prompts:
            ref = decode(model, ids, max_new_tokens, None)
            for key in ("new", "rounds", "seconds"):
                totals["vanilla"][key] += ref[key]
            for tree in trees:
                t = totals.setdefault(name(tree), {"new": 0, "rounds": 0, "seconds": 0.0, "identical": 0,
                                                   "calls": {}})  # fmt: skip
                clock = PhaseClock(cuda=torch.cuda.is_available())
                with wrapped(clock, runner_calls()):
                    run = decode(model, ids, max_new_tokens, tree)
                for (_, call), seconds in clock.seconds.items():
                    t["calls"][call] = t["calls"].get(call, 0.0) + seconds
                for key in ("new", "rounds", "seconds"):
                    t[key] += run[key]
                t["identical"] += run["tokens"] == ref["tokens"]
        out.append(totals)
    model.tree = used
    return out


def name(tree: TreeSpec) -> str:
    return f"{tree.total_token}/{tree.depth}/{tree.top_k}"


def table(totals: dict, prompts: int) -> str:
    """One pass as a markdown table: per tree tokens/s, x vanilla, tokens per forward, the round in vanilla steps and
    its calls' ms per round."""
    v = totals["vanilla"]
    step = v["seconds"] / v["rounds"]
    lines = [f"a vanilla step: {step * 1e3:.2f} ms; per EAGLE round, ms:", "",
             "| tree | tokens/s | x vanilla | tokens per forward | round, steps | draft | verify | keep | rest | "
             "identical |", "|---|" + "---:|" * 9,
             f"| vanilla | {v['new'] / v['seconds']:.1f} | 1.00 | 1.00 | 1.00 | | | | | |"]  # fmt: skip
    for key, t in totals.items():
        if key == "vanilla":
            continue
        per = {c: t["calls"].get(c, 0.0) / t["rounds"] * 1e3 for c in CALLS}
        rest = t["seconds"] / t["rounds"] * 1e3 - sum(per.values())
        lines.append(f"| {key} | {t['new'] / t['seconds']:.1f} | {t['new'] / t['seconds'] / (v['new'] / v['seconds']):.2f}"
                     f" | {t['new'] / t['rounds']:.2f} | {t['seconds'] / t['rounds'] / step:.2f} | {per['draft']:.2f} | "
                     f"{per['verify']:.2f} | {per['keep']:.2f} | {rest:.2f} | {t['identical']}/{prompts} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_question_args(p)
    p.add_argument("--trees", default="2/1/1,3/2/1,4/2/1", help="tree shapes total_token/depth/top_k, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default="out/trees", help="folder for trees.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with exit_on_bad_options():
        trees = [TreeSpec(*map(int, t.split("/"))) for t in args.trees.split(",")]
        questions, source = load_questions(args)
        loaded = load_from_args(args, log)
    model = loaded.model
    model.draft_options = None  # every tree's round with the head in use (compile_round would pick a head per tree)
    for tree in trees:
        model._validate_tree(tree)
        if model.base.compiled is not None:
            model.compile_round(tree, log)
    prompts = [list(q.ids) for q in build_prompts(questions, model.tokenizer, loaded.mtype.template,
                                                   loaded.mtype.system_prompt)]  # fmt: skip
    results = race(model, prompts, trees, args.max_new_tokens, args.passes)
    print(f"{device_name(loaded.device)}; {len(prompts)} prompts from {source}; {args.max_new_tokens} new tokens")
    for i, totals in enumerate(results, start=1):
        print(f"\npass {i}\n{table(totals, len(prompts))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trees.json").write_text(json.dumps({"device": device_name(loaded.device), "passes": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
