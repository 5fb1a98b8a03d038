"""The CUDA round (eagle/runtime/cuda_round.py) on CPU, everything but the capture: the round's draft and verify steps
over static spans of the caches with the context length a tensor, the accepted path kept by a third step, three
steps a round. Greedy output equals transformers' greedy `generate` and the eager round's, across a span's end;
on CUDA (marked gpu) the same captured, with three replays and one host read a round."""

import pytest
import torch
from host_reads import HostReads
from lossless_checks import PROMPTS
from tiny import random_draft, tiny_base

from eagle.decoding.draft import HeadStep
from eagle.decoding.round_steps import TreeShape
from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import read_checkpoint
from eagle.runtime.cuda_graphs import GraphedDecode
from eagle.runtime.cuda_round import CudaRound
from eagle.runtime.round_graphs import EagerRound

TREE = dict(total_token=8, depth=3, top_k=4)


def round_model(tmp_path, eagle3: bool, device: str = "cpu", **tree) -> EaModel:
    base = tiny_base("llama").to(device)
    draft = random_draft(base.cpu(), str(tmp_path), eagle3=eagle3, draft_vocab=12 if eagle3 else None)
    head = load_head(base.to(device), *read_checkpoint(draft))
    return EaModel(base, head, None, **(tree or TREE))


def graph_round(model: EaModel, capture: bool = False, capacity: int = 512) -> CudaRound:
    """The base's graphs and the round's, warmed and in use (what compile_rounds + compile_round do on CUDA)."""
    model.base.compiled = GraphedDecode(model.base, (1, 8), capacity, capture)
    model.base.compiled.warm()
    shape = model.shape_of(model.tree)
    runner = CudaRound(model.base, HeadStep(model.ea_layer, model.base.lm_head), shape, capture)
    runner.warm()
    model.compiled_rounds[shape] = runner
    return runner


def calls_of(runner: CudaRound, monkeypatch) -> dict:
    """Counts the runner's graph calls by step (draft, verify, keep) and span until the test ends."""
    counts = {}
    original = runner.steps.run

    def counted(key, *args):
        counts[key] = counts.get(key, 0) + 1
        return original(key, *args)

    monkeypatch.setattr(runner.steps, "run", counted)
    return counts


def generate(base, ids, new):
    return base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, eos_token_id=None, pad_token_id=0).tolist()  # fmt: skip


