"""Where does an EAGLE round spend its time? Per-phase wall time over N rounds, printed as a table.

    python -m eagle.evaluation.profile --rounds 200                 # default model, EAGLE-2 dynamic tree
    python -m eagle.evaluation.profile --static --rounds 200        # EAGLE-1 static tree (MC_SIM_7B_63)

Prompts are MT-bench first turns (or --question-file), taken in order until N rounds (one base verify forward
each; the prefill of every prompt is reported apart) have run. The engine is not modified: for the profiled pass
the profiler wraps functions of eagle.decoding.{generate,draft,tree} and eagle.models.{base,kv_cache} and restores
them afterwards.
Each phase's time is its *self* time (time in nested timed phases is subtracted), so the rows add up to the
profiled round time; what no wrapper covers (the round loop, Budget, building small tensors, generator
hand-offs) is the "python overhead" row. On CUDA every phase boundary synchronises the device, so phases are
attributed correctly but the profiled round is slower than an unprofiled one; both round times are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict

import torch

from eagle.timing import synchronize_all

from .models import add_model_args, device_name, exit_on_bad_options, load_from_args, log
from .prompts import build_prompts

PHASES = [
    ("draft_step", "the round's draft step: commit, tree levels, selection (round_steps.py)"),
    ("verify_step", "the round's verify step: base pass, acceptance (round_steps.py)"),
    ("verify", "base verify forward: decoder over the tree"),
    ("verify_lm_head", "base verify forward: lm_head over all tree rows"),
    ("draft_forward", "draft tree: head forwards (one per level)"),
    ("draft_logits", "draft tree: draft logits + log_softmax"),
    ("draft_select", "draft tree: top-k, scores, node selection"),
    ("draft_commit", "draft: head forward over accepted tokens"),
    ("tree_build", "tree bookkeeping: DraftTree (parents, children)"),
    ("tree_mask", "tree bookkeeping: ancestor mask + 4D attention mask"),
    ("accept", "verification walk (argmax / sampling, accept)"),
    ("compact", "KV compaction (base cache)"),
]
LABELS = dict(PHASES)


class PhaseClock:
    """Self time per (bucket, phase): a stack of running phases; a phase's time excludes its timed children."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.bucket = "round"  # "prefill" while a prompt's first round runs
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.stack: list[list] = []  # [name, child seconds]

    def _sync(self):
        if self.cuda:
            synchronize_all()

    def wrap(self, fn, name):
        """`name`: a phase key, or a function (parent phase key or None, args) -> key or None (= not timed)."""
        clock = self

        def timed(*args, **kwargs):
            key = name(clock.stack[-1][0] if clock.stack else None, args, kwargs) if callable(name) else name
            if key is None:
                return fn(*args, **kwargs)
            clock._sync()
            start = time.perf_counter()
            clock.stack.append([key, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                clock._sync()
                elapsed = time.perf_counter() - start
                _, children = clock.stack.pop()
                clock.seconds[(clock.bucket, key)] += elapsed - children
                clock.calls[(clock.bucket, key)] += 1
                if clock.stack:
                    clock.stack[-1][1] += elapsed

        timed.__wrapped__ = fn
        return timed


@contextlib.contextmanager
def instrument(clock: PhaseClock, model):
    """Wrap the engine's phase functions (class and module attributes), restoring them on exit."""
    from eagle.decoding import generate
    from eagle.decoding.draft import Drafter, HeadStep
    from eagle.decoding.tree import DraftTree
    from eagle.models.base import BaseModel
    from eagle.models.kv_cache import TreeKVCache
    from eagle.runtime.round_graphs import CompiledRound, EagerRound

    def base_forward(parent, args, kwargs):
        return "verify"  # the prefill lands in the "prefill" bucket

    def lm_head(parent, args, kwargs):
        return "verify_lm_head" if parent == "verify" else None  # inside the draft: part of its logits phase

    lm = model.base.lm_head
    patches = [
        (BaseModel, "forward", base_forward), (Drafter, "_run", "draft_forward"),
        (HeadStep, "log_probs", "draft_logits"), (Drafter, "dynamic_tree", "draft_select"),
        (Drafter, "static_tree", "draft_select"), (Drafter, "commit", "draft_commit"),
        (DraftTree, "__post_init__", "tree_build"), (DraftTree, "ancestor_mask", "tree_mask"),
        (generate, "tree_mask", "tree_mask"), (generate, "accept", "accept"), (TreeKVCache, "compact", "compact"),
        (lm, "forward", lm_head), (EagerRound, "draft", "draft_step"), (EagerRound, "verify", "verify_step"),
        (CompiledRound, "draft", "draft_step"), (CompiledRound, "verify", "verify_step"),
    ]  # fmt: skip
    with wrapped(clock, patches):
        yield clock


@contextlib.contextmanager
def wrapped(clock: PhaseClock, patches: list[tuple]):
    """(owner, attribute, phase name or key function) wrapped by `clock` while open, then restored."""
    saved = [(owner, attr, owner.__dict__.get(attr, _MISSING)) for owner, attr, _ in patches]
    try:
        for owner, attr, name in patches:
            setattr(owner, attr, clock.wrap(getattr(owner, attr), name))
        yield clock
    finally:
        for owner, attr, original in reversed(saved):
            if original is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


_MISSING = object()


# ---------------------------------------------------------------------------------------------------------
def run_rounds(model, prompts, rounds: int, args, eagle: bool, tree, clock: PhaseClock | None = None) -> dict:
    """Generate over the prompts in order until `rounds` rounds after the prefills; time them from outside."""
    sync = synchronize_all if torch.cuda.is_available() else (lambda: None)
    done = tokens = accepted = used = 0
    round_s = prefill_s = 0.0
    while done < rounds:
        prompt = prompts[used % len(prompts)]
        used += 1
        first = True
        if clock:
            clock.bucket = "prefill"
        n = args.max_new_tokens
        stream = model.stream(torch.tensor([prompt.ids]), temperature=args.temperature, max_new_tokens=n,
                              max_length=len(prompt.ids) + n, eagle=eagle, tree=tree)  # fmt: skip
        sync()
        t0 = time.perf_counter()
        for r in stream:
            sync()
            elapsed = time.perf_counter() - t0
            if first:
                prefill_s += elapsed
                first = False
                if clock:
                    clock.bucket = "round"
            else:
                round_s += elapsed
                done += 1
                tokens += len(r.tokens)
                accepted += r.accepted
                if done >= rounds:
                    break
            t0 = time.perf_counter()
        stream.close()
    return {"rounds": done, "tokens": tokens, "accepted": accepted, "round_s": round_s,
            "prefill_s": prefill_s, "prompts": used}  # fmt: skip


def profile(model, prompts, args) -> dict:
    from eagle.decoding.generate import TreeSpec
    from eagle.decoding.tree import MC_SIM_7B_63

    t = model.tree
    dynamic = TreeSpec(t.total_token, t.depth, t.top_k)
    tree = TreeSpec(choices=tuple(map(tuple, MC_SIM_7B_63))) if args.static else dynamic
    if args.general:  # the round as eagle_rounds runs it, also where the two-step round would
        model.round_runner = lambda *a: None
    try:
        run_rounds(model, prompts, min(args.rounds, 8), args, True, tree)  # warm-up
        plain = run_rounds(model, prompts, args.rounds, args, True, tree)
        clock = PhaseClock(torch.cuda.is_available())
        with instrument(clock, model):
            timed = run_rounds(model, prompts, args.rounds, args, True, tree, clock)
    finally:
        model.__dict__.pop("round_runner", None)
    vanilla = run_rounds(model, prompts, args.rounds, args, False, None) if args.vanilla else None

    n = timed["rounds"]
    phases = {}
    for key, _ in PHASES:
        phases[key] = {"ms_per_round": 1e3 * clock.seconds[("round", key)] / n,
                       "calls_per_round": clock.calls[("round", key)] / n}  # fmt: skip
    measured = sum(clock.seconds[("round", key)] for key, _ in PHASES)
    phases["python"] = {"ms_per_round": 1e3 * (timed["round_s"] - measured) / n, "calls_per_round": None}
    tau = timed["tokens"] / n
    result = {
        "tree": "static MC_SIM_7B_63" if args.static else f"dynamic total_token={t.total_token} depth={t.depth} "
        f"top_k={t.top_k}",
        "rounds": n, "prompts": timed["prompts"], "tokens_per_round": tau,
        "accepted_per_round": timed["accepted"] / n,
        "round_ms": 1e3 * timed["round_s"] / n, "round_ms_unprofiled": 1e3 * plain["round_s"] / plain["rounds"],
        "prefill_ms_per_prompt": 1e3 * plain["prefill_s"] / plain["prompts"],
        "phases": phases,
    }  # fmt: skip
    if vanilla:
        step = 1e3 * vanilla["round_s"] / vanilla["rounds"]
        result["vanilla_step_ms"] = step
        result["estimated_speedup_vs_vanilla"] = tau * step / result["round_ms_unprofiled"]
    return result


def table(result: dict) -> str:
    total = result["round_ms"]
    lines = [
        f"{result['rounds']} EAGLE rounds ({result['tree']}) over {result['prompts']} prompts; "
        f"tokens per round (tau) {result['tokens_per_round']:.2f}",
        "",
        "| phase | ms / round | % of round | calls / round |",
        "|---|---:|---:|---:|",
    ]
    rows = [(LABELS[k], result["phases"][k]) for k, _ in PHASES] + [
        ("python overhead (loop, Budget, small tensors; the rest)", result["phases"]["python"])
    ]
    for label, p in rows:
        if p["calls_per_round"] == 0:
            continue  # a phase of the other round path
        calls = "" if p["calls_per_round"] is None else f"{p['calls_per_round']:.1f}"
        lines.append(f"| {label} | {p['ms_per_round']:.2f} | {100 * p['ms_per_round'] / total:.1f}% | {calls} |")
    lines.append(f"| **round (profiled)** | **{total:.2f}** | 100% | |")
    lines += [
        "",
        f"round without the profiler: {result['round_ms_unprofiled']:.2f} ms; "
        f"prefill: {result['prefill_ms_per_prompt']:.1f} ms per prompt (not in the rounds)",
    ]
    if "vanilla_step_ms" in result:
        lines.append(
            f"vanilla decode step: {result['vanilla_step_ms']:.2f} ms -> estimated speedup vs vanilla = tau x step / "
            f"round = {result['estimated_speedup_vs_vanilla']:.2f}x (break-even tau "
            f"{result['round_ms_unprofiled'] / result['vanilla_step_ms']:.2f})"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle.evaluation.profile", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    g = p.add_argument_group("profile")
    g.add_argument("--rounds", type=int, default=200, help="EAGLE rounds to time (prefills excluded)")
    g.add_argument("--static", action="store_true", help="EAGLE-1 static tree (MC_SIM_7B_63) instead of EAGLE-2's")
    g.add_argument("--question-file", default=None, help="MT-bench-format jsonl (default: MT-bench)")
    g.add_argument("--max-new-tokens", type=int, default=256, help="per prompt")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--general", action="store_true",
                   help="greedy dynamic trees as eagle_rounds runs them (the forwards' graphs and eager work between "
                   "them), not in the round's two steps (round_steps.py)")
    g.add_argument("--no-vanilla", dest="vanilla", action="store_false", help="skip timing vanilla decode steps")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--json", default=None, help="also write the numbers here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from .questions import load_mtbench_questions

    with exit_on_bad_options():
        if args.rounds <= 0 or args.max_new_tokens <= 0:
            raise ValueError("--rounds and --max-new-tokens must be > 0")
        questions = load_mtbench_questions(args.question_file)
        loaded = load_from_args(args, log)
    prompts = build_prompts(questions, loaded.model.tokenizer, loaded.mtype.template, loaded.mtype.system_prompt)
    result = profile(loaded.model, prompts, args)
    result.update(device=device_name(loaded.device), model=loaded.describe())
    print(f"{result['device']}; base {result['model']['base']}, head {result['model']['head']} ({loaded.dtypes})")
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
