"""Bases whose forward processes the lm_head's logits (Gemma-2 soft-capping, Granite's logits_scaling, ...): the
engine applies the same processing (eagle/models/logits.py) wherever it turns hidden states into logits, so greedy
and sampled EAGLE output stay the base's, training targets follow the base's distribution, and a base whose
processing the table does not know is refused when it is loaded."""

import json

import pytest
import torch
import transformers
from lossless_checks import (
    NEW,
    P_VALUE,
    PROMPT,
    PROMPTS,
    VOCAB,
    chi_square_p_value,
    sample_pairs,
)
from tiny import draft_config, random_draft, save_base, tiny_base
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from eagle.decoding.verify import SamplingParams
from eagle.model.ea_model import EaModel, load_head
from eagle.models.base import BaseModel
from eagle.models.checkpoint import read_checkpoint
from eagle.models.draft_head import DraftConfig, DraftHead
from eagle.models.logits import TRANSFORMS, logit_transform
from eagle.train.data import FeatureExtractor
from eagle.train.losses import DraftTrainer
from eagle.train.vocab import draft_vocab

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 512, "eos_token_id": None, "bos_token_id": None, "pad_token_id": None,
         "tie_word_embeddings": False}  # fmt: skip
# model type -> config class, its processing switched on, lm_head gain (raw logits well beyond the processing)
TABLE = {
    "gemma2": ("Gemma2Config", {"head_dim": 8, "final_logit_softcapping": 2.0}, 40.0),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 8, "final_logit_softcapping": 2.0}, 40.0),
    "vaultgemma": ("VaultGemmaConfig", {"head_dim": 8, "final_logit_softcapping": 2.0}, 40.0),
    "nanochat": ("NanoChatConfig", {"final_logit_softcapping": 2.0}, 8.0),
    "granite": ("GraniteConfig", {"logits_scaling": 4.0}, 8.0),
    "granitemoe": ("GraniteMoeConfig", {"logits_scaling": 4.0, "num_local_experts": 2, "num_experts_per_tok": 1}, 8.0),
    "granitemoeshared": ("GraniteMoeSharedConfig", {"logits_scaling": 4.0, "num_local_experts": 2,
                                                    "num_experts_per_tok": 1, "shared_intermediate_size": 32}, 8.0),
    "cohere": ("CohereConfig", {"logit_scale": 0.25}, 8.0),
    "cohere2": ("Cohere2Config", {"logit_scale": 0.25}, 8.0),
    "hyperclovax": ("HyperCLOVAXConfig", {"logits_scaling": 0.25}, 8.0),
    "minicpm3": ("MiniCPM3Config", {"num_key_value_heads": 4, "dim_model_base": 8, "q_lora_rank": 16,
                                    "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                                    "v_head_dim": 8}, 8.0),
}  # fmt: skip
ARCHS = ["gemma2", "granite"]  # the end-to-end tests: soft-capping and a scale


def tiny(arch: str, vocab: int = 16, layers: int = 4, seed: int = 0):
    cls, processing, gain = TABLE[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, cls)(vocab_size=vocab, num_hidden_layers=layers, **{**SMALL, **processing})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(gain)
    return model


def raw_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T, V]: the lm_head over the decoder's output, without the model's processing."""
    return model.get_output_embeddings()(model.get_decoder()(ids).last_hidden_state)


@pytest.mark.parametrize("arch", list(TABLE))
def test_the_table_reproduces_each_forward(arch):
    """Attribute names and formulas as in the installed transformers: lm_head + the table's transform is the
    forward's output (float32: to rounding; bfloat16: the self-check passes), and it is not the raw lm_head's."""
    model = tiny(arch, layers=2)
    assert model.config.model_type == arch and logit_transform(model.config) is not None
    ids = torch.tensor([[1, 5, 9, 3, 12]])
    with torch.no_grad():
        own, raw = model(ids).logits, raw_logits(model, ids)
        ours = BaseModel(model, eagle3=False).logits(model.get_decoder()(ids).last_hidden_state)  # self-check passes
    assert torch.allclose(ours, own, rtol=1e-5, atol=1e-6)
    assert (raw - own).abs().max() > 0.1 * own.abs().max()  # the processing matters for this model
    BaseModel(model.to(torch.bfloat16), eagle3=False)


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_eagle_equals_hf_generate(tmp_path, arch, eagle3):
    base = tiny(arch, layers=6)
    save_base(base, str(tmp_path / "base"))
    draft = random_draft(base, str(tmp_path / "d"), eagle3=eagle3, draft_vocab=12 if eagle3 else None)
    model = EaModel.from_pretrained(str(tmp_path / "base"), draft, dtype=torch.float32)
    assert model.base.logit_transform is not None
    new_tokens = rounds = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                            min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)  # fmt: skip
        out, n, r = model.eagenerate(ids, max_new_tokens=NEW, stop_token_ids=[], log=True)
        assert out.tolist() == ref.tolist()
        new_tokens, rounds = new_tokens + n, rounds + r + 1
    assert new_tokens / rounds > 1.05, "no drafted token was accepted"


def pair_distribution(logits_of) -> torch.Tensor:
    """[V, V] probability of the 2nd and 3rd generated tokens under plain sampling at temperature 1 from the
    logits `logits_of` ([B, T] ids -> [B, T, V]) gives."""
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        p1 = logits_of(prompt)[0, -1].float().softmax(-1)  # [V]
        seq2 = torch.cat([prompt.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], 1)  # [V, 4]
        p2 = logits_of(seq2)[:, -1].float().softmax(-1)  # [V(x1), V(x2)]
        seq3 = torch.cat([seq2.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], 1)
        p3 = logits_of(seq3)[:, -1].float().softmax(-1).view(VOCAB, VOCAB, VOCAB)  # [x1, x2, x3]
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # [x2, x3]


@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_tokens_follow_the_processed_distribution(tmp_path, arch):
    """Samples fit softmax(processed logits) and reject softmax(raw logits): without the processing, this
    same check would fail."""
    base = tiny(arch, vocab=VOCAB, seed=5)
    config, state = read_checkpoint(random_draft(base, str(tmp_path / "d"), seed=2))
    model = EaModel(base, load_head(base, config, state), None, total_token=16, depth=3, top_k=4)
    processed = pair_distribution(lambda ids: base(ids).logits)
    raw = pair_distribution(lambda ids: raw_logits(base, ids))
    assert 0.5 * (processed - raw).abs().sum() > 0.1, "the processing hardly changes the distribution"

    counts = sample_pairs(model, SamplingParams(1.0), n=500, seed=0)
    n = counts.sum()
    tv = 0.5 * (counts / n - processed).abs().sum()
    tv_noise = 0.5 * (2 * processed * (1 - processed) / (torch.pi * n)).sqrt().sum()  # TV of sampling noise
    p = chi_square_p_value(counts, processed)
    assert p > P_VALUE, f"EAGLE sampling deviates from the base distribution (p={p:.2e}, TV={tv:.3f})"
    assert tv < 1.5 * tv_noise, f"TV {tv:.3f} is beyond sampling noise ({tv_noise:.3f})"
    assert chi_square_p_value(counts, raw) < P_VALUE, "the samples do not tell processed from raw logits"
    assert sample_pairs.tokens_per_forward > 1.1, "drafts were hardly accepted: the test would not see a bias"


def test_a_forward_processing_logits_unknown_to_the_table_is_refused_at_load(tmp_path, monkeypatch):
    base = tiny_base("llama", layers=2)
    save_base(base, str(tmp_path / "base"))
    draft = random_draft(base, str(tmp_path / "d"))
    forward = LlamaForCausalLM.forward

    def scaled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    monkeypatch.setattr(LlamaForCausalLM, "forward", scaled)
    refusal = r"LlamaForCausalLM \(model_type 'llama'\) is not supported.*differ by 100\.0%.*eagle/models/logits\.py"
    with pytest.raises(ValueError, match=refusal):
        EaModel.from_pretrained(str(tmp_path / "base"), draft, dtype=torch.float32)


def test_soft_capping_unknown_to_the_table_is_refused(monkeypatch):
    model = tiny("gemma2", layers=2)
    monkeypatch.delitem(TRANSFORMS, "gemma2")
    with pytest.raises(ValueError, match="Gemma2ForCausalLM .* is not supported"):
        BaseModel(model, eagle3=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_training_targets_are_the_base_processed_logits(arch):
    """Built as `fit` builds it, from a cache's meta (the text config as JSON and the model type), the transform
    turns the cached hidden states into the base's own logits: EAGLE-1/2 over the vocabulary, EAGLE-3 over the
    draft vocabulary. The cached greedy token is the argmax of those logits."""
    model = tiny(arch)
    meta = json.loads(json.dumps({"base_config": model.config.get_text_config().to_dict(),
                                  "base_model_type": model.config.model_type}, default=str))  # fmt: skip
    transform = logit_transform(meta["base_config"], meta["base_model_type"])
    ids = torch.tensor([[1, 5, 9, 3, 12, 7]])
    with torch.no_grad():
        own = model(ids).logits[0]  # [T, V]
        hidden = model.get_decoder()(ids).last_hidden_state[0]  # [T, H]
        assert torch.equal(FeatureExtractor(model, eagle3=False)(ids[0])["argmax"], own.argmax(-1))
        embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        for eagle3 in (False, True):
            head = DraftHead(DraftConfig.from_dict(draft_config(model, eagle3, 12), eagle3), own_embedding=False)
            if eagle3:
                d2t, t2d = draft_vocab(torch.arange(16).flip(0), 12)  # ids 0..11
                head.d2t.copy_(d2t), head.t2d.copy_(t2d)
            trainer = DraftTrainer(head, embed, lm_head, logit_transform=transform)
            rows = head.to_target_ids(torch.arange(12)) if eagle3 else torch.arange(16)
            assert torch.allclose(trainer.base_logits(hidden), own[:, rows], rtol=1e-5, atol=1e-5)
            assert not torch.allclose(DraftTrainer(head, embed, lm_head).base_logits(hidden), own[:, rows], atol=0.1)
