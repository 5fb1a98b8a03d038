"""Reference-style answer files (gen_ea_answer, gen_baseline_answer) and their speed comparison, on a tiny model."""

import json

import pytest
import torch
from bench_fixtures import QUESTIONS, tiny_model  # noqa: F401  (the module fixture)

from eagle.evaluation import gen_ea_answer, speed


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _answers(folder, path, baseline: bool):
    argv = ["--base-model-path", str(folder / "base"), "--ea-model-path", str(folder / "head"),
            "--question-file", str(folder / "questions.jsonl"), "--answer-file", str(path), "--max-new-tokens", "12",
            "--total-token", "12", "--depth", "4", "--top-k", "4"]  # fmt: skip
    gen_ea_answer.main(argv, baseline=baseline)
    return [json.loads(line) for line in open(path)]


def test_answer_files_hold_every_turn_and_match_at_t0(tiny_model, tmp_path):  # noqa: F811
    eagle = _answers(tiny_model, tmp_path / "eagle.jsonl", baseline=False)
    vanilla = _answers(tiny_model, tmp_path / "vanilla.jsonl", baseline=True)
    assert [r["question_id"] for r in eagle] == [q["question_id"] for q in QUESTIONS]
    for e, v, q in zip(eagle, vanilla, QUESTIONS):
        ce, cv = e["choices"][0], v["choices"][0]
        assert len(ce["turns"]) == len(q["turns"]) and e["model_id"] == "eagle"
        assert ce["turns"] == cv["turns"] and ce["new_tokens"] == cv["new_tokens"]  # greedy: lossless
        assert cv["idxs"] == [n - 1 for n in cv["new_tokens"]]  # vanilla: one token per round
        assert all(t > 0 for t in ce["wall_time"])
    rounds_and_tokens = [(i, n) for r in eagle for i, n in zip(r["choices"][0]["idxs"], r["choices"][0]["new_tokens"])]
    assert any(i < n - 1 for i, n in rounds_and_tokens)  # some EAGLE round accepted drafted tokens

    again = _answers(tiny_model, tmp_path / "eagle.jsonl", baseline=False)  # answered ids are skipped
    assert len(again) == len(eagle)

    result = speed.main([str(tmp_path / "eagle.jsonl"), str(tmp_path / "vanilla.jsonl")])
    assert result["questions"] == len(QUESTIONS) and result["speedup"] > 0
    tokens = sum(sum(r["choices"][0]["new_tokens"]) for r in eagle)
    forwards = sum(sum(i + 1 for i in r["choices"][0]["idxs"]) for r in eagle)
    assert result["mean_accepted_tokens"] == pytest.approx(tokens / forwards) and tokens / forwards > 1


def test_speed_rejects_files_without_common_questions(tmp_path, capsys):
    record = {"question_id": 1, "choices": [{"turns": ["a"], "new_tokens": [1], "idxs": [0], "wall_time": [1.0]}]}
    (tmp_path / "a.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({**record, "question_id": 2}) + "\n")
    with pytest.raises(SystemExit):
        speed.main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    assert "share no question_id" in capsys.readouterr().err
