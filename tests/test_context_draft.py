"""Context drafts (eagle/model/context_draft.py, round_steps.attach_chain): a copy of earlier text hangs in the head's
tree where the tree already spells its start, acceptance through it is the host walk's, the output stays the
base's own, and the measured policy offers chains only where they pay."""

import pytest
import torch
from test_round_steps import random_tree
from tiny import random_draft, tiny_base

from eagle.model.checkpoint import read_checkpoint
from eagle.model.context_draft import EXPLORE, ContextStats, bucket_of
from eagle.model.ea_model import EaModel, load_head
from eagle.model.generate import Round, TreeSpec
from eagle.model.round_steps import DeviceTree, accept_path, attach_chain
from eagle.model.tree import DraftTree, TreeDraft
from eagle.model.verify import SamplingParams, TokenPicker, accept


def device_tree(host: DraftTree) -> DeviceTree:
    parents = torch.tensor(host.parents)
    return DeviceTree(torch.tensor(host.tokens), parents, torch.tensor(host.depth), host.ancestor_mask())


def test_a_chain_hangs_under_the_deepest_head_node_that_spells_the_proposal():
    head = DraftTree([1, 5, 6, 7, 8], [-1, 0, 0, 1, 3])  # root; 5 and 6; 7 under 5; 8 under 7
    proposal = torch.tensor([5, 7, 9, 4, 0, 0])  # P = head depth 3 + M 3; the context guesses 5 7 9 4
    tree = attach_chain(device_tree(head), proposal, torch.tensor(4), chain=3)
    assert tree.tokens.tolist() == [1, 5, 6, 7, 8, 9, 4, -1]  # 5 7 were drafted already; past the guess: -1
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3, 3, 5, 6]
    assert tree.depth.tolist() == [0, 1, 1, 2, 3, 3, 4, 5]
    assert torch.equal(tree.ancestors, DraftTree(tree.tokens.tolist(), tree.parents.tolist()).ancestor_mask())


def test_a_proposal_the_head_did_not_draft_hangs_under_the_root():
    head = DraftTree([1, 5, 6], [-1, 0, 0])
    tree = attach_chain(device_tree(head), torch.tensor([3, 5, 6, 0]), torch.tensor(3), chain=2)
    assert tree.tokens.tolist() == [1, 5, 6, 3, 5] and tree.parents.tolist() == [-1, 0, 0, 0, 3]


def test_device_acceptance_through_a_chain_takes_the_host_walks_path():
    g = torch.Generator().manual_seed(1)
    greedy = TokenPicker(SamplingParams())
    vocab, chain, accepted_from_chain = 3, 3, 0
    for _ in range(300):
        head = random_tree(g, int(torch.randint(1, 9, (1,), generator=g)), vocab)
        head_depth = max(head.depth)
        proposal = torch.randint(vocab, (head_depth + chain,), generator=g)
        count = torch.randint(0, head_depth + chain + 1, (1,), generator=g)[0]
        tree = attach_chain(device_tree(head), proposal, count, chain)
        n = tree.tokens.shape[0]
        draws = torch.randint(vocab, (n,), generator=g)
        logits = torch.nn.functional.one_hot(draws, vocab).float()
        host, path, _ = accept(TreeDraft(*tree), logits, greedy)
        on_device, length = accept_path(tree, draws, head_depth + chain)
        assert on_device[: int(length)].tolist() == path
        accepted_from_chain += sum(node >= len(head) for node in path)
    assert accepted_from_chain > 20, "no chain node was ever accepted: the check saw nothing"


@pytest.fixture(scope="module", params=[False, True], ids=["eagle12", "eagle3"])
def model(request, tmp_path_factory):
    base = tiny_base("llama", layers=4)
    folder = random_draft(base, str(tmp_path_factory.mktemp("d")), eagle3=request.param)
    return EaModel(base, load_head(base, *read_checkpoint(folder)), None, total_token=8, depth=3, top_k=2)


PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 9, 2, 3, 4]  # a tiny random base soon repeats itself, as copied text does


STATIC = TreeSpec(choices=((0,), (1,), (0, 0), (0, 1), (0, 0, 0)))  # EAGLE-1's kind of tree


