"""llama.cpp as a bench peer: the GGUF conversion, llama.cpp's greedy tokens against HF's, the bench rows, and the
one-line message when the optional llama-cpp-python is missing. The tests that run llama.cpp skip without it."""

import json
import sys

import numpy as np
import pytest
import torch
from tiny import random_draft, save_base, tiny_base
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from eagle.evaluation import bench, llamacpp

VOCAB = 64  # a few more ids than tiny's default, so that greedy paths wander
TEMPLATE = "<s>{% for m in messages %} w3 {{ m['content'] }} w4{% endfor %}{% if add_generation_prompt %} w5{% endif %}"
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["w7 w8 w9 w10 w7 w8"]},
    {"question_id": 101, "category": "reasoning", "turns": ["w6 w14 w15 w6 w14 w40 w41"]},
]
PROMPTS = [[0, 5, 9, 12, 7], [0, 3, 33, 60, 21, 21, 8, 4, 5], [0, 17]]


def needs_llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python (the optional extra) is not installed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama with a word-level tokenizer, saved as an HF folder (no EOS: answers run to the limit)."""
    folder = tmp_path_factory.mktemp("llama_cpp") / "base"
    base = tiny_base("llama", seed=5, vocab=VOCAB)
    save_base(base, str(folder))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return base, folder


def hf_greedy(base, ids, n):
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = base.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            generation_config=config)  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_conversion_round_trips_through_transformers_gguf_reader(tiny, tmp_path):
    """F32 holds exactly the HF weights (q/k rows reordered as llama.cpp wants and back); F16 their float16."""
    base, folder = tiny
    for precision in ("F32", "F16"):
        path = llamacpp.convert(folder, tmp_path / f"tiny.{precision}.gguf", precision)
        back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
        want, got = base.state_dict(), back.state_dict()
        assert set(want) == set(got)
        for name, w in want.items():
            w = w.half().float() if precision == "F16" and w.ndim == 2 else w
            assert torch.equal(got[name], w), (precision, name)
    assert not list(tmp_path.glob(".*.part"))  # written under a temporary name, then renamed
    f32 = (tmp_path / "tiny.F32.gguf").stat().st_size
    assert llamacpp.gguf_weight_bytes(tmp_path / "tiny.F32.gguf") < f32 < 1.2 * sum(
        p.numel() * 4 for p in base.parameters()) + 4096  # fmt: skip


def test_bpe_tokenizer_is_written_as_llama_cpp_vocabulary(tmp_path):
    """A byte-level BPE tokenizer (as SmolLM2's) round trips: transformers' GGUF reader tokenizes text the same."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = "The capital of France is Paris. The capital of Italy is Rome; 1234 apples, ünïcode!"
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator([text] * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tok.chat_template = TEMPLATE
    base = tiny_base("llama", vocab=bpe.get_vocab_size(), layers=1)
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    path = llamacpp.convert(tmp_path / "base", tmp_path / "bpe.gguf", "F32", pre="smollm")
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert back(text).input_ids == tok(text).input_ids and len(tok(text).input_ids) < len(text) / 2
    assert back.eos_token_id == tok.eos_token_id and back.chat_template == TEMPLATE


def test_q4_1_only_for_the_default_base_and_not_other_architectures(tiny, tmp_path):
    _, folder = tiny
    with pytest.raises(ValueError, match="default base"):
        llamacpp.gguf_path("llama_cpp_q4_1", str(folder))
    qwen = tmp_path / "qwen"
    save_base(tiny_base("qwen2", vocab=VOCAB), str(qwen))
    with pytest.raises(ValueError, match="convert_hf_to_gguf.py"):
        llamacpp.convert(qwen, tmp_path / "q.gguf")


def test_missing_extra_is_one_line_naming_the_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    with pytest.raises(SystemExit) as e:  # before any model is loaded (the paths do not exist)
        bench.main(["--base-model-path", str(tmp_path / "none"), "--ea-model-path", str(tmp_path / "none"),
                    "--methods", "hf,llama_cpp", "--out", str(tmp_path)])  # fmt: skip
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "pip install llama-cpp-python" in err and "docs/evaluation.md" in err


def test_llama_cpp_f32_greedy_equals_hf_greedy(tiny, tmp_path):
    needs_llama_cpp()
    base, folder = tiny
    path = llamacpp.convert(folder, tmp_path / "tiny.F32.gguf", "F32")
    n = 24
    want = [hf_greedy(base, ids, n) for ids in PROMPTS]
    assert len({tuple(w) for w in want}) == len(want)  # distinct answers: a stale KV cache would show
    run = llamacpp.runner(path, stop_ids=[], max_new_tokens=n, kv_type="F32", n_ctx=128, threads=1)
    for ids, w in [*zip(PROMPTS, want), (PROMPTS[0], want[0])]:  # the first prompt again, after the others
        tokens, seconds, calls = run(ids)
        assert tokens == w and calls == n and seconds > 0
    # stop ids end the answer, the stop token included
    stop = want[1][10]
    tokens, _, calls = llamacpp.runner(path, [stop], n, "F32", 128, 1)(PROMPTS[1])
    assert tokens == want[1][: want[1].index(stop) + 1] and calls == len(tokens)
    with pytest.raises(ValueError, match="n_ctx"):
        run(list(range(120)))


def test_llama_cpp_f32_logits_match_hf(tiny, tmp_path):
    """Every prompt position's logits, not just the argmax: attention and rotary included (F32 both)."""
    llama_cpp = needs_llama_cpp()
    base, folder = tiny
    path = llamacpp.convert(folder, tmp_path / "tiny.F32.gguf", "F32")
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)  # fmt: skip
    ids = PROMPTS[1] + PROMPTS[0]
    llm.eval(ids)
    got = torch.from_numpy(np.array(llm.scores[: len(ids)]))  # (positions, vocab)
    with torch.inference_mode():
        want = base(torch.tensor([ids])).logits[0]
    assert got.shape == want.shape and want.std() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bench_rows_for_llama_cpp_precisions(tiny, tmp_path, monkeypatch):
    needs_llama_cpp()
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))  # converted files go to the cache, not the repo
    base, folder = tiny
    random_draft(base, str(tmp_path / "head"), eagle3=True)
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    data = bench.main([
        "--base-model-path", str(folder), "--ea-model-path", str(tmp_path / "head"), "--quiet",
        "--question-file", str(tmp_path / "q.jsonl"), "--max-new-tokens", "16", "--out", str(tmp_path / "out"),
        "--total-token", "8", "--depth", "3", "--top-k", "3", "--methods", "hf,vanilla,llama_cpp,llama_cpp_f16",
    ])  # fmt: skip
    m = data["methods"]
    assert data["identical_to_hf"] == "2/2"  # vanilla's verdict; the peers are reported per row only
    assert m["llama_cpp"]["identical_to_hf"] == "2/2" and m["llama_cpp"]["agreement_with_hf"] == 1.0
    assert m["llama_cpp"]["new_tokens"] == m["hf"]["new_tokens"] == 32 and m["llama_cpp"]["mean_accepted_tokens"] == 1
    assert 0 <= m["llama_cpp_f16"]["agreement_with_hf"] <= 1 and m["hf"]["agreement_with_hf"] is None
    assert "GGUF F32" in data["method_labels"]["llama_cpp"] and "GGUF F16" in data["method_labels"]["llama_cpp_f16"]
    assert m["llama_cpp_f16"]["weight_mb"] < 0.6 * m["llama_cpp"]["weight_mb"]  # matrices in half the bytes
    assert m["llama_cpp_f16"]["x_own_floor"] == pytest.approx(
        m["llama_cpp_f16"]["tokens_per_s"] / m["llama_cpp_f16"]["own_floor_tokens_per_s"])  # fmt: skip
    assert sorted(p.name.split(".")[-2] for p in (tmp_path / "cache" / "gguf").glob("*.gguf")) == ["F16", "F32"]
    table = (tmp_path / "out" / "bench.md").read_text()
    assert "| llama_cpp (llama.cpp " in table and "| 100.0% |" in table and "own floor" in table
    assert np.isfinite(m["llama_cpp"]["tokens_per_s"])


def test_q4_1_runs_for_the_default_read_at_its_ggufs_precision(monkeypatch, tmp_path):
    """--weights q4_1 loads the default from a folder whose config names its GGUF: llama_cpp_q4_1 runs that file."""
    from eagle.default_model import GGUF_CONFIG_KEY
    from eagle.fetch import SMOLLM2_GGUF

    (tmp_path / "config.json").write_text(json.dumps({GGUF_CONFIG_KEY: str(SMOLLM2_GGUF.cached_path)}))
    monkeypatch.setattr(llamacpp, "fetch_wheel_member", lambda spec, progress: spec.cached_path)  # no download
    assert llamacpp.gguf_path("llama_cpp_q4_1", str(tmp_path)) == SMOLLM2_GGUF.cached_path
    (tmp_path / "config.json").write_text(json.dumps({GGUF_CONFIG_KEY: str(tmp_path / "other.gguf")}))
    with pytest.raises(ValueError, match="default base"):
        llamacpp.gguf_path("llama_cpp_q4_1", str(tmp_path))
