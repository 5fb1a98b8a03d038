"""Reference-style answers: every turn of every MT-bench question, as FastChat `model_answer` jsonl records (what
FastChat's llm_judge grades), with each turn's new tokens, EAGLE rounds and wall time.

    python -m eagle.evaluation.gen_ea_answer --answer-file out/answers/eagle.jsonl            # EAGLE (eagenerate)
    python -m eagle.evaluation.gen_baseline_answer --answer-file out/answers/vanilla.jsonl    # naivegenerate
    python -m eagle.evaluation.speed out/answers/eagle.jsonl out/answers/vanilla.jsonl        # the speed ratio

A record: {"question_id", "answer_id", "model_id", "tstamp", "choices": [{"index": 0, "turns": [text, ...],
"new_tokens": [n, ...], "idxs": [rounds, ...], "wall_time": [s, ...]}]}; a turn used idxs + 1 base forwards
(the prefill included). Turn k's prompt holds the previous turns with this model's own answers.
`python -m eagle.evaluation.bench` is the tool that compares methods in one run; these files serve judging and
the reference's workflow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

import torch

from eagle.chat.templates import build_prompt, encode
from eagle.timing import timed

from .models import add_model_args, exit_on_bad_options, load_from_args, log
from .questions import load_mtbench_questions


def build_parser(baseline: bool) -> argparse.ArgumentParser:
    prog = "gen_baseline_answer" if baseline else "gen_ea_answer"
    p = argparse.ArgumentParser(prog=f"python -m eagle.evaluation.{prog}", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    g = p.add_argument_group("answers")
    g.add_argument("--question-file", default=None, help="MT-bench-format jsonl (default: MT-bench, 80 questions)")
    g.add_argument("--answer-file", required=True, help="jsonl to write (appends; existing question ids are skipped)")
    g.add_argument("--model-id", default=None, help="model_id in the records (default: the answer file's stem)")
    g.add_argument("--limit", type=int, default=None, help="only the first N questions")
    g.add_argument("--max-new-tokens", type=int, default=1024, help="per turn (default: 1024, as the reference)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--seed", type=int, default=0)
    if not baseline:
        g.add_argument("--baseline", action="store_true", help="use naivegenerate (same as gen_baseline_answer)")
    return p


def answer(model, kind: str, system: str, turns: list[str], generate, max_new_tokens: int, temperature: float,
           ) -> dict:  # fmt: skip
    """All turns of one question, each prompted with the earlier turns and this model's answers to them."""
    history, texts, new_tokens, idxs, wall = [], [], [], [], []
    device = model.base_model.get_input_embeddings().weight.device
    for question in turns:
        ids = encode(kind, model.tokenizer, build_prompt(kind, history + [(question, None)], system, model.tokenizer))
        (out, n, rounds), seconds = timed(device, lambda: generate(
            torch.tensor([ids]), temperature=temperature, max_new_tokens=max_new_tokens, log=True))  # fmt: skip
        wall.append(seconds)
        text = model.tokenizer.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True).strip()
        history.append((question, text))
        texts.append(text)
        new_tokens.append(int(n))
        idxs.append(int(rounds))
    return {"index": 0, "turns": texts, "new_tokens": new_tokens, "idxs": idxs, "wall_time": wall}


def main(argv: list[str] | None = None, baseline: bool = False) -> None:
    args = build_parser(baseline).parse_args(sys.argv[1:] if argv is None else argv)
    baseline = baseline or args.baseline
    with exit_on_bad_options():
        if args.threads:
            torch.set_num_threads(args.threads)
        questions = load_mtbench_questions(args.question_file)[: args.limit]
        loaded = load_from_args(args, log)
    model, kind, system = loaded.model, loaded.mtype.template, loaded.mtype.system_prompt
    generate = model.naivegenerate if baseline else model.eagenerate
    model_id = args.model_id or os.path.splitext(os.path.basename(args.answer_file))[0]
    done = set()
    if os.path.exists(args.answer_file):
        with open(args.answer_file) as f:
            done = {json.loads(line)["question_id"] for line in f if line.strip()}
    os.makedirs(os.path.dirname(os.path.abspath(args.answer_file)), exist_ok=True)

    torch.manual_seed(args.seed)
    answer(model, kind, system, questions[0]["turns"][:1], generate, min(args.max_new_tokens, 32), args.temperature)
    for i, q in enumerate(questions):
        if q["question_id"] in done:
            continue
        torch.manual_seed(args.seed + i)
        choice = answer(model, kind, system, q["turns"], generate, args.max_new_tokens, args.temperature)
        record = {"question_id": q["question_id"], "answer_id": uuid.uuid4().hex, "model_id": model_id,
                  "choices": [choice], "tstamp": time.time()}  # fmt: skip
        with open(args.answer_file, "a") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        speed = sum(choice["new_tokens"]) / max(sum(choice["wall_time"]), 1e-9)
        log(f"[{i + 1}/{len(questions)}] {q['question_id']}: {sum(choice['new_tokens'])} tokens, {speed:.1f} tokens/s")


if __name__ == "__main__":
    main()
