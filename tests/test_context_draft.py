"""Context drafts (eagle/decoding/context_draft.py, round_steps.attach_chain): a copy of earlier text hangs in the
head's tree where the tree already spells its start, acceptance through it is the host walk's, the output stays the
base's own, and the measured policy offers chains only where they pay."""

import pytest
import torch
from test_round_steps import random_tree
from tiny import random_draft, tiny_base

from eagle.decoding.context_draft import BUCKETS, CHAINS, EXPLORE, ContextStats, bucket_of, pick_chains
from eagle.decoding.generate import Round, TreeSpec
from eagle.decoding.round_steps import DeviceTree, accept_path, attach_chain
from eagle.decoding.tree import DraftTree, TreeDraft
from eagle.decoding.verify import SamplingParams, TokenPicker, accept
from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import read_checkpoint


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
        stats.observe(one, 0, 0.013, 2, nodes=8)
    assert not stats.pays(one, 8)
    offers = sum(stats.offer(one, 8) for _ in range(4 * EXPLORE))
    assert offers == 4, "a declined bucket is tried once every EXPLORE rounds"


def test_a_chain_that_earns_more_than_its_rows_cost_is_offered():
    stats = ContextStats()
    long = bucket_of(20)
    for _ in range(40):  # a chain costs 0.6 tokens' worth and earns 3
        stats.observe(None, 0, 0.010, 2)
        stats.observe(long, 3, 0.013, 5, nodes=8)
    assert stats.pays(long, 8) and all(stats.offer(long, 8) for _ in range(10))
    assert stats.pays(long, 16)  # a size not measured yet: tried


def test_the_profile_counts_how_far_offered_chains_were_accepted():
    stats = ContextStats()
    long = bucket_of(20)
    for accepted in (0, 2, 5, 5):  # four rounds offered a chain for a long match
        stats.matched[long] += 1
        stats.observe(long, accepted, 0.01, accepted + 1)
    stats.matched[bucket_of(1)] += 1  # a short match not offered, and a round without any match
    stats.observe(None, 0, 0.01, 1)
    stats.observe(None, 0, 0.01, 1)
    profile = stats.profile()
    assert profile["rounds"] == 6 and profile["share"][long] == pytest.approx(4 / 6)
    assert profile["share"][bucket_of(1)] == pytest.approx(1 / 6)
    assert profile["survival"][long] == [0.75, 0.75, 0.5, 0.5, 0.5]  # at least k of the 4 offers' accepted copies
    assert profile["survival"][bucket_of(1)] == []


def _profile(long: list[float], short: list[float] | None = None) -> dict:
    """Chains accepted as far as `long` says for the longest matches (half the rounds), and `short` for one-token
    matches (the other half; none if None)."""
    shares, survivals = [0.0] * len(BUCKETS), [[] for _ in BUCKETS]
    shares[-1], survivals[-1] = 0.5, long
    if short is not None:
        shares[0], survivals[0] = 0.5, short
    return {"buckets": list(BUCKETS), "share": shares, "survival": survivals}


CHEAP_ROWS = {"tau": 2.0, "round_seconds": 0.010, "extra_seconds": lambda m: 0.0002 * m}


def test_a_long_chain_is_picked_where_copies_run_long_and_rows_are_cheap():
    assert pick_chains(_profile([0.9] * 16), **CHEAP_ROWS)[-1] == 16


def test_a_short_chain_is_picked_where_copies_stop_early_or_rows_are_dear():
    stops_early = _profile([0.9, 0.8, 0.6, 0.4] + [0.02] * 12)
    assert pick_chains(stops_early, **CHEAP_ROWS)[-1] == 4
    dear = pick_chains(_profile([0.9] * 16), 2.0, 0.010, lambda m: 0.0002 * m + 0.00004 * m * m)[-1]
    assert dear in (4, 8, 12)  # rows cost more the more there are: past some M, no copy pays them


def test_each_match_length_gets_its_own_chain_size_among_two_at_most():
    chains = pick_chains(_profile([0.9] * 16, short=[0.5, 0.2] + [0.0] * 14), **CHEAP_ROWS)
    assert chains[-1] == 16 and chains[0] == 4 and len(chains) == len(BUCKETS)
    assert len(set(chains)) == 2
    assert len(set(pick_chains(_profile([0.9] * 16, short=[0.5, 0.2] + [0.0] * 14), **CHEAP_ROWS, sizes=1))) == 1


