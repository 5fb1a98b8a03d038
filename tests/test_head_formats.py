"""EAGLE-3 heads written by other producers (speculators/vLLM, SpecForge, ModelOpt, AngelSlim) load and compute what
their producers' layers compute. Each head is written here from the producer's documented config and keys
(eagle/models/head_formats.py); `oracle` restates each producer's layer in plain torch, independently of
eagle/models/draft_head.py."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tiny import random_draft, save_base, tiny_base
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import CheckpointError, read_checkpoint

LAYERS, H, V, VD, Q = 8, 32, 16, 8, 5


@pytest.fixture(scope="module")
def base():
    return tiny_base("llama", layers=LAYERS)


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory):
    """(config, state) of a random EAGLE-3 head in the reference layout, norms made non-trivial."""
    config, state = read_checkpoint(
        random_draft(base, str(tmp_path_factory.mktemp("ref")), eagle3=True, draft_vocab=VD)
    )
    g = torch.Generator().manual_seed(7)
    for k in [k for k in state if k.endswith("norm.weight")]:
        state[k] = 1 + 0.5 * torch.randn(state[k].shape, generator=g)
    return config, state


def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def oracle(state, base, features, ids, *, input_norm=False, fc_norm=False, norm_before_residual=False,
           hidden_input_norm=False, norm_output_fed_back=False, norm_before_lm_head=True):  # fmt: skip
    """One draft step over Q causal positions: (fed-back state [Q, H], logits [Q, VD]); keys in `midlayer.*` form."""
    w = lambda k: state[k].float()  # noqa: E731
    a = features[0]  # [Q, 3H]
    if input_norm:
        a = rms(a, w("input_norm.weight"))
    if fc_norm:
        a = torch.cat([rms(x, w(f"fc_norm.{i}.weight")) for i, x in enumerate(a.chunk(3, -1))], -1)
    h = a @ w("fc.weight").T  # [Q, H]
    e = base.get_input_embeddings().weight[ids[0]]  # [Q, H]
    L = "midlayer."
    hn = rms(rms(h, w(L + "input_layernorm.weight")) if hidden_input_norm else h, w(L + "hidden_norm.weight"))
    x = torch.cat([rms(e, w(L + "input_layernorm.weight")), hn], -1)  # [Q, 2H]
    heads, kv, hd = 4, 2, H // 4
    q = (x @ w(L + "self_attn.q_proj.weight").T).view(Q, heads, hd).transpose(0, 1)[None]
    k = (x @ w(L + "self_attn.k_proj.weight").T).view(Q, kv, hd).transpose(0, 1)[None]
    v = (x @ w(L + "self_attn.v_proj.weight").T).view(Q, kv, hd).transpose(0, 1)[None]
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.arange(Q).float()[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[None], torch.cat([angles, angles], -1).sin()[None]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1).reshape(Q, H)
    r = (hn if norm_before_residual else h) + attn @ w(L + "self_attn.o_proj.weight").T
    m = rms(r, w(L + "post_attention_layernorm.weight"))
    mlp = (F.silu(m @ w(L + "mlp.gate_proj.weight").T) * (m @ w(L + "mlp.up_proj.weight").T)) @ w(
        L + "mlp.down_proj.weight"
    ).T
    out = r + mlp
    normed = rms(out, w("norm.weight"))
    logits = (normed if norm_before_lm_head else out) @ w("lm_head.weight").T
    return (normed if norm_output_fed_back else out), logits


def run_head(base, folder):
    """What our loader makes of `folder`: (fed-back state [Q, H], logits [Q, VD], head)."""
    config, state = read_checkpoint(folder)
    head = load_head(base, config, state)
    torch.manual_seed(0)
    features = torch.randn(1, Q, 3 * H)
    ids = torch.randint(0, V, (1, Q))
    mask = torch.zeros(1, 1, Q, Q).masked_fill(torch.ones(Q, Q).triu(1).bool(), torch.finfo(torch.float32).min)
    with torch.no_grad():
        out = head(features, ids, torch.arange(Q)[None], mask, head.new_cache(8), 0)[0]
        return out, head.logits(out, base.get_output_embeddings()), head, features, ids


def write(folder, config: dict, state: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"))
    return str(folder)


def layer_config(config: dict) -> dict:
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "rms_norm_eps", "hidden_act", "max_position_embeddings")  # fmt: skip
    return {"model_type": "llama", "num_hidden_layers": 1, "head_dim": H // 4, "attention_bias": False,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, **{k: config[k] for k in keep}}  # fmt: skip


def speculators_head(folder, reference, *, norm_before_residual=None, norm_before_fc=False, fc_norm=False,
                     norm_output=False, layer_ids=None):  # fmt: skip
    """The layout `speculators` (0.9) saves and vLLM reads: layers.0.*, the layer's config nested."""
    config, state = reference
    state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    g = torch.Generator().manual_seed(3)
    if norm_before_fc:
        state["input_norm.weight"] = 1 + 0.5 * torch.randn(3 * H, generator=g)
    if fc_norm:
        state.update({f"fc_norm.{i}.weight": 1 + 0.5 * torch.randn(H, generator=g) for i in range(3)})
    state["verifier_lm_head.weight"] = torch.zeros(V, H)  # a training state's extra: ignored
    spec = {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "draft_vocab_size": VD, "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": layer_ids,
        "norm_before_fc": norm_before_fc, "fc_norm": fc_norm, "norm_output": norm_output,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}},
        "transformer_layer_config": layer_config(config),
    }  # fmt: skip
    if norm_before_residual is not None:
        spec["norm_before_residual"] = norm_before_residual
    return write(folder, spec, state)


