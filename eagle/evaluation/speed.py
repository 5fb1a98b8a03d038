"""The reference's speed comparison of two answer files (from gen_ea_answer and gen_baseline_answer).

    python -m eagle.evaluation.speed out/answers/eagle.jsonl out/answers/vanilla.jsonl

Over the questions both files answered: each file's tokens/s (all new tokens / all wall time), the reference's
ratio (mean over questions of per-question tokens/s, EAGLE over baseline) and EAGLE's mean accepted tokens per
base forward (new tokens / (rounds + 1) summed over turns).
"""

from __future__ import annotations

import argparse
import json
import sys


def read_answers(path: str) -> dict:
    with open(path) as f:
        return {r["question_id"]: r["choices"][0] for r in map(json.loads, filter(str.strip, f))}


def compare(eagle: dict, baseline: dict) -> dict:
    common = [q for q in eagle if q in baseline]
    if not common:
        raise ValueError("the two answer files share no question_id")

    def totals(answers):
        tokens = sum(sum(answers[q]["new_tokens"]) for q in common)
        seconds = sum(sum(answers[q]["wall_time"]) for q in common)
        per_question = [sum(answers[q]["new_tokens"]) / sum(answers[q]["wall_time"]) for q in common]
        return tokens, seconds, sum(per_question) / len(per_question)

    e_tokens, e_seconds, e_mean = totals(eagle)
    b_tokens, b_seconds, b_mean = totals(baseline)
    forwards = sum(sum(i + 1 for i in eagle[q]["idxs"]) for q in common)
    return {
        "questions": len(common),
        "eagle_tokens_per_s": e_tokens / e_seconds,
        "baseline_tokens_per_s": b_tokens / b_seconds,
        "speedup": (e_tokens / e_seconds) / (b_tokens / b_seconds),
        "speedup_reference_style": e_mean / b_mean,
        "mean_accepted_tokens": e_tokens / forwards,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m eagle.evaluation.speed", description=__doc__.split("\n\n")[0])
    p.add_argument("eagle_answers")
    p.add_argument("baseline_answers")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = compare(read_answers(args.eagle_answers), read_answers(args.baseline_answers))
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
