"""A conversation's caches kept between turns (eagle/decoding/prefix_cache.py): a turn whose prompt continues the last
turn's sequence prefills only what follows the rows both caches hold valid, and gives exactly the tokens a cold start
of the same prompt gives, on the eager path, the CUDA-graph runners (on CPU without the capture; captured, marked gpu)
and the compiled CPU path; EAGLE (two-step greedy rounds, the general loop, context drafts) and vanilla; a store of
several conversations within a byte budget drops the least recently used, which then starts cold and equally."""

import pytest
import torch
from lossless_checks import VOCAB, assert_follows_base_distribution, make_model
from tiny import random_draft, tiny_base

from eagle.decoding.context_draft import ContextStats
from eagle.decoding.draft import HeadStep
from eagle.decoding.generate import TreeSpec
from eagle.decoding.prefix_cache import KeptPrefix, PrefixStore, common_prefix
from eagle.decoding.verify import SamplingParams
from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import read_checkpoint
from eagle.models.kv_cache import TreeKVCache
from eagle.runtime.cuda_graphs import GraphedDecode, GraphedDraft
from eagle.runtime.cuda_round import CudaRound

USER = [[3, 4, 5, 6], [7, 8, 2], [9, 11, 4, 2, 5], [13, 6, 6, 3]]  # each turn's new ids after the last reply
NEW = 24
STATIC = TreeSpec(choices=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))  # the general loop (Drafter)
MODES = {
    "eagle": {}, "vanilla": {"eagle": False}, "context-drafts": {"context_drafts": True},
    "general-loop": {"tree": STATIC},
}  # fmt: skip


def tiny_model(tmp_path, eagle3: bool = True, device: str = "cpu", layers: int = 6) -> EaModel:
    base = tiny_base("llama", layers=layers)
    folder = random_draft(base, str(tmp_path), eagle3=eagle3, draft_vocab=12 if eagle3 else None)
    base = base.to(device)
    return EaModel(base, load_head(base, *read_checkpoint(folder)), None, total_token=8, depth=3, top_k=4)


def reply(model, prompt: list[int], **kw):
    """(the reply's ids, its first round) of one greedy generation of NEW tokens. With a conversation, every valid
    row is read (exact=False: a reply's rows too), unless the test says otherwise: these tests pin the reuse's
    mechanics on all of them; the default, the prompts' rows only, has tests of its own (`..._a_prefill_wrote`)."""
    if "conversation" in kw:
        kw.setdefault("exact", False)
    rounds = list(model.stream(torch.tensor([prompt]), max_new_tokens=kw.pop("new", NEW), stop_token_ids=[], **kw))
    return [t for r in rounds for t in r.tokens], rounds[0]


def converse(model, key, turns: int = len(USER), **kw) -> list[tuple[list[int], list[int], int]]:
    """A conversation of `turns` turns under `key`, each prompt the last turn's sequence and the next user ids; per
    turn (prompt, reply, prompt tokens read from the kept cache), each reply checked against a cold start."""
    out, sequence = [], []
    for user in USER[:turns]:
        prompt = sequence + user
        warm, first = reply(model, prompt, conversation=key, **kw)
        cold, cold_first = reply(model, prompt, **kw)
        assert warm == cold, f"turn {len(out) + 1}: a warm turn diverged from a cold start of the same prompt"
        assert cold_first.cached == 0 and first.prefill_s >= first.seconds > 0
        out.append((prompt, warm, first.cached))
        sequence = prompt + warm
    return out


def assert_kept_the_last_sequence(model, turns, mode: str) -> None:
    """Every turn after the first read all the last sequence's rows but the last token's (vanilla), or but the head's
    lag, the last round's path, at most (EAGLE: its longest, with a context chain's nodes where it has them)."""
    tree = STATIC if mode == "general-loop" else model.tree
    lag = tree.max_depth + (model.context_chain if mode == "context-drafts" else 0) + 1
    assert turns[0][2] == 0
    for (prompt, answer, _), (_, _, cached) in zip(turns, turns[1:]):
        held = len(prompt) + len(answer) - 1  # the reply's last token never went through the base
        assert (cached == held) if mode == "vanilla" else (held - lag <= cached < held), (cached, held)


def count_calls(monkeypatch, graph) -> dict:
    """{"call": n}: how many times `graph.call` runs from here on (the test's graphs doing the work)."""
    calls, original = {"call": 0}, graph.call

    def counted(*args, **kw):
        calls["call"] += 1
        return original(*args, **kw)

    monkeypatch.setattr(graph, "call", counted)
    return calls