def test_a_profile_of_other_buckets_is_refused_with_the_command_that_measures_it_again():
    with pytest.raises(ValueError, match="eagle.train.context_profile"):
        pick_chains({"buckets": [1, 2], "share": [0, 0], "survival": [[], []]}, 2.0, 0.01, lambda m: 0.0)


def test_the_tuned_tree_carries_chains_picked_on_the_costs_of_passes_timed_at_their_own_rows(monkeypatch, tmp_path):
    """With compiled forwards the tuner's 6- and 12-row passes pad to a graph (or run eagerly): the chains' costs are
    read off the graphs' own rows instead, and no chain reaches past the most rows timed."""
    from types import SimpleNamespace

    from eagle.runtime.compiled import bucket_for
    from eagle.tuning import tuner

    base = tiny_base("llama", layers=2)
    model = EaModel(base, load_head(base, *read_checkpoint(random_draft(base, str(tmp_path / "d")))), None)
    verify = {4: 0.010, 6: 0.010, 8: 0.011, 12: 0.011, 16: 0.030, 24: 0.060}
    monkeypatch.setattr(tuner, "verify_costs", lambda *a: verify)
    monkeypatch.setattr(tuner, "draft_costs", lambda m, options, depth, log=None: [{(1, 1): 0.001}])
    accept = [[0.6, 0.2], [0.5, 0.2], [0.4, 0.2]]
    plain = tuner.tune(model, accept)
    assert plain.chains == () and plain.total_token == 4
    runs_long = _profile([0.9] * 16)
    eager = tuner.tune(model, accept, context=runs_long)
    assert eager.chains[-1] == 8  # 12 rows timed at 11 ms
    graphs = lambda *buckets: SimpleNamespace(bucket=lambda rows: bucket_for(rows, buckets))  # noqa: E731
    monkeypatch.setattr(model.base, "compiled", graphs(1, 4, 8, 16))
    compiled = tuner.tune(model, accept, context=runs_long)
    assert (compiled.total_token, compiled.depth, compiled.top_k) == (plain.total_token, plain.depth, plain.top_k)
    assert compiled.chains[-1] == 4  # 12 rows run the 16-row graph: between 8 and 16 rows' times, 20.5 ms
    monkeypatch.setattr(model.base, "compiled", graphs(1, 4, 8))
    assert set(tuner.tune(model, accept, context=runs_long).chains) == {4}  # 8 rows the most timed: 4 + 4
    monkeypatch.setattr(tuner.few_rows, "reads_gguf_blocks", lambda model: True)  # one kernel at every row count
    assert tuner.tune(model, accept, context=runs_long).chains[-1] > 4
    assert tuner.interpolated(verify, 20) == pytest.approx(0.045) and tuner.interpolated(verify, 32) > 0.060


def test_the_context_profile_tool_measures_every_bucket_on_greedy_rounds(model):
    from eagle.train.context_profile import measure

    chain = model.context_chain
    try:
        profile = measure(model, {"copies": [PROMPT, PROMPT[::-1] + PROMPT]}, max_new_tokens=40)
    finally:
        model.context_chain, model.context_stats = chain, ContextStats()
    assert profile["chain"] == max(CHAINS) and profile["rounds"] > 10 and set(profile["sets"]) == {"copies"}
    assert len(profile["share"]) == len(BUCKETS) and 0 < sum(profile["share"]) <= 1
    copied = [s for s in profile["survival"] if s]
    assert copied and all(1 >= a >= b >= 0 for s in copied for a, b in zip(s, s[1:] + [0]))


