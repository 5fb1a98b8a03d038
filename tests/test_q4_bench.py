"""The bench at a GGUF's precision (`--weights q4_1`): our methods on the GGUF's blocks, EAGLE's answers counted
identical to our vanilla's (`identical_to_vanilla`), the bytes read per token at that precision."""

import json

import pytest
import torch
from bench_fixtures import QUESTIONS, TEMPLATE
from q4_fixtures import quantized_tiny_base
from tiny import random_draft, save_base
from transformers import AutoTokenizer

from eagle.evaluation import bench
from eagle.kernels import panel_kernel

needs_kernel = pytest.mark.skipif(
    not panel_kernel.available(), reason=f"panel kernel: {panel_kernel._state.get('why')}"
)


@pytest.fixture
def quantized_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))  # the checked blocks, the tuner's timings
    base = quantized_tiny_base(tmp_path / "tiny.gguf", layers=4)
    save_base(base, str(tmp_path / "base"))  # config.json names the GGUF
    tok = AutoTokenizer.from_pretrained(tmp_path / "base")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp_path / "base")
    random_draft(base, str(tmp_path / "head"))
    (tmp_path / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return tmp_path


def run_bench(folder, *extra):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return bench.main([
            "--base-model-path", str(folder / "base"), "--ea-model-path", str(folder / "head"),
            "--question-file", str(folder / "questions.jsonl"), "--max-new-tokens", "16", "--out", str(folder / "out"),
            "--total-token", "8", "--depth", "3", "--top-k", "3", "--quiet", "--compile", "off", *extra,
        ])  # fmt: skip
    finally:
        torch.set_num_threads(n)


@needs_kernel
def test_the_bench_at_q4_1_counts_eagle_identical_to_vanilla(quantized_folder):
    result = run_bench(quantized_folder, "--weights", "q4_1", "--methods", "vanilla,eagle")
    assert result["model"]["weights"] == "q4_1 (28 layers), q8_0 (lm_head)"
    eagle, vanilla = result["methods"]["eagle"], result["methods"]["vanilla"]
    assert eagle["identical_to_vanilla"] == "3/3" and vanilla["identical_to_vanilla"] is None
    assert eagle["mean_accepted_tokens"] > 1.0  # verify passes of several rows ran
    assert vanilla["weight_mb"] < result["floor"]["weight_mb"] / 3  # 4-bit blocks, not float32 weights
    table = (quantized_folder / "out" / "bench.md").read_text()
    assert "Identical to our vanilla (T=0, weights q4_1 (28 layers), q8_0 (lm_head)): eagle 3/3" in table


@needs_kernel
def test_q4_1_weights_for_a_base_without_a_gguf_are_refused_with_the_fix(quantized_folder, capsys):
    config = json.loads((quantized_folder / "base" / "config.json").read_text())
    del config["eagle_weights_gguf"]
    (quantized_folder / "base" / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit):
        run_bench(quantized_folder, "--weights", "q4_1", "--methods", "vanilla")
    err = capsys.readouterr().err
    assert "names none" in err and "--weights fp32" in err