# ------------------------------------------------------------------------------------------------------------------
def test_the_reuse_point_is_the_rows_both_caches_hold_valid_for_the_new_prompt():
    base = TreeKVCache(1, 32)
    head = object()
    kept = KeptPrefix(list(range(20)), base, base_rows=19, head=None, head_rows=0)
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
    assert kept.reuse_point(list(range(30))) == 19  # vanilla: every base row written
    assert kept.reuse_point(list(range(12)) + [99] * 10) == 12  # rows past the first difference are another text's
    assert kept.reuse_point(list(range(20))) == 19 and kept.reuse_point(list(range(10))) == 9  # a prompt to prefill
    assert kept.reuse_point(list(range(30)), head) == 0  # no head rows kept: a drafting turn starts cold

    class Head:  # the rows' dtype is the head's own
        fc = torch.nn.Linear(1, 1)

    drafting = Head()
    kept = KeptPrefix(list(range(20)), base, 19, TreeKVCache(1, 32).allocate(1, 4, torch.float32, "cpu"), 16, drafting)
    assert kept.reuse_point(list(range(30)), drafting) == 16  # the head lags the base
    # head row i reads token i + 1: a difference at 12 leaves head rows 0..10, base rows 0..11
    assert kept.reuse_point(list(range(12)) + [99] * 10, drafting) == 11
    assert kept.reuse_point(list(range(12)) + [99] * 10) == 12
    assert kept.reuse_point(list(range(30)), Head()) == 0  # another head's rows
    drafting.fc.to(torch.bfloat16)
    assert kept.reuse_point(list(range(30)), drafting) == 0  # the same head cast: its rows were another dtype's


@pytest.fixture(scope="module", params=[False, True], ids=["eagle12", "eagle3"])
def model(request, tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("d"), eagle3=request.param)


@pytest.mark.parametrize("mode", MODES)
def test_a_turn_on_the_kept_prefix_gives_the_cold_starts_tokens_across_turns(model, mode):
    kw = MODES[mode]
    if mode == "context-drafts":  # offered every round, measured or not, so that copies run
        model.context_stats = ContextStats(always=True)
    try:
        turns = converse(model, mode, **kw)
    finally:
        model.context_stats = ContextStats()
        model.prefix_store.clear()
    assert_kept_the_last_sequence(model, turns, mode)


def test_figures_of_the_cache_come_on_the_first_round_only(model):
    prompt = USER[0]
    first = reply(model, prompt, conversation="figures")[0]
    rounds = list(model.stream(torch.tensor([prompt + first + USER[1]]), max_new_tokens=NEW, stop_token_ids=[],
                               conversation="figures", exact=False))  # fmt: skip
    assert rounds[0].cached > len(prompt) and rounds[0].prefill_s >= rounds[0].seconds
    assert all(r.cached == 0 and r.prefill_s == 0.0 for r in rounds[1:])
    model.prefix_store.clear()


def test_a_regenerated_turn_reads_all_but_the_last_prompt_token_from_the_cache(model):
    prompt = USER[0] + USER[1] + USER[2]
    for kw in ({}, {"eagle": False}):
        once, _ = reply(model, prompt, conversation="again", **kw)
        again, first = reply(model, prompt, conversation="again", **kw)
        assert again == once and first.cached == len(prompt) - 1  # the last token's logits pick the first one
    model.prefix_store.clear()


def test_a_conversation_switching_between_vanilla_and_eagle_keeps_what_is_still_valid(model):
    """A vanilla turn keeps the base's rows and leaves the head's of the prefix it shares; the next EAGLE turn reads
    the rows both hold."""
    prompt = USER[0]
    first, _ = reply(model, prompt, conversation="mixed")
    second_prompt = prompt + first + USER[1]
    second, f2 = reply(model, second_prompt, conversation="mixed", eagle=False)
    assert second == reply(model, second_prompt, eagle=False)[0] and f2.cached >= len(prompt)
    third_prompt = second_prompt + second + USER[2]
    third, f3 = reply(model, third_prompt, conversation="mixed")
    assert third == reply(model, third_prompt)[0]
    assert len(prompt) <= f3.cached < len(second_prompt)  # the head's rows end before the vanilla turn's reply
    model.prefix_store.clear()


