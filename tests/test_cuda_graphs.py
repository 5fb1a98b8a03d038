"""The CUDA-graph rounds (eagle/runtime/cuda_graphs.py) on CPU, everything but the capture: static buffers per bucket,
pads, masks widened to a span of the cache, rows written by position, the runner's caches leased to one
generation at a time. Greedy output equals transformers' greedy `generate`, sampling follows the base's
distribution; on CUDA (marked gpu) the same with the graphs captured, and one host read a round."""

import collections
import functools

import pytest
import torch
from host_reads import HostReads
from lossless_checks import (
    PROMPTS,
    assert_every_tree_equals_generate,
    assert_follows_base_distribution,
    assert_vanilla_equals_generate,
    make_model,
)
from tiny import random_draft, save_base, tiny_base
from torch.utils._python_dispatch import TorchDispatchMode

from eagle.decoding.draft import HeadStep
from eagle.decoding.verify import SamplingParams
from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import read_checkpoint
from eagle.runtime.cuda_graphs import GraphedDecode, GraphedDraft

BASE_BUCKETS, DRAFT_BUCKETS = (1, 8), (4,)
# nothing compiles on this path: every architecture and head format in seconds
ARCHS = [("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True), ("mixtral", False),
         ("llama31", False), ("llama31", True)]  # fmt: skip


def graph_now(model: EaModel, capture: bool = False, capacity: int = 512) -> EaModel:
    """Build, warm and install the graphed rounds (what compile_rounds does on CUDA, without timing them)."""
    model.base.compiled = GraphedDecode(model.base, BASE_BUCKETS, capacity, capture)
    model.compiled_draft = GraphedDraft(HeadStep(model.ea_layer, model.base.lm_head), DRAFT_BUCKETS, capacity, capture)
    lines = []  # every bucket captured (at every span), one line each
    assert set(model.base.compiled.warm(lines.append)) == set(BASE_BUCKETS)
    assert set(model.compiled_draft.warm(lines.append)) == set(DRAFT_BUCKETS)
    assert [line.split(" as ")[0] for line in lines] == ["captured the 1-row forward", "captured the 8-row forward",
                                                         "captured the 4-row draft step"]  # fmt: skip
    return model


def replays_of(runner, monkeypatch, spans: bool = False) -> dict[tuple, int]:
    """Counts the calls of each key's function (capture=False) until the test ends, by rows and flags (and the
    key's span of the cache, the key's last item, with `spans`)."""
    counts = {}
    original = runner.steps.run

    def counted(key, *args):
        counted_as = key if spans else key[:-1]
        counts[counted_as] = counts.get(counted_as, 0) + 1
        return original(key, *args)

    monkeypatch.setattr(runner.steps, "run", counted)
    return counts


@pytest.mark.parametrize("arch, eagle3", ARCHS)
def test_graphed_greedy_eagle_and_vanilla_equal_hf_generate(tmp_path, monkeypatch, arch, eagle3):
    base = tiny_base(arch)
    save_base(base, str(tmp_path / "base"))
    draft = random_draft(base, str(tmp_path / "draft"), eagle3=eagle3, draft_vocab=12 if eagle3 else None)
    model = graph_now(EaModel.from_pretrained(str(tmp_path / "base"), draft, dtype=torch.float32))
    verify, drafts = replays_of(model.base.compiled, monkeypatch), replays_of(model.compiled_draft, monkeypatch)
    assert_every_tree_equals_generate(model, base)
    assert verify[(8, True)] > 20 and drafts[(4,)] > 20  # the static buffers did the work
    assert_vanilla_equals_generate(model, base)
    assert verify[(1, False)] >= 31


def test_graphed_sampling_follows_the_base_distribution(tmp_path, monkeypatch):
    base = tiny_base("llama", vocab=8, seed=5)
    with torch.no_grad():  # flatter logits, as test_lossless_sampling
        base.get_output_embeddings().weight.mul_(0.3)
    model = make_model((base, read_checkpoint(random_draft(base, str(tmp_path / "d"), seed=2))),
                       total_token=8, depth=3, top_k=4)  # fmt: skip
    graph_now(model)
    verify = replays_of(model.base.compiled, monkeypatch)
    assert_follows_base_distribution(model, SamplingParams(1.0))
    assert verify[(8, True)] > 1000


@pytest.fixture(scope="module")
def graphed(tmp_path_factory):
    base = tiny_base("llama")
    folder = random_draft(base, str(tmp_path_factory.mktemp("d")), eagle3=True, draft_vocab=12)
    return base, graph_now(EaModel(base, load_head(base, *read_checkpoint(folder)), None, 8, 3, 4))


def test_a_generation_beside_one_holding_the_graphs_caches_runs_eagerly_and_equally(graphed, monkeypatch):
    base, model = graphed
    ids = torch.tensor([PROMPTS[0]])
    alone = model.eagenerate(ids, max_new_tokens=24, stop_token_ids=[]).tolist()
    first = model.stream(ids, max_new_tokens=24, stop_token_ids=[])
    head = [r.tokens for r in [next(first), next(first)]]  # holds both caches now
    assert model.base.compiled.lease(64) is None and model.compiled_draft.lease(64) is None
    verify = replays_of(model.base.compiled, monkeypatch)
    beside = model.eagenerate(ids, max_new_tokens=24, stop_token_ids=[]).tolist()
    assert beside == alone and not verify  # eager, on caches of its own
    rest = [r.tokens for r in first]
    assert ids[0].tolist() + [t for tokens in head + rest for t in tokens] == alone[0]
    first.close()
    cache = model.base.compiled.lease(64)  # given back when the stream ended
    assert cache is not None
    model.base.compiled.release(cache)


def test_an_abandoned_stream_gives_the_graphs_caches_back(graphed):
    _, model = graphed
    stream = model.stream(torch.tensor([PROMPTS[1]]), max_new_tokens=24, stop_token_ids=[])
    next(stream), next(stream)
    stream.close()  # what a dropped reply does (and garbage collection, for a stream no one closes)
    for runner in (model.base.compiled, model.compiled_draft):
        cache = runner.lease(64)
        assert cache is not None
        runner.release(cache)


def test_a_base_spread_over_devices_is_refused_in_one_line_and_decodes_eagerly(tmp_path, monkeypatch):
    """device_map over several GPUs: graphs hold one device's addresses, so compile_rounds says why in one line and
    the model decodes eagerly (here the spread is a layer on the meta device, and the CUDA route is forced)."""
    from eagle.model.compiling import compile_rounds
    from eagle.runtime.config import RuntimeConfig

    base = tiny_base("llama")
    model = EaModel(base, load_head(base, *read_checkpoint(random_draft(base, str(tmp_path / "d")))), None, 8, 3, 4)
    base.model.layers[-1].to("meta")
    with pytest.raises(ValueError, match="whole base on one device"):
        GraphedDecode(model.base, BASE_BUCKETS, 64, capture=False)
    model.runtime = RuntimeConfig("cuda", "on")  # the CUDA route, on this CPU
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    lines = []
    assert compile_rounds(model, lines.append) is False
    assert model.base.compiled is None and model.compiled_draft is None
    assert any("whole base on one device" in line and "decoding eagerly" in line for line in lines), lines


def test_a_generation_longer_than_the_graphs_cache_runs_eagerly_and_equally(tmp_path, monkeypatch):
    base = tiny_base("llama")
    draft = random_draft(base, str(tmp_path / "d"))
    model = graph_now(EaModel(base, load_head(base, *read_checkpoint(draft)), None, 8, 3, 4), capacity=32)
    verify = replays_of(model.base.compiled, monkeypatch)
    ids = torch.tensor([PROMPTS[0]])
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                        min_new_tokens=40, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert model.eagenerate(ids, max_new_tokens=40, stop_token_ids=[]).tolist() == ref.tolist()
    assert not verify  # 40 new tokens do not fit 32 positions: eager on caches of its own


def test_a_reply_crossing_a_span_of_the_cache_equals_greedy_generate(graphed, monkeypatch):
    """Passes attend over the cache's first 256 positions while prefix and rows fit there, then over the first 512
    (the graphs' capacity is 512 + the widest bucket): the switch in the middle of a reply changes nothing."""
    base, model = graphed
    assert model.base.compiled.spans == (256, 512, 520) and model.compiled_draft.spans == (256, 512, 516)
    verify, drafts = replays_of(model.base.compiled, monkeypatch, spans=True), replays_of(model.compiled_draft,
                                                                                        monkeypatch, spans=True)
    ids = torch.tensor([(PROMPTS[0] * 100)[:236]])
    ref = base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48,
                        min_new_tokens=48, eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert model.eagenerate(ids, max_new_tokens=48, stop_token_ids=[]).tolist() == ref.tolist()
    assert model.naivegenerate(ids, max_new_tokens=48, stop_token_ids=[]).tolist() == ref.tolist()
    assert {key[-1] for key in verify} == {256, 512} and {key[-1] for key in drafts} == {256, 512}, (verify, drafts)


def test_the_static_cache_masks_out_stale_rows_of_an_earlier_generation(graphed):
    """A leased cache keeps the last reply's rows past its length; a captured pass attends over a span of the buffer
    that holds them, so only the widened mask keeps them out: a reply after a longer one equals greedy `generate`."""
    base, model = graphed
    short, long = torch.tensor([PROMPTS[2]]), torch.tensor([PROMPTS[0] * 3])
    ref = base.generate(short, attention_mask=torch.ones_like(short), do_sample=False, max_new_tokens=16,
                        min_new_tokens=16, eos_token_id=None, pad_token_id=0)  # fmt: skip
    model.eagenerate(long, max_new_tokens=48, stop_token_ids=[])
    assert model.eagenerate(short, max_new_tokens=16, stop_token_ids=[]).tolist() == ref.tolist()


class OpsOutsideGraphs(TorchDispatchMode):
    """Counts the aten ops dispatched outside the graphed functions (on CUDA, each is a host-side launch or
    bookkeeping op between replays), and the replays, per runner and bucket, while it is on."""

    def __init__(self, runners):
        super().__init__()
        self.ops, self.replays, self.inside = collections.Counter(), collections.Counter(), 0
        for runner in runners:  # capture off: a key's "graph" is its function, called once per replay
            graphs = runner.steps.graphs
            for key, fn in list(graphs.items()):
                graphs[key] = functools.partial(self._replay, (type(runner).__name__, *key), fn)

    def _replay(self, key, fn, *buffers):
        self.replays[key] += 1
        self.inside += 1
        try:
            return fn(*buffers)
        finally:
            self.inside -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


# Per round on the graphed path at EAGLE-2's GPU tree (60/7/10), as the code stands: on the forwards' graphs alone
# (sampling's path) a round is 9 replays (a draft step per level, the commit, one verify pass) and some 640 eager
# ops around them; with the round's own graphs (cuda_round.py, greedy) at most 3 replays (draft, verify, keep) and
# some 60 ops (a prompt's commit, eager, counted in). A vanilla step is one replay and 24 ops. Budgets a change may
# lower, not raise.
ROUND_BUDGET = {"eagle": (9, 700), "vanilla": (1, 24), "round": (3, 70)}


@pytest.mark.parametrize("method", ["eagle", "vanilla", "round"])
def test_a_graphed_round_stays_within_its_replays_and_eager_ops(tmp_path, method):
    base = tiny_base("llama")
    head = load_head(base, *read_checkpoint(random_draft(base, str(tmp_path), eagle3=True, draft_vocab=12)))
    model = EaModel(base, head, None, 60, 7, 10)
    model.base.compiled = GraphedDecode(model.base, capacity=256, capture=False)  # every bucket, as on CUDA
    model.compiled_draft = GraphedDraft(HeadStep(model.ea_layer, model.base.lm_head), capacity=256, capture=False)
    model.base.compiled.warm(), model.compiled_draft.warm()
    runners = [model.base.compiled, model.compiled_draft]
    if method == "round":
        runners.append(model.compile_round())  # CudaRound, capture off as the base's graphs
    counter = OpsOutsideGraphs(runners)
    stream = model.stream(torch.tensor([PROMPTS[0]]), max_new_tokens=48, stop_token_ids=[], eagle=method != "vanilla")
    next(stream)  # the prefill
    with counter:
        rounds = sum(1 for _ in stream)
    replays, ops = sum(counter.replays.values()) / rounds, sum(counter.ops.values()) / rounds
    verify = sum(n for key, n in counter.replays.items() if key[0] == "GraphedDecode" or key[1] == "verify")
    assert verify == rounds  # every pass graphed: the counts are of the graphed path
    most_replays, most_ops = ROUND_BUDGET[method]
    assert replays <= most_replays and ops <= most_ops, (replays, ops, counter.ops.most_common(8))


# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
def test_captured_rounds_on_cuda_equal_greedy_generate_and_read_the_host_once_a_round(tmp_path, eagle3):
    base = tiny_base("llama")
    save_base(base, str(tmp_path / "base"))
    draft = random_draft(base, str(tmp_path / "d"), eagle3=eagle3, draft_vocab=12 if eagle3 else None)
    model = EaModel.from_pretrained(str(tmp_path / "base"), draft, dtype=torch.float32, device_map="cuda",
                                    total_token=8, depth=3, top_k=4)  # fmt: skip
    graph_now(model, capture=True)
    assert model.base.compiled.steps.graphs and all(
        isinstance(g, torch.cuda.CUDAGraph) for g in model.base.compiled.steps.graphs.values()
    )
    cuda_base = model.base_model
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        ref = cuda_base.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), do_sample=False,
                                 max_new_tokens=40, min_new_tokens=40, eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert model.eagenerate(ids, max_new_tokens=40, stop_token_ids=[]).tolist() == ref.cpu().tolist()
        assert model.naivegenerate(ids, max_new_tokens=40, stop_token_ids=[]).tolist() == ref.cpu().tolist()
    stream = model.stream(torch.tensor([PROMPTS[0]]), max_new_tokens=32, stop_token_ids=())
    next(stream)
    with HostReads() as reads:
        rounds = sum(1 for _ in stream)
    assert sum(reads.count.values()) == rounds


def test_a_model_on_the_cpu_leaves_the_processes_cuda_attention_settings_alone():
    """runners.device_settings turns cuDNN's attention off for models on CUDA only (test_gpu.py checks that side)."""
    from eagle.runtime import runners
    from eagle.runtime.config import RuntimeConfig

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        runners.device_settings(RuntimeConfig.of(tiny_base()))
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
