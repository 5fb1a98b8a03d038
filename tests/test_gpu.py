"""CUDA checks (skipped without a GPU): the same losslessness on the device, in fp32 and half precision."""

import pytest
import torch
from tiny import random_draft, save_base, tiny_base

from eagle.model.ea_model import EaModel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    base = tiny_base("llama")
    save_base(base, str(root / "base"))
    return str(root / "base"), random_draft(base, str(root / "d"), eagle3=True, draft_vocab=12)


def test_fp32_on_cuda_equals_greedy_generate(folders):
    model = EaModel.from_pretrained(*folders, dtype=torch.float32, device_map="cuda")
    ids = torch.tensor([[3, 4, 5, 6]])
    ref = model.base_model.generate(ids.cuda(), attention_mask=torch.ones_like(ids).cuda(), do_sample=False,
                                    max_new_tokens=48, min_new_tokens=48)  # fmt: skip
    out = model.eagenerate(ids, max_new_tokens=48, stop_token_ids=[])
    assert out.tolist() == ref.cpu().tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_cuda_runs_and_accepts(folders, dtype):
    model = EaModel.from_pretrained(*folders, dtype=dtype, device_map="auto")
    out, new_tokens, rounds = model.eagenerate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=48, log=True,
                                               stop_token_ids=[])  # fmt: skip
    assert new_tokens == 48 and new_tokens / (rounds + 1) > 1.0


def test_a_greedy_round_synchronises_the_host_once_on_cuda(folders):
    """torch's sync debug mode warns at every host sync (reads, blocking copies, data-dependent shapes)."""
    import warnings

    model = EaModel.from_pretrained(*folders, dtype=torch.float32, device_map="cuda")
    stream = model.stream(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=32, stop_token_ids=())
    next(stream)  # prefill and the draft's first commit
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rounds = sum(1 for _ in stream)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]  # not the mode's own note
    assert len(syncs) <= rounds, f"{len(syncs)} host syncs in {rounds} rounds: {[str(w.message) for w in syncs[:3]]}"


def test_a_model_on_cuda_attends_without_cudnns_per_shape_plans(folders):
    """cuDNN's attention builds an execution plan per new shape (a new prompt length, a round's eager key lengths);
    a model built on CUDA turns it off, so scaled_dot_product_attention takes a kernel that needs none."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    EaModel.from_pretrained(*folders, dtype=torch.float16, device_map="cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