def test_a_tree_mask_over_a_span_is_the_prefix_form_padded_with_masked_keys():
    from eagle.models.masks import tree_mask, with_tree

    g = torch.Generator().manual_seed(0)
    for q, m, committed, gap, span in [(4, 8, 20, 3, 40), (10, 10, 5, 0, 15), (3, 12, 30, 2, 64)]:
        ancestors = torch.rand(q, m, generator=g) < 0.5  # [q, m]
        tree_at = committed + gap  # rows between the commit and the tree (a draft's padding) are seen by no one
        seen = torch.arange(tree_at) < committed
        prefix = with_tree(seen, ancestors, tree_at)  # [q, tree_at + m]
        spanned = with_tree(torch.arange(span) < committed, ancestors, torch.tensor(tree_at), span)  # [q, span]
        assert torch.equal(spanned[:, : tree_at + m], prefix) and not spanned[:, tree_at + m :].any()
        if gap == 0 and q == m:  # a verify pass: the tree right after the prefix
            wide = tree_mask(torch.tensor(committed), ancestors, torch.float32, "cpu", span)  # [1, 1, q, span]
            assert torch.equal(wide[..., : committed + m], tree_mask(committed, ancestors, torch.float32, "cpu"))
            assert (wide[..., committed + m :] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
def test_the_graphed_round_equals_greedy_generate_across_a_span_of_the_cache(tmp_path, monkeypatch, eagle3):
    model = round_model(tmp_path, eagle3)
    runner = graph_round(model)
    calls = calls_of(runner, monkeypatch)
    # 230 prompt tokens: the verify pass's keys cross the first span (256 positions) within the reply
    prompt = torch.tensor([[(7 * i + 3) % 13 + 2 for i in range(230)]])
    for ids, new in [(prompt, 60)] + [(torch.tensor([p]), 40) for p in PROMPTS]:
        out = model.eagenerate(ids, max_new_tokens=new, stop_token_ids=[])
        assert out.tolist() == generate(model.base_model, ids, new)
    spans = {key[-1] for key in calls if key[0] == "verify"}
    assert {256, 512} <= spans, calls  # two spans of the verify pass ran
    assert calls.get(("keep",), 0) > 0  # some path was moved by the keep step
    rounds_run = sum(n for key, n in calls.items() if key[0] == "verify")
    # a draft graph every round but the first of a prompt shorter than a commit: a longer one's rows but its last
    # head_commit_rows are the head's eager prefill, the first draft step the graph's
    eager_first = sum(len(p) < model.shape_of(model.tree).head_commit_rows for p in PROMPTS)
    assert 0 < eager_first < len(PROMPTS)
    assert sum(n for key, n in calls.items() if key[0] == "draft") == rounds_run - eager_first, calls


def test_a_round_is_three_steps_and_equals_the_eager_round(tmp_path, monkeypatch):
    model = round_model(tmp_path, eagle3=True)
    runner = graph_round(model)
    ids = torch.tensor([PROMPTS[1]])
    graphed = model.eagenerate(ids, max_new_tokens=48, stop_token_ids=[]).tolist()
    calls = calls_of(runner, monkeypatch)
    stream = model.stream(ids, max_new_tokens=48, stop_token_ids=[])
    next(stream)  # the prefill
    rounds = sum(1 for _ in stream)
    assert sum(calls.values()) <= 3 * rounds and sum(n for k, n in calls.items() if k[0] == "verify") == rounds
    shape = model.shape_of(model.tree)
    model.compiled_rounds[shape] = EagerRound(model.base, HeadStep(model.ea_layer, model.base.lm_head), shape)
    assert model.eagenerate(ids, max_new_tokens=48, stop_token_ids=[]).tolist() == graphed


def test_a_generation_beside_the_one_holding_the_rounds_caches_runs_eagerly_and_equally(tmp_path, monkeypatch):
    model = round_model(tmp_path, eagle3=False)
    runner = graph_round(model)
    ids = torch.tensor([PROMPTS[2]])
    alone = model.eagenerate(ids, max_new_tokens=32, stop_token_ids=[]).tolist()
    holder = model.stream(torch.tensor([PROMPTS[0]]), max_new_tokens=32, stop_token_ids=[])
    next(holder)
    next(holder)  # holds the base graphs' cache and the round's draft cache
    calls = calls_of(runner, monkeypatch)
    assert model.eagenerate(ids, max_new_tokens=32, stop_token_ids=[]).tolist() == alone
    assert not calls  # no graph ran for the second generation
    holder.close()
    assert model.eagenerate(ids, max_new_tokens=32, stop_token_ids=[]).tolist() == alone
    assert calls  # the caches were given back


def test_the_graphed_round_with_context_chains_equals_vanilla_and_accepts_copies(tmp_path, monkeypatch):
    """The round's shape with context chains: the draft graph over either commit, the chain's verify pass eager on
    the graphs' cache, the keep graph moving paths that end in copies."""
    from eagle.decoding.context_draft import ContextStats

    base = tiny_base("llama", layers=4)
    head = load_head(base, *read_checkpoint(random_draft(base, str(tmp_path), eagle3=True, draft_vocab=12)))
    model = EaModel(base, head, None, total_token=8, depth=3, top_k=2)
    runner = graph_round(model)
    chained = model.compile_round(context_drafts=True)
    assert isinstance(chained, CudaRound) and chained.shape.chain and chained is not runner
    ids = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5, 9, 2, 3, 4]])  # a tiny random base soon repeats itself
    vanilla = model.naivegenerate(ids, max_new_tokens=60, stop_token_ids=[]).tolist()
    model.context_stats = ContextStats(always=True)
    calls = calls_of(chained, monkeypatch)
    rounds = list(model.stream(ids, max_new_tokens=60, stop_token_ids=[], context_drafts=True))
    assert ids[0].tolist() + [t for r in rounds for t in r.tokens] == vanilla[0]
    assert sum(r.context for r in rounds) >= 10, "context drafts were hardly accepted: the test saw nothing"
    assert any(key[0] == "draft" for key in calls) and ("keep",) in calls


