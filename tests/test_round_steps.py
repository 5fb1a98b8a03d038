"""A greedy EAGLE-2 round in two steps (eagle/decoding/round_steps.py, round_graphs.py): device acceptance takes the
host walk's path, the two-step loop gives the general loop's rounds, and the compiled steps give the eager ones."""

import pytest
import torch
from lossless_checks import PROMPTS
from tiny import random_draft, tiny_base

from eagle.decoding.draft import HeadStep
from eagle.decoding.generate import TreeSpec
from eagle.decoding.round_steps import DeviceTree, TreeShape, accept_path
from eagle.decoding.tree import DraftTree, ancestors_on_device
from eagle.decoding.verify import SamplingParams, TokenPicker, accept
from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import read_checkpoint
from eagle.runtime.round_graphs import CompiledRound, EagerRound

TREES = [TreeSpec(8, 3, 4), TreeSpec(12, 2, 3), TreeSpec(60, 7, 10), TreeSpec(2, 3, 1)]


@pytest.fixture(scope="module", params=[False, True], ids=["eagle12", "eagle3"])
def model(request, tmp_path_factory):
    base = tiny_base("llama", layers=8)
    folder = random_draft(
        base, str(tmp_path_factory.mktemp("d")), eagle3=request.param, draft_vocab=12 if request.param else None
    )
    return EaModel(base, load_head(base, *read_checkpoint(folder)), None)


def rounds(model, tree, prompt, runner="default"):
    """(tokens, accepted) of every round; runner None = the general loop (eagle_rounds)."""
    if runner != "default":
        model.round_runner = lambda *a: runner
    try:
        stream = model.stream(torch.tensor([prompt]), max_new_tokens=40, stop_token_ids=(), tree=tree)
        return [(r.tokens, r.accepted) for r in stream]
    finally:
        model.__dict__.pop("round_runner", None)


def random_tree(generator, n: int, vocab: int) -> DraftTree:
    """A random tree of n nodes whose siblings carry distinct tokens, as drafted trees do."""
    tokens, parents = [int(torch.randint(vocab, (1,), generator=generator))], [-1]
    for i in range(1, n):
        open_ = [q for q in range(i) if sum(parents[c] == q for c in range(1, i)) < vocab]
        p = open_[int(torch.randint(len(open_), (1,), generator=generator))]
        taken = {tokens[c] for c in range(1, i) if parents[c] == p}
        free = [t for t in range(vocab) if t not in taken]
        tokens.append(free[int(torch.randint(len(free), (1,), generator=generator))])
        parents.append(p)
    return DraftTree(tokens, parents)


def test_device_acceptance_takes_the_host_walks_path():
    g = torch.Generator().manual_seed(0)
    greedy = TokenPicker(SamplingParams())
    for trial in range(300):
        host = random_tree(g, int(torch.randint(1, 12, (1,), generator=g)), vocab=3)
        parents = torch.tensor(host.parents)
        depth = torch.tensor(host.depth)
        tree = DeviceTree(torch.tensor(host.tokens), parents, depth, ancestors_on_device(parents, max(host.depth)))
        logits = torch.randn(len(host), 3, generator=g)
        _, path, token = accept(host, logits, greedy)
        device_path, length = accept_path(tree, logits.argmax(-1), max(host.depth))
        assert int(length) == len(path), trial
        assert device_path[: len(path)].tolist() == path, trial
        assert int(logits[path[-1]].argmax()) == token


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"{t.total_token}-{t.depth}-{t.top_k}")
def test_greedy_rounds_in_two_steps_equal_the_general_loop(model, tree):
    assert isinstance(model.round_runner(tree, TokenPicker(SamplingParams())), EagerRound)
    for prompt in PROMPTS:
        assert rounds(model, tree, prompt) == rounds(model, tree, prompt, runner=None)


def test_tree_shape_counts_the_nodes_the_drafter_keeps():
    assert TreeShape.of(8, 2, 2) == TreeShape(top_k=2, levels=2, nodes=8)
    assert TreeShape.of(60, 7, 10).nodes == 60 and TreeShape.of(60, 7, 10).commit_rows == 9
    assert TreeShape.of(6, 1, 2).nodes == 6  # 2 + 4 candidates, 5 kept, and the root
    assert TreeShape.of(100, 1, 2).nodes == 7  # all 6 candidates
    assert TreeShape.of(3, 5, 4).levels == 1  # depth clamped to total_token - 2


