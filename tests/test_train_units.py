"""Draft vocabulary, export layout, and the unrolled (training-time test) forward against the engine's drafting."""

import json

import pytest
import torch
from safetensors import safe_open

from eagle.models.checkpoint import build_draft_head, read_checkpoint
from eagle.models.draft_head import DraftConfig, DraftHead
from eagle.models.masks import additive_mask
from eagle.train.export import draft_config, export_head
from eagle.train.fit import epoch_batches, lr_lambda, make_batches
from eagle.train.losses import DraftTrainer
from eagle.train.ttt import chain_length, live_positions, shift, unrolled_forward
from eagle.train.vocab import coverage, draft_vocab, token_counts, used_ids

BASE = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 50, "rms_norm_eps": 1e-5, "hidden_act": "silu", "max_position_embeddings": 256,
        "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}, "bos_token_id": 1,
        "eos_token_id": 2}  # fmt: skip


def test_draft_vocab_most_frequent_sorted():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = draft_vocab(counts, 4)
    assert used_ids(d2t).tolist() == [0, 2, 3, 5]  # the 4 most frequent, ascending
    assert d2t.tolist() == [0, 1, 1, 2] and d2t.dtype == torch.long
    assert t2d.tolist() == [True, False, True, True, False, True, False, False] and t2d.dtype == torch.bool
    assert coverage(counts, t2d) == pytest.approx(30 / 34)
    d2t, t2d = draft_vocab(counts, 100)  # capped at the vocabulary: identity
    assert d2t.tolist() == [0] * 8 and t2d.all()


def test_draft_vocab_ties_and_unseen_ids_are_deterministic():
    d2t, _ = draft_vocab(torch.tensor([0, 2, 0, 2, 0]), 3)
    assert used_ids(d2t).tolist() == [0, 1, 3]  # the two seen ids, then the lowest unseen


def test_token_counts_only_masked_positions():
    ids = torch.tensor([3, 3, 4, 5])
    mask = torch.tensor([False, True, True, False])
    assert token_counts([(ids, mask)], 6).tolist() == [0, 0, 0, 1, 1, 0]


@pytest.mark.parametrize("recipe", ["eagle3", "eagle1"])
def test_export_layout(tmp_path, recipe):
    eagle3 = recipe == "eagle3"
    config = draft_config(BASE, recipe, draft_vocab_size=20, intermediate_size=48, bias=True)
    head = DraftHead(DraftConfig.from_dict(config, eagle3), own_embedding=False)
    if eagle3:
        d2t, t2d = draft_vocab(torch.arange(50).flip(0), 20)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    embedding = torch.randn(50, 32)
    export_head(head, config, tmp_path, "fp16", None if eagle3 else embedding)

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["model_type"] == "llama" and cfg["torch_dtype"] == "float16"
    assert cfg["rope_theta"] == 50000.0 and cfg["head_dim"] == 8 and cfg["tie_word_embeddings"] is False
    assert cfg["intermediate_size"] == 48 and cfg["vocab_size"] == 50
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    layer.append("post_attention_layernorm.weight")
    if eagle3:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 20
        assert "bias" not in cfg  # vLLM / SGLang would read it as o_proj / fc biases
        expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
        expected |= {f"midlayer.{k}" for k in layer + ["input_layernorm.weight", "hidden_norm.weight"]}
        assert set(tensors) == expected
        assert tensors["fc.weight"].shape == (32, 96) and tensors["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
        assert tensors["lm_head.weight"].shape == (20, 32)
        assert tensors["d2t"].dtype == torch.long and tensors["t2d"].dtype == torch.bool
        assert tensors["t2d"].shape == (50,) and torch.equal(tensors["d2t"], head.d2t)
    else:
        assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["bias"] is True and "draft_vocab_size" not in cfg
        expected = {"fc.weight", "fc.bias", "embed_tokens.weight"} | {f"layers.0.{k}" for k in layer}
        assert set(tensors) == expected
        assert tensors["fc.weight"].shape == (32, 64)
        assert torch.equal(tensors["embed_tokens.weight"], embedding.half())
    assert all(v.dtype == torch.float16 for k, v in tensors.items() if k not in ("d2t", "t2d"))

    # The engine's loader accepts it and rebuilds the same head.
    config2, state = read_checkpoint(str(tmp_path))
    loaded = build_draft_head(config2, state, torch.nn.Embedding(50, 32), 32, 50)
    assert loaded.eagle3 == eagle3
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.half() if v.is_floating_point() else v), k


