"""The benchmark tool end to end on a tiny model: JSON fields, losslessness check, table and plot written."""

import json

import pytest
import torch
from bench_fixtures import QUESTIONS, tiny_model  # noqa: F401  (the module fixture)
from tiny import save_base, tiny_base

from eagle.evaluation import bench, report

METHODS = ["hf", "hf_pld", "vanilla", "eagle", "eagle_static"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads, and OpenMP threads crawl when other jobs load the CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run_bench(folder, out, *extra):
    argv = [
        "--base-model-path", str(folder / "base"), "--ea-model-path", str(folder / "head"),
        "--question-file", str(folder / "questions.jsonl"), "--max-new-tokens", "16", "--out", str(out),
        "--total-token", "12", "--depth", "4", "--top-k", "4", "--quiet", *extra,
    ]  # fmt: skip
    return bench.main(argv)


def test_bench_end_to_end_writes_json_table_and_plot(tiny_model, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    result = run_bench(tiny_model, out, "--methods", ",".join(METHODS), "--json", str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    assert data == json.loads(json.dumps(result))
    for key in ("device", "model", "questions", "identical_to_hf", "methods", "date", "command", "settings"):
        assert key in data
    assert data["questions"] == 3 and data["identical_to_hf"] == "3/3"
    assert list(data["methods"]) == METHODS
    for name, m in data["methods"].items():
        for key in ("tokens_per_s", "speedup_vs_hf", "mean_accepted_tokens", "identical_to_hf", "categories"):
            assert key in m
        assert m["tokens_per_s"] > 0 and m["new_tokens"] == data["methods"]["hf"]["new_tokens"]
        assert set(m["categories"]) == {"writing", "reasoning"}
        assert m["identical_to_hf"] == (None if name == "hf" else "3/3")
        assert m["x_floor"] == pytest.approx(m["tokens_per_s"] / data["floor"]["tokens_per_s"])
    assert 32 < data["methods"]["hf"]["new_tokens"] < 48  # one answer stopped at </s>, in every method alike
    assert data["methods"]["hf"]["speedup_vs_hf"] == 1.0
    assert data["methods"]["hf"]["mean_accepted_tokens"] is None
    assert data["methods"]["hf_pld"]["mean_accepted_tokens"] is None
    assert data["methods"]["vanilla"]["mean_accepted_tokens"] == 1.0
    for name in ("eagle", "eagle_static"):
        assert data["methods"][name]["mean_accepted_tokens"] > 1.0  # the tiny random head does get accepted
    assert len(data["records"]) == 3 * len(METHODS)
    assert (out / "bench.png").stat().st_size > 10_000
    table = (out / "bench.md").read_text()
    assert data["floor"]["bandwidth_gb_s"] > 0 and "Bandwidth floor" in table
    assert "| eagle_static |" in table and "| reasoning |" in table and data["command"] in table
    assert "| eagle |" in capsys.readouterr().out


def test_bench_limit_sampling_label_and_method_errors(tiny_model, tmp_path, capsys):  # noqa: F811
    data = run_bench(tiny_model, tmp_path, "--methods", "hf,eagle", "--limit", "2", "--temperature", "0.8",
                     "--label", "random head")  # fmt: skip
    assert data["questions"] == 2 and data["identical_to_hf"] is None  # outputs are compared only at T=0
    assert data["methods"]["eagle"]["identical_to_hf"] is None
    (tmp_path / "bench.md").unlink()
    report.main([str(tmp_path / "bench.json")])  # re-renders the table and plot from the JSON
    assert (tmp_path / "bench.md").read_text().startswith("**random head**")
    with pytest.raises(SystemExit) as e:
        run_bench(tiny_model, tmp_path, "--methods", "hf,hf_assisted")
    assert e.value.code == 2 and "--assistant-model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_bench(tiny_model, tmp_path, "--methods", "hf,medusa")
    assert "unknown method" in capsys.readouterr().err


def test_hf_assisted_with_an_assistant_model(tiny_model, tmp_path):  # noqa: F811
    save_base(tiny_base("llama", seed=3, layers=2), str(tmp_path / "assistant"))
    data = run_bench(tiny_model, tmp_path, "--limit", "2", "--assistant-model", str(tmp_path / "assistant"))
    assert list(data["methods"]) == ["hf", "hf_pld", "hf_assisted", "vanilla", "eagle", "eagle_static"]
    assert data["methods"]["hf_assisted"]["identical_to_hf"] == "2/2" and data["identical_to_hf"] == "2/2"


def test_missing_default_head_is_reported(monkeypatch, tmp_path, capsys):
    from eagle.chat import model_types as models

    monkeypatch.setattr(models, "DEFAULT_HEAD_DIR", tmp_path / "no-head")
    monkeypatch.setitem(models.MODEL_TYPES, "smollm2", models.ModelType("smollm2", None, str(tmp_path / "no-head"),
                                                                        "chat-template"))  # fmt: skip
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps(QUESTIONS[0]) + "\n")
    with pytest.raises(SystemExit) as e:
        bench.main(["--question-file", str(q), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "default EAGLE-3 head" in err and "--ea-model-path" in err