@pytest.mark.parametrize(
    "switches",
    [dict(norm_before_residual=False), dict(), dict(norm_before_residual=True, norm_before_fc=True),
     dict(norm_before_residual=False, fc_norm=True, norm_output=True)],
    ids=["plain", "absent-norm_before_residual-means-true", "input_norm", "fc_norm-norm_output"],
)  # fmt: skip
def test_speculators_heads_compute_the_speculators_layer(base, reference, tmp_path, switches):
    folder = speculators_head(tmp_path / "s", reference, **switches)
    out, logits, head, features, ids = run_head(base, folder)
    state = {k.replace("layers.0.", "midlayer."): v for k, v in read_checkpoint(folder)[1].items()}
    want_out, want_logits = oracle(
        state, base, features, ids, input_norm=switches.get("norm_before_fc", False),
        fc_norm=switches.get("fc_norm", False), norm_before_residual=switches.get("norm_before_residual", True),
        norm_output_fed_back=switches.get("norm_output", False),
    )  # fmt: skip
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-4)
    assert head.to_target_ids(torch.arange(VD)).tolist() == list(range(0, V, 2))


def test_the_reference_layer_is_the_speculators_layer_with_every_switch_off(base, reference, tmp_path):
    ours = run_head(base, write(tmp_path / "r", *reference))
    theirs = run_head(base, speculators_head(tmp_path / "s", reference, norm_before_residual=False))
    torch.testing.assert_close(ours[0], theirs[0], atol=0, rtol=0)
    want_out, want_logits = oracle(reference[1], base, ours[3], ours[4])
    torch.testing.assert_close(ours[0], want_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours[1], want_logits, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("norm_output", [True, False])
def test_specforge_heads_follow_fc_norm_and_norm_output(base, reference, tmp_path, norm_output):
    """SpecForge's `norm_output` means "norm before lm_head" (default true); `fc_norm.*` is its EAGLE-3.1."""
    config, state = reference
    g = torch.Generator().manual_seed(4)
    state = dict(state, **{f"fc_norm.{i}.weight": 1 + 0.5 * torch.randn(H, generator=g) for i in range(3)})
    forge = dict(config, architectures=["LlamaForCausalLMEagle3"], head_dim=H // 4, attention_bias=False,
                 norm_output=norm_output, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})  # fmt: skip
    out, logits, head, features, ids = run_head(base, write(tmp_path / "f", forge, state))
    want_out, want_logits = oracle(state, base, features, ids, fc_norm=True, norm_before_lm_head=norm_output)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-4)
    assert head.config.base_feature_layers(LAYERS) == (2, 4, 5)  # layer outputs 1, 3, 4 = inputs of 2, 4, 5


