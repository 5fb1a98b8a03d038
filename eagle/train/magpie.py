"""Prompts the base writes itself (Magpie): given only the chat template's opening of a user turn, an instruct model
writes a user's message; answered by the same base, such pairs are training data drawn from the base's own notion
of what users ask, with no dataset to download.

    prefix = user_turn_prefix(template, system)        # the rendered text up to where a user's message begins
    written = filter_prompts(write_prompts(model, tokenizer, template, count=4096, seed=0))
    kept = [w.text for w in written if w.dropped is None]

A topic may steer the writing through the system prompt of the writing turn only (`TOPICS`); the prompt is later
answered under the template's default, so the topic line never reaches the training conversations. Written texts
are dropped when `why_junk` names a reason, when they repeat an earlier one exactly or nearly (`dedupe.py`), and
when they hold a benchmark prompt (`benchmark_guard.py`). Every step is seeded: the same seed writes the same
prompts on the same device and dtype.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass

from eagle.model.ea_model import stop_token_ids

from .batch_generate import generate_all
from .benchmark_guard import BenchmarkGuard, benchmark_prompts, words
from .dedupe import UniqueTexts

TOPICS = ("writing", "roleplay", "reasoning", "maths", "coding", "extraction", "STEM", "humanities",
          "everyday chat")  # fmt: skip
SENTINEL = "\u2063MAGPIE\u2063"  # a user message nobody writes: where the template puts the message's text


def topic_system(topic: str) -> str:
    return f"You are a helpful assistant. The user's next message is a request about {topic}."


def user_turn_prefix(template, system: str | None = None) -> str:
    """The template's rendering of a conversation (with `system`, if given) up to where the first user message's
    text starts."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": SENTINEL}]
    text = template.render(messages)
    if SENTINEL not in text:
        raise ValueError("the chat template does not show the user's message verbatim: no Magpie prefix")
    return text[: text.index(SENTINEL)]


def why_junk(text: str, stopped: bool) -> str | None:
    """Why a written prompt is not kept (None: kept): cut off, empty, a word or two, looping, or template markup."""
    ws = words(text)
    if not stopped:
        return "cut"  # no end of turn within the budget: a ramble
    if not ws:
        return "empty"
    if len(ws) < 3:
        return "short"
    if re.search(r"<\|[^|>]*\|>|\[INST\]|<s>|</s>", text):
        return "markup"
    grams = Counter(zip(ws, ws[1:], ws[2:], ws[3:], strict=False))
    if grams and grams.most_common(1)[0][1] >= 3 or (len(ws) >= 20 and len(set(ws)) / len(ws) < 0.3):
        return "looping"
    return None


@dataclass
class Written:
    text: str
    topic: str | None  # the topic of the writing turn's system prompt (None: the template's default)
    dropped: str | None  # why it was dropped (why_junk's reasons, "duplicate", "benchmark"), or None


def write_prompts(model, tokenizer, template, count: int, seed: int = 0, batch_size: int = 256,
                  max_tokens: int = 256, temperature: float = 1.0, topic_share: float = 0.5) -> list[Written]:
    """`count` user messages written by `model` (a `topic_share` of them under a topic's system prompt, topics drawn
    by a seeded generator), each with `why_junk`'s reason or None. `filter_prompts` then drops repeats and
    benchmark prompts."""
    rng = random.Random(seed)
    topics = [rng.choice(TOPICS) if rng.random() < topic_share else None for _ in range(count)]
    prefixes = {t: user_turn_prefix(template, topic_system(t) if t else None) for t in set(topics)}
    ids = {t: tokenizer(p, add_special_tokens=False).input_ids for t, p in prefixes.items()}
    stops = stop_token_ids(tokenizer)
    outs = generate_all(model, [ids[t] for t in topics], batch_size, max_tokens, stops, temperature=temperature,
                        seed=seed)  # fmt: skip
    written = []
    for topic, out in zip(topics, outs, strict=True):
        stopped = bool(out) and out[-1] in stops
        text = tokenizer.decode(out[:-1] if stopped else out, skip_special_tokens=True).strip()
        written.append(Written(text, topic, why_junk(text, stopped)))
    return written


def filter_prompts(written: list[Written], guard: BenchmarkGuard | None = None,
                   earlier: UniqueTexts | None = None) -> list[Written]:  # fmt: skip
    """Marks, among the prompts not dropped yet, each that holds a benchmark prompt ("benchmark": `guard`, default
    every MT-bench turn and every shipped benchmark set), then each that repeats, exactly or nearly, one kept
    before it or one `earlier` holds (prompts kept by earlier calls, left as they are) ("duplicate"). Returns
    `written`; the kept ones have `dropped` None."""
    guard = guard if guard is not None else BenchmarkGuard(benchmark_prompts())
    kept = UniqueTexts()
    for w in written:
        if w.dropped is None and guard.match([w.text]) is not None:
            w.dropped = "benchmark"
        elif w.dropped is None and ((earlier is not None and earlier.holds(w.text)) or not kept.add(w.text)):
            w.dropped = "duplicate"
    return written
