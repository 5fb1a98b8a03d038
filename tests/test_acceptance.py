"""The acceptance profile: rank hits at T=0 and sampling mass at T>0, checked by hand on a tiny head; the
batched feature extraction that feeds it (and training) equals one sequence at a time."""

import torch
from tiny import draft_config, tiny_base

from eagle.models.draft_head import DraftConfig, DraftHead
from eagle.train.acceptance import profile_sums
from eagle.train.ttt import unrolled_forward

V, T = 16, 12


def _head_and_batch():
    base = tiny_base("llama", vocab=V)
    torch.manual_seed(3)
    head = DraftHead(DraftConfig.from_dict(draft_config(base, eagle3=True), True), own_embedding=False).eval()
    H = base.config.hidden_size
    batch = {
        "input_ids": torch.randint(2, V, (1, T)), "loss_mask": torch.ones(1, T, dtype=torch.bool),
        "lengths": torch.tensor([T]), "hidden": torch.randn(1, T, H), "features": torch.randn(1, T, 3 * H),
    }  # fmt: skip
    return base, head, batch


def test_greedy_profile_counts_the_rank_of_the_base_token():
    base, head, batch = _head_and_batch()
    embed = base.get_input_embeddings()
    with torch.no_grad():
        out = unrolled_forward(head, embed, batch["features"], batch["input_ids"], 1)[0]
        ranked = head.to_target_ids(head.lm_head(head.norm(out)).topk(4, -1).indices)[0]  # [T, 4]
    # depth 0 at position j scores the base token at j + 1: make it the draft's rank (j % 3) candidate
    argmax = torch.zeros(1, T, dtype=torch.long)
    for j in range(T - 2):  # live positions: j + 2 < T
        argmax[0, j + 1] = ranked[j, j % 3]
    batch["argmax"] = argmax
    lm_head = base.get_output_embeddings().weight
    sums = profile_sums(head, embed, lm_head, batch, depth=1, top_k=4, temperatures=(0.0,))
    assert sums["count/0"].tolist() == [T - 2]
    assert sums["hits/0"][0].tolist() == [4.0, 3.0, 3.0, 0.0]  # j = 0..9: j % 3 = 0 four times, 1 and 2 three


def test_sampling_profile_is_the_base_probability_of_each_candidate():
    base, head, batch = _head_and_batch()
    batch["argmax"] = torch.zeros(1, T, dtype=torch.long)
    embed = base.get_input_embeddings()
    flat = torch.zeros(V, base.config.hidden_size)  # a base lm_head of zeros: the base samples uniformly
    sums = profile_sums(head, embed, flat, batch, depth=3, top_k=5, temperatures=(0.7,))
    live = torch.tensor([T - 2, T - 3, T - 4], dtype=torch.float)
    assert torch.equal(sums["count/0.7"], live)
    assert torch.allclose(sums["hits/0.7"], live[:, None].expand(3, 5) / V)


def test_batched_feature_extraction_equals_one_sequence_at_a_time():
    from eagle.train.data import FeatureExtractor

    base = tiny_base("llama", vocab=V, layers=8)
    extractor = FeatureExtractor(base, eagle3=True)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (5, 17, 9, 17, 3)]
    alone = extractor.many(seqs, batch_tokens=0)
    batched = extractor.many(seqs, batch_tokens=64)  # right-padded batches of up to 64 padded tokens
    for a, b, s in zip(alone, batched, seqs):
        assert a["hidden"].shape[0] == b["taps"].shape[0] == len(s)
        assert torch.equal(a["argmax"], b["argmax"])
        assert torch.allclose(a["hidden"], b["hidden"], atol=1e-5) and torch.allclose(a["taps"], b["taps"], atol=1e-5)