def test_a_closed_stream_keeps_the_rows_of_the_tokens_it_gave(model):
    prompt = USER[0] + USER[1]
    for kw in ({}, {"eagle": False}):
        stream = model.stream(torch.tensor([prompt]), max_new_tokens=NEW, stop_token_ids=[], conversation="cut", exact=False, **kw)
        given = [t for _, r in zip(range(4), stream) for t in r.tokens]
        stream.close()  # what a stopped reply does
        follow_up = prompt + given + USER[2]
        warm, first = reply(model, follow_up, conversation="cut", **kw)
        assert warm == reply(model, follow_up, **kw)[0] and first.cached >= len(prompt)
        model.prefix_store.clear()


def test_a_replaced_head_starts_the_eagle_turn_cold_and_the_vanilla_turn_warm(model, tmp_path):
    prompt = USER[0]
    first, _ = reply(model, prompt, conversation="head")
    head = model.ea_layer
    other = tiny_model(tmp_path, eagle3=model.use_eagle3).ea_layer  # another head object (the same weights)
    try:
        model.ea_layer = other
        follow_up = prompt + first + USER[1]
        warm, f = reply(model, follow_up, conversation="head")
        assert f.cached == 0 and warm == reply(model, follow_up)[0]
        vanilla, f = reply(model, follow_up + warm + USER[2], conversation="head", eagle=False)
        assert f.cached > len(follow_up)
    finally:
        model.ea_layer = head
        model.prefix_store.clear()


def test_the_least_recently_used_conversation_is_dropped_under_the_budget_and_recomputes_cold(model):
    store = model.prefix_store
    a = reply(model, USER[0], conversation="a")[0]
    one = store.get("a").nbytes
    store.budget = int(1.5 * one)  # room for one conversation of this size
    try:
        b = reply(model, USER[1], conversation="b")[0]
        assert store.keys() == ["b"]  # a dropped, b the most recent
        again, first = reply(model, USER[0], conversation="a")  # a's turn again: its prefix no longer kept
        assert first.cached == 0 and again == a  # recomputed cold, the same tokens
        assert store.keys() == ["a"]
        _, first = reply(model, USER[1] + b + USER[3], conversation="b")
        assert first.cached == 0  # b was dropped in turn
        store.budget = 1  # nothing fits: nothing kept
        reply(model, USER[0], conversation="c")
        assert store.keys() == [] and store.nbytes == 0
    finally:
        store.budget = PrefixStore().budget
        store.clear()


def test_a_kept_cache_grows_when_the_next_turn_is_longer_within_max_length(model):
    store = model.prefix_store
    prompt = USER[0]
    first, _ = reply(model, prompt, conversation="grow", new=4)
    small = store.get("grow").base
    follow_up = prompt + first + USER[1]
    warm, f = reply(model, follow_up, conversation="grow", new=40, max_length=200)
    grown = store.get("grow").base
    assert warm == reply(model, follow_up, new=40, max_length=200)[0] and f.cached > len(prompt)
    assert grown is not small and grown.capacity >= len(follow_up) + 40 > small.capacity
    room = max(model.tree.max_nodes, model.tree.max_depth + 1) + 1
    assert grown.capacity <= 200 + room  # towards twice the kept one, never past what max_length needs
    again, f = reply(model, follow_up, conversation="grow", new=8, max_length=200)  # a shorter turn: room enough
    assert store.get("grow").base is grown and f.cached == len(follow_up) - 1 and again == warm[:8]
    store.clear()


def test_two_generations_of_one_conversation_at_once_never_share_its_caches(model):
    prompt = USER[0]
    first, _ = reply(model, prompt, conversation="twice")
    follow_up = prompt + first + USER[1]
    holder = model.stream(torch.tensor([follow_up]), max_new_tokens=NEW, stop_token_ids=[], conversation="twice",
                          exact=False)
    held = next(holder)
    assert held.cached > 0
    beside, f = reply(model, follow_up, conversation="twice")  # the state is taken: this one starts cold
    assert f.cached == 0
    rest = [t for r in holder for t in r.tokens]
    assert held.tokens + rest == beside == reply(model, follow_up)[0]
    model.prefix_store.clear()


def test_sampling_on_a_kept_prefix_follows_the_base_distribution(tmp_path):
    """Every sample after the first starts from the previous one's rows of the prompt (all but its last token)."""
    base = tiny_base("llama", vocab=VOCAB, seed=5)
    with torch.no_grad():  # flatter logits, as test_lossless_sampling
        base.get_output_embeddings().weight.mul_(0.3)
    model = make_model((base, read_checkpoint(random_draft(base, str(tmp_path / "d"), seed=2))))
    cached = []
    original = model._kept_rounds

    def counted(turn, *args):
        cached.append(turn.start)
        return original(turn, *args)

    model._kept_rounds = counted
    assert_follows_base_distribution(model, SamplingParams(1.0), conversation="sampled", exact=False)
    assert cached[0] == 0 and set(cached[1:]) == {2}