def _head(eagle3: bool, dtype=torch.double, draft_vocab_size=None) -> tuple[DraftHead, torch.nn.Embedding]:
    torch.manual_seed(0)
    config = draft_config(BASE, "eagle3" if eagle3 else "eagle1", draft_vocab_size, intermediate_size=48)
    head = DraftHead(DraftConfig.from_dict(config, eagle3), own_embedding=False).to(dtype)
    embed = torch.nn.Embedding(50, 32).to(dtype)
    head.share_embedding(embed)
    return head, embed


@pytest.mark.parametrize("eagle3", [True, False])
def test_unrolled_forward_matches_engine_drafting(eagle3):
    """Step k of the chain that starts at j equals what the engine computes when it drafts on top of the
    committed positions 0..j with its cache: the training-time test sees exactly the inference context."""
    head, embed = _head(eagle3)
    T, K = 12, 4
    feats = torch.randn(1, T, 96 if eagle3 else 32, dtype=torch.double)
    ids = torch.randint(0, 50, (1, T))
    outs = unrolled_forward(head, embed, feats, ids, K)
    for j in range(T - K - 1):
        cache, n = head.new_cache(64), j + 1
        causal = additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), torch.double)
        out = head(feats[:, :n], ids[:, 1 : n + 1], torch.arange(n)[None], causal, cache, 0)[:, j : j + 1]
        torch.testing.assert_close(out[0, 0], outs[0][0, j], rtol=0, atol=1e-12)
        for k in range(1, K):  # chain step k: position j + k, sees 0..j and its k ancestors (cache rows n..n+k-1)
            allowed = additive_mask(torch.ones(1, n + k, dtype=torch.bool), torch.double)
            out = head(out, ids[:, j + k + 1 : j + k + 2], torch.tensor([[j + k]]), allowed, cache, n + k - 1)
            torch.testing.assert_close(out[0, 0], outs[k][0, j], rtol=0, atol=1e-12)


def test_unrolled_forward_batch_padding_does_not_leak():
    head, embed = _head(True)
    feats = torch.randn(2, 10, 96, dtype=torch.double)
    ids = torch.randint(1, 50, (2, 10))
    feats[1, 6:] = 0
    ids[1, 6:] = 0
    full = unrolled_forward(head, embed, feats, ids, 3)
    alone = unrolled_forward(head, embed, feats[1:, :6], ids[1:, :6], 3)
    for k in range(3):  # positions whose inputs lie inside the sequence agree
        torch.testing.assert_close(full[k][1, : 6 - k - 1], alone[k][0, : 6 - k - 1], rtol=0, atol=1e-12)


def test_shift_live_positions_and_chain_length():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift(x, 1).tolist() == [[2, 3, 4, 0]] and shift(x, 5).tolist() == [[0, 0, 0, 0]]
    mask = torch.tensor([[False, True, True, True, True, False]])
    assert live_positions(mask, torch.tensor([5]), 0).tolist() == [[True, True, True, False, False, False]]
    assert live_positions(mask, torch.tensor([5]), 1).tolist() == [[True, True, False, False, False, False]]
    ok = [torch.tensor([[True, True, False]]), torch.tensor([[True, False, True]]), torch.tensor([[True, True, True]])]
    cont = [torch.tensor([[True, True, True]]), torch.tensor([[False, True, True]]), torch.ones(1, 3, dtype=torch.bool)]
    start = torch.tensor([[True, True, True]])
    # chain 0: ok, ok but the data's token differs from the greedy one after step 1 -> 2; chain 1: 1; chain 2: 0
    assert chain_length(ok, cont, start).tolist() == [[2, 1, 0]]


