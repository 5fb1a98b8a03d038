"""Tiny random models for CPU tests: bases built with `from_config`, drafts saved in the official layouts."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config

from eagle.models.draft_head import DraftConfig, DraftHead

VOCAB = 16  # small enough that random drafts are often accepted


def tiny_base(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 6, **over):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    common.update(over)
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "mixtral":
        cfg = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    elif arch == "llama31":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}  # fmt: skip
        cfg = LlamaConfig(rope_scaling=rope, **common)
    else:
        raise ValueError(arch)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # Sharper logits make greedy paths less chaotic and random drafts more often right.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model


def tiny_tokenizer(vocab: int = VOCAB):
    """A word-level tokenizer over `vocab` ids: id 0 = "<s>", id 1 = "</s>" (eos), then "w2", "w3", ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="w2")


def save_base(model, folder: str, eos: int | None = None) -> str:
    """Save a base model with a tokenizer, loadable by `EaModel.from_pretrained`."""
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    tok = tiny_tokenizer(model.config.vocab_size)
    if eos is None:
        tok.eos_token = None
    tok.save_pretrained(folder)
    return folder


def draft_config(base, eagle3: bool, draft_vocab: int | None = None, bias: bool | None = None, **over) -> dict:
    c = base.config
    d = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "vocab_size": c.vocab_size,
        "torch_dtype": "float32",
    }  # fmt: skip
    if eagle3:
        d["draft_vocab_size"] = draft_vocab or c.vocab_size
    else:
        d["rope_theta"] = 10000.0
    if bias is not None:
        d["bias"] = bias
    d.update(over)
    return d


def random_draft(base, folder: str, eagle3: bool = False, draft_vocab: int | None = None, bias: bool | None = None,
                 fmt: str = "safetensors", seed: int = 1, embed: bool | None = None, **over) -> str:  # fmt: skip
    """Save a random draft in the reference layout (EAGLE-1/2 stores embed_tokens; EAGLE-3 stores d2t/t2d, and
    its own random embed_tokens only with embed=True)."""
    torch.manual_seed(seed)
    d = draft_config(base, eagle3, draft_vocab, bias, **over)
    cfg = DraftConfig.from_dict(d, eagle3)
    own = embed if embed is not None else not eagle3
    head = DraftHead(cfg, own_embedding=own)
    state = {k: v.clone().contiguous() for k, v in head.state_dict().items()}
    if own and cfg.hidden_size == base.config.hidden_size:
        state["embed_tokens.weight"] = base.get_input_embeddings().weight.detach().clone()
    elif cfg.draft_vocab_size != cfg.vocab_size:
        used = torch.arange(0, cfg.vocab_size, cfg.vocab_size // cfg.draft_vocab_size)[: cfg.draft_vocab_size]
        state["d2t"] = used - torch.arange(cfg.draft_vocab_size)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[used] = True
        state["t2d"] = t2d
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(d, f)
    if fmt == "safetensors":
        save_file(state, os.path.join(folder, "model.safetensors"))
    else:
        torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    return folder