def test_the_round_needs_the_base_graphs(tmp_path):
    model = round_model(tmp_path, eagle3=False)
    with pytest.raises(ValueError, match="GraphedDecode"):
        CudaRound(model.base, HeadStep(model.ea_layer, model.base.lm_head), TreeShape.of(8, 3, 4), capture=False)


def test_the_round_and_vanilla_step_of_inductors_kernels_equal_greedy_generate(tmp_path):
    """compile="inductor": the 1-row step's graphs and the round's compiled by inductor before capture."""
    from torch._dynamo.utils import counters

    model = round_model(tmp_path, eagle3=True)
    model.base.compiled = GraphedDecode(model.base, (1, 8), 512, capture=False, inductor=True)
    shape = model.shape_of(model.tree)
    runner = model.compiled_rounds[shape] = CudaRound(model.base, HeadStep(model.ea_layer, model.base.lm_head), shape)
    graphs_before = counters["stats"]["unique_graphs"]
    ids = torch.tensor([PROMPTS[1]])
    ref = generate(model.base_model, ids, 40)
    assert model.eagenerate(ids, max_new_tokens=40, stop_token_ids=[]).tolist() == ref
    assert model.naivegenerate(ids, max_new_tokens=40, stop_token_ids=[]).tolist() == ref
    assert runner.inductor and counters["stats"]["unique_graphs"] >= graphs_before + 3  # the step, draft and verify


def test_inductors_vanilla_step_compiles_twice_for_three_spans_and_equals_greedy_generate(tmp_path):
    """The first span's graph static, the second's with the span symbolic, which the third reuses (a step's keys
    differ in their span alone): two compiles, not one per span."""
    from torch._dynamo.utils import counters

    model = round_model(tmp_path, eagle3=False)
    model.base.compiled = GraphedDecode(model.base, (1, 8), 1024, capture=False, inductor=True)  # spans 256-1024
    torch._dynamo.reset()  # no span seen before by the step's code (an earlier test's would count)
    graphs_before = counters["stats"]["unique_graphs"]
    ids = torch.tensor([[(7 * i + 3) % 13 + 2 for i in range(230)]])  # 530 positions by the end: three spans
    out = model.naivegenerate(ids, max_new_tokens=300, stop_token_ids=[]).tolist()
    assert out == generate(model.base_model, ids, 300)
    assert {key[-1] for key in model.base.compiled.steps.buffers} == {256, 512, 1024}
    assert counters["stats"]["unique_graphs"] == graphs_before + 2


def test_the_model_panel_names_the_rounds_graphs(tmp_path):
    from eagle.chat.model_types import forwards_description

    model = round_model(tmp_path, eagle3=False)
    graph_round(model)
    described = forwards_description(model)
    assert "greedy rounds in three CUDA graphs (draft, verify, keep) for trees of 8 nodes" in described


# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
def test_captured_round_on_cuda_equals_greedy_generate_in_three_replays_and_one_host_read(tmp_path, eagle3):
    model = round_model(tmp_path, eagle3, device="cuda")
    runner = graph_round(model, capture=True)
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in runner.steps.graphs.values())
    prompt = [(7 * i + 3) % 13 + 2 for i in range(230)]
    for p, new in [(prompt, 60)] + [(p, 40) for p in PROMPTS]:
        ids = torch.tensor([p])
        ref = generate(model.base_model, ids.cuda(), new)
        assert model.eagenerate(ids, max_new_tokens=new, stop_token_ids=[]).tolist() == ref
    launches = []
    original = torch.cuda.CUDAGraph.replay
    stream = model.stream(torch.tensor([PROMPTS[0]]), max_new_tokens=32, stop_token_ids=())
    next(stream)
    try:
        torch.cuda.CUDAGraph.replay = lambda g: (launches.append(g), original(g))[1]
        with HostReads() as reads:
            rounds = sum(1 for _ in stream)
    finally:
        torch.cuda.CUDAGraph.replay = original
    assert sum(reads.count.values()) == rounds
    assert len(launches) <= 3 * rounds

