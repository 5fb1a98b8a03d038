"""`bench --turns all` on a tiny model: every turn answered after the method's own earlier answers, the engine's
methods starting each later turn from the conversation's kept cache, identity checked only between equal prompts,
and the per-turn figures in the JSON and the table."""

import json
from dataclasses import replace

import pytest
from app_fixtures import one_thread
from tiny import random_draft, save_base, tiny_base
from transformers import AutoTokenizer

from eagle.chat.templates import build_prompt, encode
from eagle.evaluation import bench, methods
from eagle.evaluation.methods import Output
from eagle.evaluation.prompts import Prompt, answer_text
from eagle.evaluation.report import aggregate, markdown

# A chat template for the tiny word-level tokenizer whose assistant turns carry the generation prompt's own marker
# (" w5"), as real templates do: a later turn's prompt then starts with the whole earlier sequence (prompt + reply).
TEMPLATE = (
    "<s>{% for m in messages %}{% if m['role'] == 'user' %} w3 {{ m['content'] }} w4"
    "{% else %} w5 {{ m['content'] }} w4{% endif %}{% endfor %}{% if add_generation_prompt %} w5{% endif %}"
)
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["w7 w8 w9 w10 w7 w8", "w9 w10 w11", "w12 w13 w12"]},
    {"question_id": 101, "category": "reasoning", "turns": ["w11 w12 w13 w11 w12 w13 w11", "w6 w14"]},
]
TURNS = sum(len(q["turns"]) for q in QUESTIONS)
ENGINE = ("vanilla", "eagle", "eagle_static")


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    folder = tmp_path_factory.mktemp("turns")
    base = tiny_base("llama", seed=8)
    save_base(base, str(folder / "base"))
    tok = AutoTokenizer.from_pretrained(folder / "base")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder / "base")
    random_draft(base, str(folder / "head"), eagle3=True)
    (folder / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return folder


@pytest.fixture
def calls(monkeypatch):
    """Every runner call of the bench: (method, prompt ids, conversation, Output), the runners themselves, and a set
    of methods whose answers are cut to their first 4 tokens (so that their histories differ from the others')."""
    seen, runners, cut = [], {}, set()
    make = methods.make_runners

    def recording(names, *args, **kwargs):
        made = make(names, *args, **kwargs)
        runners.update(made)

        def wrap(name, run):
            def call(ids, conversation=None):
                out = run(ids, conversation=conversation)
                if name in cut:
                    out = replace(out, tokens=out.tokens[:4])
                seen.append((name, list(ids), conversation, out))
                return out

            return call

        return {name: wrap(name, run) for name, run in made.items()}

    monkeypatch.setattr(bench, "make_runners", recording)
    return seen, runners, cut


def run_bench(folder, out, *extra):
    return bench.main([
        "--base-model-path", str(folder / "base"), "--ea-model-path", str(folder / "head"),
        "--question-file", str(folder / "questions.jsonl"), "--max-new-tokens", "12", "--out", str(out),
        "--total-token", "12", "--depth", "4", "--top-k", "4", "--quiet", *extra,
    ])  # fmt: skip


def timed_calls(seen):
    """The timed calls (the warm-up's left out: its conversation key is (method, "warm-up"))."""
    return [c for c in seen if c[2] is None or c[2][1] != "warm-up"]


def test_every_turn_is_answered_after_the_methods_own_answers(tiny_chat, tmp_path, calls):
    seen, _, cut = calls
    cut.add("hf")  # hf's answers differ from our methods' (which, sampled with the same seed, all answer alike)
    data = run_bench(tiny_chat, tmp_path, "--turns", "all", "--methods", "hf,vanilla,eagle", "--temperature", "0.9")
    tok = AutoTokenizer.from_pretrained(tiny_chat / "base")
    timed = timed_calls(seen)
    assert len(timed) == len(data["records"]) == 3 * TURNS
    order = [(c[0], c[2][1] if c[2] else None) for c in timed]  # per question, per turn, every method in turn
    assert order == [(m, q["question_id"]) for q in QUESTIONS for _ in q["turns"] for m in ("hf", "vanilla", "eagle")]
    for q in QUESTIONS:
        mine = [c for c in timed if c[2] is not None and c[2][1] == q["question_id"]]
        firsts = set()
        for name in ("hf", "vanilla", "eagle"):
            own = [c for c in mine if c[0] == name]
            assert len(own) == len(q["turns"]) and all(c[2] == (name, q["question_id"]) for c in own)
            answers = [answer_text(tok, c[3].tokens) for c in own]
            firsts.add(tuple(own[0][3].tokens))
            for t, (_, ids, _, _) in enumerate(own):
                history = [(q["turns"][i], answers[i]) for i in range(t)]
                expected = encode("chat-template", tok, build_prompt("chat-template", [*history, (q["turns"][t], None)],
                                                                     "", tok))  # fmt: skip
                assert ids == expected, (name, q["question_id"], t)
            second = own[1][1]  # the first answer's text, re-encoded, inside the second turn's prompt
            answer = tok(answers[0], add_special_tokens=False)["input_ids"]
            assert answer and any(second[i : i + len(answer)] == answer for i in range(len(second))), name
        assert len(firsts) > 1  # the methods' first answers differ, so each history is its own
    records = data["records"]
    assert [r["turn"] for r in records if r["method"] == "hf" and r["question_id"] == 81] == [1, 2, 3]
    for r, (_, ids, _, out) in zip(records, timed):
        assert r["prompt_tokens"] == len(ids) and r["new_tokens"] == len(out.tokens)
        assert r["identical_to_vanilla"] is None  # sampled: nothing compared
    assert data["settings"]["turns"] == "all"


def test_greedy_turns_match_vanilla_and_start_from_the_kept_cache(tiny_chat, tmp_path, calls):
    seen, runners, _ = calls
    data = run_bench(tiny_chat, tmp_path, "--turns", "all", "--methods", ",".join(("hf", *ENGINE)))
    records = data["records"]
    assert len(records) == 4 * TURNS
    for r in records:
        if r["method"] != "vanilla":  # EAGLE's answers equal vanilla's, so the later prompts are equal too
            assert r["identical_to_vanilla"] is True and r["not_comparable_to_vanilla"] is False, r
        if r["method"] != "hf":
            assert r["identical_to_hf"] is True, r
        assert r["prefill_s"] > 0 and r["cached_tokens"] is not None
        if r["method"] == "hf":
            assert r["cached_tokens"] == 0  # generate keeps nothing between calls
        elif r["turn"] == 1:
            assert r["cached_tokens"] == 0
        else:  # the whole earlier turn's prompt came from the kept cache
            before = next(p for p in records if p["method"] == r["method"] and p["question_id"] == r["question_id"]
                          and p["turn"] == r["turn"] - 1)  # fmt: skip
            assert before["prompt_tokens"] <= r["cached_tokens"] < r["prompt_tokens"], r
        if r["new_tokens"] > 1:
            assert r["decode_tokens_per_s"] == pytest.approx((r["new_tokens"] - 1) / (r["seconds"] - r["prefill_s"]))
    for entry in data["turns"]:
        for name in ENGINE[1:]:
            m = entry["methods"][name]
            n = len([q for q in QUESTIONS if len(q["turns"]) >= entry["turn"]])
            assert m["identical_to_vanilla"] == f"{n}/{n}" and m["not_comparable_to_vanilla"] == 0
        cached = entry["methods"]["vanilla"]["mean_cached_tokens"]
        assert cached == 0 if entry["turn"] == 1 else cached > 0
    # a warm turn gives exactly what a cold start of the same prompt gives
    for name in ("vanilla", "eagle"):
        name_, ids, conversation, out = next(c for c in timed_calls(seen) if c[0] == name and c[2] and c[2][1] == 81
                                             and c[3].cached)  # fmt: skip
        assert runners[name](ids).tokens == out.tokens
    table = (tmp_path / "bench.md").read_text()
    assert "| turn | method | answers | tokens/s | speedup vs vanilla |" in table
    assert "| 3 | eagle | 1 |" in table and "| 2 | vanilla | 2 |" in table
    assert "every turn, each method after its own earlier answers" in table


def test_first_turns_by_default_without_kept_caches(tiny_chat, tmp_path, calls):
    seen, _, _ = calls
    data = run_bench(tiny_chat, tmp_path, "--methods", "vanilla,eagle")
    assert all(c[2] is None for c in seen)  # no conversation kept
    assert [r["turn"] for r in data["records"]] == [1] * 4 and data["settings"]["turns"] == "first"
    assert all(r["cached_tokens"] == 0 and r["prefill_s"] > 0 for r in data["records"])
    assert [e["turn"] for e in data["turns"]] == [1]
    assert "(first turns)" in (tmp_path / "bench.md").read_text()


def out(tokens, seconds=1.0, prefill_s=0.2, cached=0):
    return Output(tokens, seconds, len(tokens), 0, 0, cached, prefill_s)


def test_a_turn_after_different_answers_is_not_comparable():
    prompt = Prompt(7, "x", [0, 3, 4])
    first = bench.turn_records(prompt, 1, {"vanilla": [0, 3, 4], "eagle": [0, 3, 4]},
                               {"vanilla": out([5, 6, 1]), "eagle": out([5, 7, 1])}, greedy=True)  # fmt: skip
    second = bench.turn_records(prompt, 2, {"vanilla": [0, 3, 4, 5, 6, 9], "eagle": [0, 3, 4, 5, 7, 9]},
                                {"vanilla": out([8, 1], cached=4), "eagle": out([8, 1], cached=4)},
                                greedy=True)  # fmt: skip
    eagle = [r for r in first + second if r["method"] == "eagle"]
    assert [r["identical_to_vanilla"] for r in eagle] == [False, None]
    assert [r["not_comparable_to_vanilla"] for r in eagle] == [False, True]
    assert eagle[1]["decode_tokens_per_s"] == pytest.approx(1 / 0.8)
    agg = aggregate(first + second, ["vanilla", "eagle"])
    per_turn = {e["turn"]: e["methods"]["eagle"] for e in agg["turns"]}
    assert per_turn[1]["identical_to_vanilla"] == "0/1" and per_turn[2]["identical_to_vanilla"] is None
    assert per_turn[2]["not_comparable_to_vanilla"] == 1 and per_turn[2]["mean_cached_tokens"] == 4
    assert per_turn[2]["mean_prefill_ms"] == pytest.approx(200.0) and per_turn[2]["mean_prompt_tokens"] == 6
    assert agg["methods"]["eagle"]["not_comparable_to_vanilla"] == 1
    result = {
        "device": "cpu", "date": "today", "questions": 1, "command": "bench", **agg,
        "model": {"base": "b", "head": "h", "dtype": "float32", "eagle3": True},
        "settings": {"questions_from": "q.jsonl", "max_new_tokens": 3, "temperature": 0.0, "total_token": 4,
                     "depth": 2, "top_k": 2, "turns": "all"},
    }  # fmt: skip
    table = markdown(result)
    assert "| 2 | eagle | 1 | 2.0 | 1.00x | 1.00 | 6 | 4 | 200.0 | 1.2 | – (1 not comparable) |" in table
    assert "every turn, each method after its own earlier answers: 2 answers per method" in table
