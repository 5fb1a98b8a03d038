"""MT-Bench question loading and ShareGPT conversation loading, on small files."""

import json

import pytest

from eagle.evaluation.questions import load_mtbench_questions
from eagle.train.sharegpt import load_sharegpt, to_messages

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
    {"question_id": 111, "category": "math", "turns": ["1+1?", "2+2?"], "reference": ["2", "4"]},
]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_mtbench_questions_load_in_file_order_and_keep_extra_keys(tmp_path):
    path = write_jsonl(tmp_path / "question.jsonl", [QUESTIONS[0], "", QUESTIONS[1]])
    assert load_mtbench_questions(path) == QUESTIONS


@pytest.mark.parametrize(
    "bad, complaint",
    [
        ('{"question_id": 1, "category": "x", "turns": ["a"]', "not valid JSON"),
        ({"question_id": 1, "turns": ["a"]}, "missing key(s) category"),
        ({"question_id": 1, "category": "x", "turns": []}, "'turns' must be a non-empty list"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_malformed_mtbench_line_error_names_file_and_line(tmp_path, bad, complaint):
    path = write_jsonl(tmp_path / "question.jsonl", [QUESTIONS[0], bad])
    with pytest.raises(ValueError) as err:
        load_mtbench_questions(path)
    assert f"{path}, line 2: {complaint}" in str(err.value)


def turn(who, text):
    return {"from": who, "value": text}


SHAREGPT = [
    {"id": "ok", "conversations": [turn("human", "hi"), turn("gpt", "hello"), turn("human", "bye"), turn("chatgpt", "ciao")]},
    {"id": "system", "conversations": [turn("system", "be brief"), turn("human", "q"), turn("bard", "a")]},
    {"id": "starts_with_gpt", "conversations": [turn("gpt", "hello"), turn("human", "hi")]},
    {"id": "empty_turn", "conversations": [turn("human", "hi"), turn("gpt", "  ")]},
    {"id": "not_alternating", "conversations": [turn("human", "a"), turn("human", "b"), turn("gpt", "c")]},
    {"id": "unknown_role", "conversations": [turn("human", "a"), turn("bing", "b")]},
    {"id": "no_answer", "conversations": [turn("human", "a")]},
    {"id": "empty", "conversations": []},
]


def test_sharegpt_keeps_only_well_formed_conversations_as_chat_messages(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    assert load_sharegpt(path) == [
        {
            "id": "ok",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "ciao"},
            ],
        },
        {
            "id": "system",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ],
        },
    ]


def test_sharegpt_limit_counts_kept_conversations(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT[2:] + SHAREGPT[:2]))
    assert [c["id"] for c in load_sharegpt(path, limit=1)] == ["ok"]


def test_sharegpt_file_cut_off_mid_record_yields_the_complete_records(tmp_path):
    text = json.dumps(SHAREGPT, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index('"id": "system"') + 20])  # cut inside the second record
    with pytest.warns(UserWarning, match="truncated"):
        assert [c["id"] for c in load_sharegpt(path)] == ["ok"]


def test_sharegpt_broken_record_in_complete_file_raises(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text('[{"id": "a", "conversations": []}, {"id": oops}]')
    with pytest.raises(ValueError, match="invalid JSON in record 1"):
        load_sharegpt(path)


def test_to_messages_rejects_a_system_turn_in_the_middle():
    assert to_messages([turn("human", "a"), turn("system", "s"), turn("gpt", "b")]) is None