def test_sampling_and_static_trees_run_the_general_loop(model):
    sampled = TokenPicker(SamplingParams(temperature=0.7))
    assert model.round_runner(TreeSpec(8, 3, 4), sampled) is None
    assert model.round_runner(TreeSpec(choices=((0,), (1,), (0, 0))), TokenPicker(SamplingParams())) is None


def test_compiled_round_gives_the_eager_rounds_in_one_graph_each(tmp_path, monkeypatch):
    """An EAGLE-1/2 head on a 2-layer base (compiling takes seconds per layer); EAGLE-3's compiled round is checked
    through from_pretrained in test_compiled.py."""
    base = tiny_base("llama", layers=2)
    model = EaModel(base, load_head(base, *read_checkpoint(random_draft(base, str(tmp_path / "d")))), None)
    tree = TreeSpec(8, 3, 4)
    shape = TreeShape.of(8, 3, 4)
    eager = [rounds(model, tree, p) for p in PROMPTS]
    compiled = CompiledRound(model.base, HeadStep(model.ea_layer, model.base.lm_head), shape)
    monkeypatch.setenv("EAGLE_AOT_DIR", str(tmp_path / "aot"))  # every graph traced here, none loaded from a file
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled.warm()
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"], dict(counters["graph_break"])
    calls = {"draft": 0, "verify": 0}
    for name in calls:
        graphs = getattr(compiled, f"{name}_graph")
        graph = graphs._graph(shape.nodes)

        def counted(*args, _graph=graph, _name=name):
            calls[_name] += 1
            return _graph(*args)

        graphs.graphs[shape.nodes] = counted
    assert [rounds(model, tree, p, runner=compiled) for p in PROMPTS] == eager
    n_rounds = sum(len(r) for r in eager)  # per prompt: the prefill's round, then one round per verify
    # every verify runs in the graph; every draft but a short prompt's first: a longer prompt's rows but its last
    # head_commit_rows are the head's alone (runner.prefill), those and the first tree the graph's draft step where
    # the cache then holds two rows or more (compiled.py)
    graphed_first = sum(len(p) - shape.head_commit_rows >= 2 for p in PROMPTS)
    assert 0 < graphed_first < len(PROMPTS)
    assert calls == {"draft": n_rounds - 2 * len(PROMPTS) + graphed_first, "verify": n_rounds - len(PROMPTS)}


def test_a_head_compiled_in_two_dtypes_keeps_the_one_whose_round_draft_step_is_faster(model, monkeypatch):
    """compile_round with `draft_options` of two dtypes compiles the round with each head, times their draft
    steps in turn and puts the faster head in use; the round runner then serves it. (Compiling and the clock are
    replaced here: the choice is what is pinned; test_compiled.py compiles real rounds.)"""
    import copy

    fp32 = model.ea_layer
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    model.draft_options = [(bf16, None), (fp32, None)]
    model.base.compiled = object()  # the base's graphs "in use", so that the compiled round is the one served
    step_ms = {torch.bfloat16: 5.4e-3, torch.float32: 3.3e-3}
    monkeypatch.setattr(CompiledRound, "warm", lambda self, log=None: {})
    monkeypatch.setattr(CompiledRound, "draft_seconds", lambda self: step_ms[self.step.head.fc.weight.dtype])
    lines = []
    try:
        for faster in (fp32, bf16):
            runner = model.compile_round(TreeSpec(8, 3, 2), log=lines.append)
            assert model.ea_layer is faster and runner.step.head is faster
            assert model.round_runner(TreeSpec(8, 3, 2), TokenPicker(SamplingParams())) is runner
            step_ms[torch.bfloat16] = 2.0e-3  # now bfloat16 drafts faster
        assert "3.30 ms in float32" in lines[0] and lines[0].endswith("the float32 head kept")
    finally:
        model.base.compiled, model.draft_options, model.ea_layer = None, None, fp32
        model.compiled_rounds.clear()
