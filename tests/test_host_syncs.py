"""The decoding loop reads the device once per round: the verified tree and the base's draws come to the host in
one transfer (on a GPU every read is a sync that idles it). Counted on CPU with a hook on every tensor-to-host read
(`tolist`, `item`, `int`, `bool`, ...); sampling on CPU draws per visited node (a read each, free on a CPU), so
the count is pinned for greedy decoding and for the batched draw that CUDA uses."""

from dataclasses import replace

import pytest
import torch
from host_reads import HostReads
from tiny import random_draft, tiny_base

from eagle.decoding.generate import TreeSpec
from eagle.decoding.tree import MC_SIM_7B_63
from eagle.model.ea_model import EaModel, load_head
from eagle.models.checkpoint import read_checkpoint


@pytest.fixture(scope="module", params=[False, True], ids=["eagle12", "eagle3"])
def model(request, tmp_path_factory):
    base = tiny_base("llama")
    folder = random_draft(
        base, str(tmp_path_factory.mktemp("d")), eagle3=request.param, draft_vocab=12 if request.param else None
    )
    return EaModel(base, load_head(base, *read_checkpoint(folder)), None)


def reads_per_round(model, temperature=0.0, **kw) -> float:
    prompt = torch.tensor([[3, 4, 5, 9]])
    stream = model.stream(prompt, temperature=temperature, max_new_tokens=40, stop_token_ids=(), **kw)
    next(stream)  # the prefill and the draft's first commit: once per reply
    with HostReads() as reads:
        rounds = sum(1 for _ in stream)
    return sum(reads.count.values()) / rounds


@pytest.mark.parametrize("tree", [TreeSpec(), TreeSpec(12, 3, 4), TreeSpec(choices=tuple(map(tuple, MC_SIM_7B_63)))],
                         ids=["60-7-10", "12-3-4", "static"])  # fmt: skip
def test_greedy_eagle_reads_the_device_once_per_round(model, tree):
    assert reads_per_round(model, tree=tree) == 1


def test_vanilla_reads_the_device_once_per_token(model):
    assert reads_per_round(model, eagle=False) == 1


def test_sampling_with_batched_draws_reads_the_device_once_per_round(model, monkeypatch):
    """CUDA's path (one draw per tree node, all at once: `RuntimeConfig.batched_draws`), chosen on CPU."""
    monkeypatch.setattr(model, "runtime", replace(model.runtime, batched_draws=True))
    assert reads_per_round(model, temperature=0.8) == 1
    monkeypatch.setattr(model, "runtime", replace(model.runtime, batched_draws=False))
    assert reads_per_round(model, temperature=0.8) > 1  # the CPU's: a read per node the walk visits


def test_timers_wait_for_every_gpu_a_device_map_uses(monkeypatch):
    """A base spread over two GPUs queues work on both: a timer that waits for one undercounts."""
    from eagle.timing import timed

    waited = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    timed(torch.device("cuda:0"), lambda: None)
    assert waited == [0, 1, 0, 1]  # before and after