# ------------------------------------------------------------------------------------------------------------------
def graphed(model: EaModel, capture: bool = False, capacity: int = 512) -> EaModel:
    """The base's, the head's and the round's CUDA-graph runners, warmed and in use (test_cuda_round.py's way)."""
    model.base.compiled = GraphedDecode(model.base, (1, 8), capacity, capture)
    model.base.compiled.warm()
    step = HeadStep(model.ea_layer, model.base.lm_head)
    model.compiled_draft = GraphedDraft(step, (4,), capacity, capture)
    model.compiled_draft.warm()
    shape = model.shape_of(model.tree)
    runner = CudaRound(model.base, step, shape, capture)
    runner.warm()
    model.compiled_rounds[shape] = runner
    return model


def steps_of(model, monkeypatch) -> dict[str, int]:
    """Counts the graph runners' steps by runner until the test ends."""
    counts = {}
    runners = {"base": model.base.compiled, "draft": model.compiled_draft,
               "round": next(iter(model.compiled_rounds.values()))}  # fmt: skip
    for name, runner in runners.items():
        original = runner.steps.run

        def counted(key, *args, _name=name, _original=original):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(key, *args)

        monkeypatch.setattr(runner.steps, "run", counted)
    return counts


@pytest.mark.parametrize("mode", ["eagle", "vanilla", "context-drafts", "sampled"])
def test_the_cuda_graph_runners_take_the_kept_rows_by_copy_and_give_them_back(tmp_path, monkeypatch, mode):
    model = graphed(tiny_model(tmp_path))
    steps = steps_of(model, monkeypatch)
    kw = dict(MODES.get(mode, {}))
    if mode == "sampled":  # no identity with a cold start to check (draws): the rows kept and read, the tokens valid
        torch.manual_seed(0)
        prompt = USER[0]
        for user in USER[1:3]:
            answer, first = reply(model, prompt, conversation="s", temperature=0.8)
            prompt = prompt + answer + user
        assert first.cached > len(USER[0]) and steps.get("draft", 0) > 0
    else:
        if mode == "context-drafts":
            model.context_stats = ContextStats(always=True)
        turns = converse(model, mode, turns=3, **kw)
        assert_kept_the_last_sequence(model, turns, mode)
        used = {"eagle": "round", "vanilla": "base", "context-drafts": "draft"}[mode]
        assert steps.get(used, 0) > 0, steps  # the runners' static caches did the work
    kept = model.prefix_store.get("s" if mode == "sampled" else mode)
    lent = [model.base.compiled.cache, model.compiled_draft.cache, next(iter(model.compiled_rounds.values())).cache]
    assert not kept.base.lent and all(kept.base is not c and kept.head is not c for c in lent)  # copies of their rows
    for runner in (model.base.compiled, model.compiled_draft):  # given back
        cache = runner.lease(64)
        assert cache is not None
        runner.release(cache)


def test_a_warm_turn_beside_one_holding_the_graphs_caches_runs_on_its_kept_caches(tmp_path, monkeypatch):
    model = graphed(tiny_model(tmp_path))
    first, _ = reply(model, USER[0], conversation="k")
    follow_up = USER[0] + first + USER[1]
    holder = model.stream(torch.tensor([USER[2]]), max_new_tokens=NEW, stop_token_ids=[])
    next(holder), next(holder)  # holds the graphs' caches
    steps = steps_of(model, monkeypatch)
    warm, f = reply(model, follow_up, conversation="k")
    assert not steps and f.cached > len(USER[0])  # eager, on the kept caches themselves
    holder.close()
    assert warm == reply(model, follow_up)[0]
    model.prefix_store.clear()


def test_the_compiled_cpu_forwards_on_the_kept_prefix_give_the_cold_starts_tokens(tmp_path, monkeypatch):
    """The base's compiled graphs (compiled.py; one bucket: the vanilla step padded to it) on a 2-layer base, with
    EAGLE's general loop (sampled turns' and static trees' rounds) over them; the round's own graphs: the next test."""
    monkeypatch.setenv("EAGLE_AOT_DIR", str(tmp_path / "aot"))
    model = tiny_model(tmp_path, eagle3=False, layers=2)
    graphs = model.compile_base((8,))
    graphs.warm()
    model.base.compiled = graphs
    calls = count_calls(monkeypatch, graphs.graphs)
    for mode in ("vanilla", "general-loop"):
        turns = converse(model, mode, turns=3, **MODES[mode])
        assert_kept_the_last_sequence(model, turns, mode)
    assert calls["call"] > 100  # the graphs did the work (a kept cache grown under them keeps their slack)