@pytest.mark.parametrize("loop", ["two_steps", "general", "static_tree"])
def test_greedy_with_context_drafts_equals_vanilla_and_accepts_copies(model, loop):
    ids = torch.tensor([PROMPT])
    vanilla = model.naivegenerate(ids, max_new_tokens=60, stop_token_ids=[])
    model.context_stats = ContextStats(always=True)
    if loop == "general":
        model.round_runner = lambda *a: None
    tree = STATIC if loop == "static_tree" else None
    try:
        assert loop != "two_steps" or model.round_runner(model.tree, TokenPicker(SamplingParams())) is not None
        rounds = list(model.stream(ids, max_new_tokens=60, stop_token_ids=[], context_drafts=True, tree=tree))
        model.context_stats = ContextStats()  # the measured policy: other rounds offer chains, the same output
        measured = list(model.stream(ids, max_new_tokens=60, stop_token_ids=[], context_drafts=True, tree=tree))
    finally:
        model.__dict__.pop("round_runner", None)
        model.context_stats = ContextStats()
    for stream in (rounds, measured):
        assert PROMPT + [t for r in stream for t in r.tokens] == vanilla[0].tolist()
    assert sum(r.context for r in rounds) >= 10, "context drafts were hardly accepted: the test saw nothing"
    assert all(0 <= r.context <= r.accepted for r in rounds)


def test_a_round_says_which_tokens_were_copies():
    r = Round([4, 5, 6, 7], accepted=3, seconds=0.0, context=2)
    assert r.from_draft == [True, True, True, False] and r.from_context == [False, True, True, False]


def test_a_chain_that_earns_less_than_its_rows_cost_is_declined_and_still_tried():
    stats = ContextStats()
    one = bucket_of(1)
    for _ in range(40):  # rounds of 2 tokens in 10 ms; with a chain 13 ms (0.6 tokens' worth) and nothing earned
        stats.observe(None, 0, 0.010, 2)
        stats.observe(one, 0, 0.013, 2)
    assert not stats.pays(one)
    offers = sum(stats.offer(one) for _ in range(4 * EXPLORE))
    assert offers == 4, "a declined bucket is tried once every EXPLORE rounds"


def test_a_chain_that_earns_more_than_its_rows_cost_is_offered():
    stats = ContextStats()
    long = bucket_of(20)
    for _ in range(40):  # a chain costs 0.6 tokens' worth and earns 3
        stats.observe(None, 0, 0.010, 2)
        stats.observe(long, 3, 0.013, 5)
    assert stats.pays(long) and all(stats.offer(long) for _ in range(10))


def test_compiled_rounds_with_context_drafts_give_the_eager_rounds(tmp_path, monkeypatch):
    """The three graphs of a shape with a chain (draft, verify, verify with the chain) give the eager rounds, and
    rounds with a chain run the third."""
    from eagle.model.draft import HeadStep
    from eagle.model.round_graphs import CompiledRound
    from eagle.model.round_steps import TreeShape

    base = tiny_base("llama", layers=2)
    model = EaModel(base, load_head(base, *read_checkpoint(random_draft(base, str(tmp_path / "d")))), None,
                    total_token=8, depth=3, top_k=2)  # fmt: skip
    model.context_stats = ContextStats(always=True)
    shape = TreeShape.of(8, 3, 2).with_chain(model.context_chain)

    def rounds():
        stream = model.stream(torch.tensor([PROMPT]), max_new_tokens=60, stop_token_ids=[], context_drafts=True)
        return [(r.tokens, r.accepted, r.context) for r in stream]

    eager = rounds()
    compiled = CompiledRound(model.base, HeadStep(model.ea_layer, model.base.lm_head), shape)
    monkeypatch.setenv("EAGLE_AOT_DIR", str(tmp_path / "aot"))  # every graph traced here, none loaded from a file
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled.warm()
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"], dict(counters["graph_break"])
    calls = []
    graph = compiled.verify_chain_graph._graph(shape.nodes + shape.chain)
    compiled.verify_chain_graph.graphs[shape.nodes + shape.chain] = lambda *a: calls.append(1) or graph(*a)
    model.round_runner = lambda *a: compiled
    assert rounds() == eager
    assert len(calls) >= 5 and sum(r[2] for r in eager) >= 10
