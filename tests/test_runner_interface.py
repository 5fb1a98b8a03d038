"""The runner interface (eagle/runtime/runners.py): the base and the drafter hand a pass or a head step to the runner
in use only where its `takes` says so, through `run`, on a cache it `lease`d or one made with a bucket of room; a
backend that answers these calls plugs in without a change to the algorithm, and the output stays vanilla's."""

from dataclasses import FrozenInstanceError

import pytest
import torch
from tiny import random_draft, tiny_base

from eagle.decoding.draft import Drafter, HeadStep
from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import read_checkpoint
from eagle.models.kv_cache import TreeKVCache
from eagle.runtime import compiled, compiled_draft, cuda_graphs
from eagle.runtime.compiled import CompiledDecode
from eagle.runtime.compiled_draft import CompiledDraft
from eagle.runtime.config import RuntimeConfig


class Recording:
    """A backend that runs the eager function itself, for passes of up to 4 rows after the first two positions,
    and records what it was handed; `own`: a cache it leases (as CUDA graphs do), else None."""

    def __init__(self, fn, own: TreeKVCache | None = None):
        self.fn, self.own, self.buckets = fn, own, (1, 2, 4)
        self.taken, self.leased, self.released = [], [], []

    def takes(self, cache, rows: int, at: int) -> bool:
        return at > 1 and rows <= 4 and (self.own is None or cache is self.own)

    def run(self, *args):
        self.taken.append(args)
        return self.fn(*args)

    def lease(self, capacity: int):
        self.leased.append(capacity)
        return self.own

    def release(self, cache) -> None:
        self.released.append(cache)


def make_model(tmp_path) -> EaModel:
    base = tiny_base()
    config, state = read_checkpoint(random_draft(base, str(tmp_path / "d")))
    return EaModel(base, load_head(base, config, state), None)


def test_a_backend_runs_the_passes_it_takes_and_the_output_stays_vanillas(tmp_path):
    model = make_model(tmp_path)
    prompt = torch.randint(0, model.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    vanilla = model.naivegenerate(prompt, max_new_tokens=24)
    eagle = model.eagenerate(prompt, max_new_tokens=24)

    base = model.base
    passes = Recording(lambda ids, pos, mask, cache, features: base.decode(ids, pos, mask, cache, features, False))
    steps = Recording(lambda hidden, ids, pos, mask, cache, at: HeadStep(model.ea_layer, base.lm_head)(
        hidden, ids, pos, mask, cache, at))  # fmt: skip
    base.compiled, model.compiled_draft = passes, steps
    try:
        assert torch.equal(model.naivegenerate(prompt, max_new_tokens=24), vanilla)
        assert torch.equal(model.eagenerate(prompt, max_new_tokens=24), eagle)
    finally:
        base.compiled, model.compiled_draft = None, None
    assert passes.taken and steps.taken  # the steps and the verify passes, not the prompt's
    assert all(args[0].shape[1] <= 4 and args[3].length > 1 for args in passes.taken)
    assert all(args[1].shape[1] <= 4 and args[5] > 1 for args in steps.taken)
    assert passes.leased and steps.leased  # asked for a cache of their own each generation (none given)


def test_a_backend_with_a_cache_of_its_own_gets_the_generation_on_it_and_it_back(tmp_path):
    model = make_model(tmp_path)
    head, base = model.ea_layer, model.base
    own = head.new_cache(64, zeroed=True)
    steps = Recording(HeadStep(head, base.lm_head), own=own)
    with Drafter(head, base.lm_head, 32, steps) as drafter:
        assert drafter.cache is own and steps.leased == [32]
    assert steps.released == [own]
    other = Recording(HeadStep(head, base.lm_head), own=None)  # none of its own: the drafter makes one, with room
    with Drafter(head, base.lm_head, 32, other) as drafter:
        assert drafter.cache is not own and drafter.cache.capacity == 32 + max(other.buckets)
    with base.leased_cache(16) as cache:  # no runner: a plain cache
        assert cache.capacity == 16


def test_the_cpu_graphs_take_passes_a_bucket_holds_after_two_cached_rows(tmp_path):
    """dynamo specialises an int of 0 or 1: a pass written there would compile a graph of its own."""
    model = make_model(tmp_path)
    passes = CompiledDecode(model.base, buckets=(1, 4, 8))
    steps = CompiledDraft(HeadStep(model.ea_layer, model.base.lm_head), buckets=(1, 2))
    cache = model.base.new_cache(32)
    assert passes.takes(cache, 1, 2) and passes.takes(cache, 8, 20) and passes.takes(cache, 3, 5)
    assert not passes.takes(cache, 1, 1) and not passes.takes(cache, 9, 20)
    assert steps.takes(cache, 2, 2) and not steps.takes(cache, 4, 2) and not steps.takes(cache, 1, 0)
    assert passes.lease(32) is None and steps.lease(32) is None


def test_one_frozen_runtime_config_says_which_backend_every_runner_is_built_for(tmp_path):
    """The device's defaults (buckets, draws), the compile mode checked once, and the model's builders reading it."""
    cpu, cuda = RuntimeConfig.of(tiny_base()), RuntimeConfig("cuda", "on")
    assert (cpu.device, cpu.compile, cpu.batched_draws, cpu.backend) == ("cpu", "off", False, CompiledDecode.kind)
    assert (cpu.base_buckets, cpu.draft_buckets) == (compiled.BUCKETS, compiled_draft.DRAFT_BUCKETS)
    assert (cuda.base_buckets, cuda.draft_buckets) == (cuda_graphs.BUCKETS, cuda_graphs.DRAFT_BUCKETS)
    assert cuda.batched_draws and cuda.backend == cuda_graphs.GraphedRunner.kind and not cuda.inductor_kernels
    assert RuntimeConfig("cuda", "inductor").inductor_kernels and not RuntimeConfig("cpu", "inductor").inductor_kernels
    subset = cpu.with_buckets(base=(1, 8))
    assert (subset.base_buckets, subset.draft_buckets) == ((1, 8), cpu.draft_buckets) and cpu.base_buckets != (1, 8)
    with pytest.raises(FrozenInstanceError):
        cpu.compile = "on"
    with pytest.raises(ValueError, match="compile must be one of"):
        RuntimeConfig(compile="yes")

    model = make_model(tmp_path)
    assert model.runtime == cpu
    try:
        passes, steps = model.compile_base((1, 8)), model.compile_draft((2,))  # built, compiled at their first call
        assert isinstance(passes, CompiledDecode) and passes.buckets == (1, 8)
        assert isinstance(steps, CompiledDraft) and steps.buckets == (2,)
        assert model.compile_draft().buckets == cpu.draft_buckets
    finally:
        model.base.decompile()