@pytest.mark.slow
def test_the_compiled_cpu_rounds_on_the_kept_prefix_give_the_cold_starts_tokens(tmp_path, monkeypatch):
    """Compiled graphs (compiled.py, round_graphs.CompiledRound) on a 2-layer base: each graph compiles in seconds."""
    monkeypatch.setenv("EAGLE_AOT_DIR", str(tmp_path / "aot"))
    model = tiny_model(tmp_path, eagle3=False, layers=2)
    graphs = model.compile_base((8,))
    graphs.warm()
    draft = model.compile_draft((4,))
    draft.warm()
    model.base.compiled, model.compiled_draft = graphs, draft
    runner = model.compile_round()
    calls = count_calls(monkeypatch, runner.verify_graph)
    for mode in ("eagle", "vanilla"):
        turns = converse(model, mode, turns=3, **MODES[mode])
        assert_kept_the_last_sequence(model, turns, mode)
    assert calls["call"] > 20  # the compiled round did the work


# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_captured_cuda_graphs_on_the_kept_prefix_give_the_cold_starts_tokens(tmp_path):
    model = graphed(tiny_model(tmp_path, device="cuda"), capture=True)
    round_runner = next(iter(model.compiled_rounds.values()))
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in round_runner.steps.graphs.values())
    for mode in ("eagle", "vanilla", "context-drafts"):
        if mode == "context-drafts":
            model.context_stats = ContextStats(always=True)
        turns = converse(model, mode, **MODES[mode])
        assert_kept_the_last_sequence(model, turns, mode)
        kept = model.prefix_store.get(mode)
        assert kept.base.layers[0].keys.is_cuda and not kept.base.lent


@pytest.mark.parametrize("eagle", [False, True])
def test_a_generation_that_reads_a_conversation_without_keep_leaves_it_as_it_was(tmp_path, eagle):
    model = tiny_model(tmp_path)
    prompt = USER[0]
    answer, _ = reply(model, prompt, conversation="c")
    before = model.prefix_store.get("c")
    kept_tokens, kept_rows = list(before.tokens), before.base_rows
    keys = [layer.keys[:, :, :kept_rows].clone() for layer in before.base.layers]
    later = prompt + answer[:4] + [2, 9, 2, 9]  # another text over rows the conversation holds
    side, first = reply(model, later, conversation="c", keep=False, eagle=eagle, new=8)
    assert first.cached > 0 and side == reply(model, later, eagle=eagle, new=8)[0]  # read the rows, same tokens
    after = model.prefix_store.get("c")
    assert after is before and after.tokens == kept_tokens and after.base_rows == kept_rows
    assert all(torch.equal(layer.keys[:, :, :kept_rows], k) for layer, k in zip(after.base.layers, keys))
    assert model.prefix_store.keys() == ["c"]  # nothing kept for the reading generation
    follow = prompt + answer + USER[1]
    warm, first = reply(model, follow, conversation="c")
    assert warm == reply(model, follow)[0] and first.cached >= len(prompt) + len(answer) - 1 - 4  # all but the lag


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_by_default_a_turn_reads_only_the_rows_a_prefill_wrote_and_answers_as_a_cold_start(tmp_path, mode):
    """A reply's rows come from decoding steps (one-row passes, trees, compiled graphs), which some paths compute with
    other kernels than a prefill: the default reads the earlier prompts' rows only, so every warm turn sees the
    bits a cold prefill computes; exact=False reads the reply's rows too."""
    model = tiny_model(tmp_path)
    kw = MODES[mode]
    sequence, prompts = [], []
    for user in USER[:3]:
        prompt = sequence + user
        rounds = list(model.stream(torch.tensor([prompt]), max_new_tokens=NEW, stop_token_ids=[], conversation="d",
                                   **kw))  # fmt: skip
        warm = [t for r in rounds for t in r.tokens]
        assert warm == reply(model, prompt, **kw)[0]
        assert rounds[0].cached == (len(prompts[-1]) if prompts else 0)  # the last prompt's rows, not its reply's
        assert model.prefix_store.get("d").prefilled == len(prompt)
        prompts.append(prompt)
        sequence = prompt + warm
    follow = sequence + USER[3]
    _, first = reply(model, follow, conversation="d", exact=False, **kw)
    assert first.cached > len(prompts[-1])  # every valid row, the last reply's too
