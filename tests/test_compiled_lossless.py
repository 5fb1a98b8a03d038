"""The lossless guarantees on the compiled path (eagle/runtime/compiled.py, compiled_draft.py): greedy output equals
transformers' greedy `generate` for every base architecture and head format, sampling follows the base's
distribution, and the caches after compaction equal a full recompute, with the base's forwards and the draft's
steps running as compiled graphs (one bucket each here, so that padding is exercised on almost every call and the
graphs compile in seconds). Architectures beyond Llama are marked slow (a compile each)."""

import pytest
import torch
from lossless_checks import (
    FITS,
    assert_every_tree_equals_generate,
    assert_follows_base_distribution,
    assert_vanilla_equals_generate,
    make_model,
)
from tiny import random_draft, save_base, tiny_base
from transformers import DynamicCache

from eagle.decoding.generate import Budget, eagle_rounds
from eagle.decoding.verify import SamplingParams, TokenPicker
from eagle.model.ea_model import EaModel

BASE_BUCKETS, DRAFT_BUCKETS = (8,), (4,)


def compile_now(model: EaModel) -> EaModel:
    """Build, warm and install the compiled graphs (what compile_rounds does, without timing them)."""
    graphs = model.compile_base(BASE_BUCKETS)
    graphs.warm()
    draft = model.compile_draft(DRAFT_BUCKETS)
    draft.warm()
    model.base.compiled, model.compiled_draft = graphs, draft
    return model


def calls_of(compiled) -> dict[int, int]:
    """Counts the calls of each bucket's graph from now on."""
    counts = {}
    graphs = compiled.graphs
    for rows in list(graphs.graphs):
        graph = graphs.graphs[rows]

        def counted(*args, _graph=graph, _rows=rows):
            counts[_rows] = counts.get(_rows, 0) + 1
            return _graph(*args)

        graphs.graphs[rows] = counted
    return counts


ARCHS = [
    pytest.param("llama", False, id="llama-eagle12"),
    pytest.param("llama", True, id="llama-eagle3"),
    pytest.param("qwen2", False, id="qwen2-eagle12", marks=pytest.mark.slow),
    pytest.param("qwen2", True, id="qwen2-eagle3", marks=pytest.mark.slow),
    pytest.param("mixtral", False, id="mixtral-eagle12", marks=pytest.mark.slow),
    pytest.param("llama31", False, id="llama31-eagle12", marks=pytest.mark.slow),
    pytest.param("llama31", True, id="llama31-eagle3", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("arch, eagle3", ARCHS)
def test_compiled_greedy_eagle_and_vanilla_equal_hf_generate(tmp_path, arch, eagle3):
    base = tiny_base(arch)
    save_base(base, str(tmp_path / "base"))
    draft = random_draft(base, str(tmp_path / "draft"), eagle3=eagle3, draft_vocab=12 if eagle3 else None)
    model = compile_now(EaModel.from_pretrained(str(tmp_path / "base"), draft, dtype=torch.float32))
    verify_calls, draft_calls = calls_of(model.base.compiled), calls_of(model.compiled_draft)
    assert_every_tree_equals_generate(model, base)
    assert verify_calls[8] > 20 and draft_calls[4] > 20  # the graphs did the work
    assert_vanilla_equals_generate(model, base)


def test_compiled_sampling_follows_the_base_distribution(tmp_path):
    base = tiny_base("llama", vocab=8, seed=5)
    with torch.no_grad():  # flatter logits, as test_lossless_sampling
        base.get_output_embeddings().weight.mul_(0.3)
    from eagle.models.checkpoint import read_checkpoint

    model = compile_now(make_model((base, read_checkpoint(random_draft(base, str(tmp_path / "d"), seed=2))),
                                   total_token=8, depth=3, top_k=4))  # fmt: skip
    verify_calls = calls_of(model.base.compiled)
    assert_follows_base_distribution(model, SamplingParams(1.0))
    assert verify_calls[8] > 1000


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle12", "eagle3"])
def test_compiled_caches_after_compaction_equal_a_full_recompute(tmp_path, eagle3):
    """The pads' rows written by a padded verify pass never survive compaction: the kept rows equal a plain run."""
    base = tiny_base("qwen2")
    save_base(base, str(tmp_path / "base"))
    draft = random_draft(base, str(tmp_path / "draft"), eagle3=eagle3, draft_vocab=12 if eagle3 else None)
    model = compile_now(EaModel.from_pretrained(str(tmp_path / "base"), draft, dtype=torch.float32))
    from eagle.decoding.draft import Drafter

    prompt = torch.tensor([[4, 9, 2, 7, 7, 3]])
    with torch.inference_mode():  # as EaModel runs it: the caches too
        cache = model.base.new_cache(6 + 128)
        drafter = Drafter(model.ea_layer, model.base.lm_head, 6 + 256, model.compiled_draft)
        rounds = list(eagle_rounds(model.base, drafter, prompt, TokenPicker(SamplingParams()),
                                   Budget(6, 30, 2048, set()), FITS, cache))  # fmt: skip
    tokens = prompt[0].tolist() + [t for r in rounds for t in r.tokens]
    assert sum(r.accepted for r in rounds) > 0, "no acceptance: compaction was not exercised"
    committed = len(tokens) - 1
    fresh = DynamicCache()
    with torch.no_grad():
        base(torch.tensor([tokens[:committed]]), past_key_values=fresh, use_cache=True)
    for ours, ref in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(ours.keys[:, :, :committed], ref.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values[:, :, :committed], ref.values, atol=1e-5, rtol=1e-4)