@pytest.mark.parametrize("keys", ["layers.0.", "midlayer."])
def test_modelopt_heads_load_with_an_unsorted_d2t_and_their_first_layer_norms(base, reference, tmp_path, keys):
    """ModelOpt: no t2d, no embedding, d2t in frequency order; `layers.0.*` exports (2026-03 on) run the stock
    first layer, which norms h with input_layernorm before hidden_norm; `midlayer.*` exports are the reference's."""
    config, state = reference
    used = torch.tensor([9, 2, 14, 0, 5, 11, 3, 7])  # by frequency, not sorted
    state = {k.replace("midlayer.", keys): v for k, v in state.items() if k != "t2d"}
    state["d2t"] = used - torch.arange(VD)
    opt = dict(config, architectures=["LlamaForCausalLMEagle3"], head_dim=H // 4,
               eagle_config={"use_aux_hidden_state": True, "use_last_layernorm": True,
                             "use_input_layernorm_in_first_layer": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]})  # fmt: skip
    out, logits, head, features, ids = run_head(base, write(tmp_path / "m", opt, state))
    state = {k.replace("layers.0.", "midlayer."): v for k, v in state.items()}
    want_out, want_logits = oracle(state, base, features, ids, hidden_input_norm=keys == "layers.0.")
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-4)
    assert head.to_target_ids(torch.arange(VD)).tolist() == used.tolist()
    assert head.t2d.nonzero().flatten().tolist() == sorted(used.tolist())


def test_angelslim_heads_are_the_reference_layer(base, reference, tmp_path):
    config, state = reference
    angel = dict(config, architectures=["Eagle3LlamaForCausalLM"], target_model_type="qwen3", head_dim=H // 4)
    ours, theirs = (
        run_head(base, write(tmp_path / "r", *reference)),
        run_head(base, write(tmp_path / "a", angel, state)),
    )
    torch.testing.assert_close(theirs[1], ours[1], atol=0, rtol=0)


def test_speculators_layer_ids_pick_the_base_hidden_states_and_decoding_stays_lossless(base, reference, tmp_path):
    save_base(base, str(tmp_path / "base"))
    folder = speculators_head(tmp_path / "s", reference, layer_ids=[1, 3, 6], norm_before_residual=True)
    model = EaModel.from_pretrained(
        str(tmp_path / "base"), folder, dtype=torch.float32, total_token=12, depth=3, top_k=4
    )
    assert model.base.feature_layers == (1, 3, 6)  # speculators ids count layer inputs: used as given
    ids = torch.tensor([[3, 4, 5, 9]])
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                        min_new_tokens=24, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert model.eagenerate(ids, max_new_tokens=24, stop_token_ids=[]).tolist() == ref.tolist()


def test_multi_layer_heads_are_refused_naming_the_layers(base, reference, tmp_path):
    config, state = read_checkpoint(speculators_head(tmp_path / "s", reference))
    state.update({k.replace("layers.0.", "layers.1."): v for k, v in state.items() if k.startswith("layers.0.")})
    with pytest.raises(CheckpointError, match=r"draft layers \[0, 1\]: only one-layer"):
        load_head(base, config, state)


def test_layer_ids_beyond_the_base_are_refused(base, reference, tmp_path):
    save_base(base, str(tmp_path / "base"))
    folder = speculators_head(tmp_path / "s", reference, layer_ids=[2, 4, LAYERS])
    with pytest.raises(ValueError, match=rf"base hidden states \[2, 4, {LAYERS}\] but the base has {LAYERS} layers"):
        EaModel.from_pretrained(str(tmp_path / "base"), folder, dtype=torch.float32)


def test_feature_norms_named_in_the_config_without_weights_get_unit_weights(base, reference, tmp_path):
    """The speculators converter writes norm_before_fc / fc_norm: true but drops their weights; vLLM serves such a
    head with unit-weight norms, and so do we (the normalisation itself stays)."""
    folder = speculators_head(tmp_path / "s", reference, norm_before_residual=False)
    config, state = read_checkpoint(folder)
    for switch, oracle_switch in (("norm_before_fc", "input_norm"), ("fc_norm", "fc_norm")):
        head = load_head(base, dict(config, **{switch: True}), state)
        out, logits, _, features, ids = run_head(base, folder)
        with torch.no_grad():
            mask = torch.zeros(1, 1, Q, Q).masked_fill(torch.ones(Q, Q).triu(1).bool(), torch.finfo(torch.float32).min)
            got = head(features, ids, torch.arange(Q)[None], mask, head.new_cache(8), 0)[0]
        unit = {k.replace("layers.0.", "midlayer."): v for k, v in state.items()}
        unit.update({"input_norm.weight": torch.ones(3 * H), **{f"fc_norm.{i}.weight": torch.ones(H) for i in range(3)}})
        want, _ = oracle(unit, base, features, ids, **{oracle_switch: True})
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(got, out), f"{switch}: the norm changed nothing"
