"""Aggregation of benchmark records: tokens/s, speedups, mean accepted length, per category, identical counts."""

import pytest

from eagle.evaluation.bench import _first_difference
from eagle.evaluation.methods import parse_methods
from eagle.evaluation.report import aggregate, markdown


def rec(qid, cat, method, new, seconds, forwards=None, identical=None, first_difference=None):
    return {"question_id": qid, "category": cat, "method": method, "new_tokens": new, "seconds": seconds,
            "forwards": forwards, "identical_to_hf": identical, "first_difference": first_difference}  # fmt: skip


RECORDS = [
    rec(1, "writing", "hf", 100, 10.0), rec(1, "writing", "vanilla", 100, 8.0, 100, True),
    rec(1, "writing", "eagle", 100, 4.0, 40, True),
    rec(2, "writing", "hf", 50, 5.0), rec(2, "writing", "vanilla", 50, 4.0, 50, True),
    rec(2, "writing", "eagle", 50, 1.0, 10, False, 30),
    rec(3, "math", "hf", 20, 4.0), rec(3, "math", "vanilla", 20, 2.0, 20, True),
    rec(3, "math", "eagle", 20, 1.0, 5, True),
]  # fmt: skip


def test_totals_rates_and_speedups():
    agg = aggregate(RECORDS, ["hf", "vanilla", "eagle"])
    hf, vanilla, eagle = (agg["methods"][m] for m in ("hf", "vanilla", "eagle"))
    assert hf["tokens_per_s"] == pytest.approx(170 / 19) and eagle["tokens_per_s"] == pytest.approx(170 / 6)
    assert hf["speedup_vs_hf"] == 1.0 and eagle["speedup_vs_hf"] == pytest.approx(19 / 6)
    assert vanilla["speedup_vs_hf"] == pytest.approx(19 / 14) and eagle["speedup_vs_vanilla"] == pytest.approx(14 / 6)
    # mean accepted tokens per base forward = sum(new) / sum(forwards), never the mean of per-question ratios
    assert eagle["mean_accepted_tokens"] == pytest.approx(170 / 55) and vanilla["mean_accepted_tokens"] == 1.0
    assert hf["mean_accepted_tokens"] is None and hf["forwards"] is None
    # the reference's speed.py: mean of per-question tokens/s, divided
    assert eagle["speedup_vs_hf_reference_style"] == pytest.approx(((25 + 50 + 20) / 3) / ((10 + 10 + 5) / 3))
    assert (eagle["new_tokens"], eagle["seconds"], eagle["questions"]) == (170, 6.0, 3)


def test_per_category_and_identical_counts():
    agg = aggregate(RECORDS, ["hf", "vanilla", "eagle"])
    assert agg["categories"] == ["writing", "math"]
    writing = agg["methods"]["eagle"]["categories"]["writing"]
    math = agg["methods"]["eagle"]["categories"]["math"]
    assert writing["speedup_vs_hf"] == pytest.approx((150 / 5) / (150 / 15)) and writing["identical_to_hf"] == "1/2"
    assert math["speedup_vs_hf"] == pytest.approx(20 / 5) and math["mean_accepted_tokens"] == 4.0
    assert agg["methods"]["eagle"]["identical_to_hf"] == "2/3" and agg["methods"]["vanilla"]["identical_to_hf"] == "3/3"
    assert agg["methods"]["hf"]["identical_to_hf"] is None
    assert agg["identical_to_hf"] == "2/3"  # question 2 fails: one of its methods differs from hf


def test_agreement_with_hf_and_peers_outside_the_overall_verdict():
    """Agreement = hf tokens reproduced before the first difference; llama.cpp rows do not sway the overall count."""
    peer = [rec(1, "writing", "llama_cpp", 100, 2.0, 100, True), rec(2, "writing", "llama_cpp", 45, 1.0, 45, False, 5),
            rec(3, "math", "llama_cpp", 20, 1.0, 20, False, None)]  # fmt: skip
    agg = aggregate(RECORDS + peer, ["hf", "vanilla", "eagle", "llama_cpp"])
    m = agg["methods"]
    assert m["eagle"]["agreement_with_hf"] == pytest.approx((100 + 30 + 20) / 170)
    assert m["vanilla"]["agreement_with_hf"] == 1.0 and m["hf"]["agreement_with_hf"] is None
    assert m["llama_cpp"]["agreement_with_hf"] is None  # a differing record without its first difference
    assert m["llama_cpp"]["categories"]["writing"]["agreement_with_hf"] == pytest.approx((100 + 5) / 150)
    assert m["llama_cpp"]["identical_to_hf"] == "1/3" and agg["identical_to_hf"] == "2/3"  # as without the peer


def test_without_hf_there_is_no_speedup_vs_hf_and_no_check():
    agg = aggregate([r for r in RECORDS if r["method"] != "hf"], ["vanilla", "eagle"])
    eagle = agg["methods"]["eagle"]
    assert eagle["speedup_vs_hf"] is None and eagle["speedup_vs_vanilla"] == pytest.approx(14 / 6)


def test_markdown_table_lists_methods_and_categories():
    agg = aggregate(RECORDS, ["hf", "vanilla", "eagle"])
    result = {
        "device": "cpu", "date": "today", "questions": 3, "command": "python -m eagle.evaluation.bench --limit 3",
        "model": {"base": "b", "head": "h", "dtype": "float32", "eagle3": True}, **agg,
        "settings": {"questions_from": "q.jsonl", "max_new_tokens": 8, "temperature": 0.0, "total_token": 60,
                     "depth": 7, "top_k": 10},
    }  # fmt: skip
    text = markdown(result)
    assert "| eagle | 28.3 | – | 3.17x | 3.09 | 2/3 | 88.2% | 170 | 6.00 |" in text
    assert "| math | 1.00x | 2.00x (1.00) | 4.00x (4.00) |" in text
    assert "`python -m eagle.evaluation.bench --limit 3`" in text


def test_method_list_parsing_and_first_difference():
    assert parse_methods("", False) == ["hf", "hf_pld", "vanilla", "eagle", "eagle_static"]
    assert parse_methods("", True)[2] == "hf_assisted"
    assert parse_methods("eagle, hf", False) == ["eagle", "hf"]
    for bad in ("hf,foo", "hf,hf", "hf_assisted"):
        with pytest.raises(ValueError):
            parse_methods(bad, False)
    assert _first_difference([1, 2, 3], [1, 2, 3]) is None
    assert _first_difference([1, 5, 3], [1, 2, 3]) == 1 and _first_difference([1, 2], [1, 2, 3]) == 2