def test_the_context_profile_is_measured_on_prompts_that_hold_no_benchmark_prompt(monkeypatch):
    """The benchmarks measure what the profile tunes (the chains' sizes): its default prompts are ShareGPT openings
    with every conversation that holds an MT-bench or repetitive-set prompt dropped."""
    from eagle.evaluation.questions import load_mtbench_questions, load_repetitive_questions
    from eagle.train import sharegpt
    from eagle.train.context_profile import sharegpt_openings

    mtbench, repetitive = load_mtbench_questions()[7]["turns"][0], load_repetitive_questions()[3]["turns"][0]
    chats = ["How do I keep basil alive on a windowsill?", mtbench, "Write a haiku about rain.", repetitive]
    records = [{"id": str(i), "messages": [{"role": "user", "content": c}, {"role": "assistant", "content": "ok"}]}
               for i, c in enumerate(chats)]  # fmt: skip
    monkeypatch.setattr(sharegpt, "load_sharegpt", lambda limit=None: records[:limit])
    assert sharegpt_openings(count=4, skip=0) == [chats[0], chats[2]]


def test_the_shipped_head_carries_a_context_profile_measured_off_the_benchmarks():
    from eagle.chat.model_types import DEFAULT_HEAD_DIR
    from eagle.models.checkpoint import read_context_profile

    profile = read_context_profile(str(DEFAULT_HEAD_DIR))
    assert set(profile["prompts"]) == {"sharegpt"} and profile["rounds"] >= 1000
    assert all(1 >= a >= b >= 0 for s in profile["survival"] for a, b in zip(s, s[1:]))
    chains = pick_chains(profile, **CHEAP_ROWS)
    assert len(chains) == len(BUCKETS) and set(chains) <= set(CHAINS)


def test_compiled_rounds_with_context_drafts_give_the_eager_rounds(tmp_path, monkeypatch):
    """The graphs of a shape with chains of two sizes (draft, verify, verify with a chain of each size) give the
    eager rounds, and rounds with a chain run the graph of their bucket's size."""
    from eagle.decoding.draft import HeadStep
    from eagle.decoding.round_steps import TreeShape
    from eagle.runtime.round_graphs import CompiledRound

    base = tiny_base("llama", layers=2)
    model = EaModel(base, load_head(base, *read_checkpoint(random_draft(base, str(tmp_path / "d")))), None,
                    total_token=8, depth=3, top_k=2)  # fmt: skip
    model.context_stats = ContextStats(always=True)
    model.context_chains = (3, 3, 3, 6, 6, 6)  # matches of 1-3 tokens offer 3 nodes, longer ones 6
    shape = TreeShape.of(8, 3, 2).with_chains(model.context_chains)
    assert shape.chain == 6 and shape.chain_sizes == (3, 6)

    def rounds():
        stream = model.stream(torch.tensor([PROMPT]), max_new_tokens=60, stop_token_ids=[], context_drafts=True)
        return [(r.tokens, r.accepted, r.context) for r in stream]

    eager = rounds()
    compiled = CompiledRound(model.base, HeadStep(model.ea_layer, model.base.lm_head), shape)
    monkeypatch.setenv("EAGLE_AOT_DIR", str(tmp_path / "aot"))  # every graph traced here, none loaded from a file
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled.warm()
    # draft (a commit of the longest path, and of the head's depth), verify, verify with a chain of each size
    assert counters["stats"]["unique_graphs"] == 5 and not counters["graph_break"], dict(counters["graph_break"])
    calls = {3: 0, 6: 0, "long": 0, "short": 0}

    def count(graphs, rows, name):
        graph = graphs._graph(rows)

        def counted(*args):
            calls[name] += 1
            return graph(*args)

        graphs.graphs[rows] = counted

    for m, graphs in compiled.verify_chain_graphs.items():
        count(graphs, shape.nodes + m, m)
    count(compiled.draft_graph, shape.nodes, "long")
    count(compiled.short_draft_graph, shape.nodes, "short")
    model.round_runner = lambda *a: compiled
    assert rounds() == eager
    assert min(calls[3], calls[6]) >= 2 and calls[3] + calls[6] >= 5 and sum(r[2] for r in eager) >= 10, calls
    # a round after one that accepted copies past the head's depth commits the longest path; the others, most,
    # commit a path of the head's depth (no chain's worth of padding rows through the head)
    long_paths = sum(r[1] + 1 > shape.head_commit_rows for r in eager[1:-1])
    assert calls["long"] == long_paths > 0 and calls["short"] > 0, (calls, long_paths)