@pytest.mark.parametrize("eagle3", [True, False])
def test_trainer_loss_and_gradients(eagle3):
    head, embed = _head(eagle3, torch.float32, draft_vocab_size=30)
    if eagle3:
        d2t, t2d = draft_vocab(torch.arange(50), 30)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    trainer = DraftTrainer(head, embed.weight.detach(), torch.randn(50, 32), steps=3, noise=0.0 if eagle3 else 0.2)
    B, T = 2, 16
    batch = {"input_ids": torch.randint(0, 50, (B, T)), "loss_mask": torch.rand(B, T) > 0.3,
             "argmax": torch.randint(0, 50, (B, T)), "hidden": torch.randn(B, T, 32),
             "lengths": torch.tensor([T, T - 5])}  # fmt: skip
    batch["features"] = torch.randn(B, T, 96) if eagle3 else batch["hidden"]
    loss, stats = trainer(batch)
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)
    assert trainer.embed.weight.grad is None and trainer.target_head.grad is None  # frozen
    if eagle3:
        assert trainer.target_head.shape == (30, 32) and set(stats) >= {"loss_2", "correct_2", "chain_accepted"}


def test_the_acceptance_objective_is_minus_the_log_of_the_acceptance_chance():
    """objective="accept": -log sum_x min(q, p_T); at T=0 the cross-entropy against the base's greedy token alone,
    at T=1 zero where the draft's distribution is the base's; it trains (the loss falls) like "ce"."""
    torch.manual_seed(0)
    head, embed = _head(True, torch.float32, draft_vocab_size=50)
    head.d2t.zero_(), head.t2d.fill_(True)
    trainer = DraftTrainer(head, embed.weight.detach(), torch.randn(50, 32), steps=2, objective="accept")
    logp = torch.randn(6, 50).log_softmax(-1)
    target = torch.randn(6, 32)
    greedy = trainer.base_logits(target).argmax(-1)
    assert torch.allclose(trainer._accept_loss(logp, trainer.base_logits(target)), -logp.gather(1, greedy[:, None])[:, 0])
    trainer.accept_temperature = 1.0
    same = trainer.base_logits(target).log_softmax(-1)
    assert trainer._accept_loss(same, trainer.base_logits(target)).abs().max() < 1e-5
    assert (trainer._accept_loss(logp, trainer.base_logits(target)) > 0.05).all()
    with pytest.raises(ValueError, match="'ce' or 'accept'"):
        DraftTrainer(head, embed.weight.detach(), torch.randn(50, 32), objective="kl")

    trainer.accept_temperature = 0.0
    B, T = 2, 16
    batch = {"input_ids": torch.randint(0, 50, (B, T)), "loss_mask": torch.ones(B, T, dtype=torch.bool),
             "argmax": torch.randint(0, 50, (B, T)), "hidden": torch.randn(B, T, 32), "lengths": torch.tensor([T, T]),
             "features": torch.randn(B, T, 96)}  # fmt: skip
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(20):
        loss, _ = trainer(batch)
        optimizer.zero_grad(), loss.backward(), optimizer.step()
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


def test_make_batches_respects_token_budget():
    lengths = [5, 50, 7, 33, 12, 40, 8, 100, 3]
    batches = make_batches(lengths, 64, seed=1)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 64 for b in batches)
    assert batches == make_batches(lengths, 64, seed=1) != make_batches(lengths, 64, seed=2)


def test_lr_schedule():
    f = lr_lambda(10, 110, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)


def test_a_time_budget_decays_the_rate_as_far_as_the_time_spent():
    """With --max-minutes the cosine follows whichever of steps and time is further along, so a run stopped by
    its budget ends at the low rate whatever its throughput."""
    spent = [0.0]
    f = lr_lambda(10, 110, 0.1, lambda: spent[0])
    assert f(60) == pytest.approx(0.55)  # time behind the steps: the steps rule
    spent[0] = 1.0
    assert f(5) == pytest.approx(0.6) and f(20) == pytest.approx(0.1)  # warmup first, then the budget's end


def test_every_epoch_has_the_same_number_of_batches():
    """Shuffles group samples into different numbers of batches; the step -> epoch mapping needs a fixed count
    (a shorter epoch used to leave `fit` looping forever at its end)."""
    import random

    rng = random.Random(0)
    lengths = [rng.randint(20, 600) for _ in range(700)]
    counts = {len(make_batches(lengths, 2048, seed)) for seed in range(10)}
    assert len(counts) > 1  # the situation that hung
    n = len(make_batches(lengths, 2048, 0)) // 2
    for seed in range(10):
        for rank in range(2):
            local = epoch_batches(lengths, 2048, seed, rank, 2, n)
            assert len(local) == n and local == epoch_batches(lengths, 2048, seed, rank, 2, n)
            assert set(sum(local, [])) == set(sum(make_batches(lengths, 2048, seed)[rank::2][:n], []))
