"""The batch-invariant attention of bases that read GGUF blocks (eagle/kernels/row_attention.py, row_attention.cpp):
softmax attention within float32 rounding of SDPA, each row over only the keys it may see, in cache order, so a
tree node's forward is bit for bit the one-row step of the same token."""

import platform
import subprocess
import sys

import pytest
import torch
from kernel_builds import AVX2
from q4_fixtures import quantized_tiny_base

from eagle.kernels import few_rows, panel_kernel, row_attention
from eagle.models.masks import additive_mask

needs_kernel = pytest.mark.skipif(
    not panel_kernel.available(), reason=f"panel kernel: {panel_kernel._state.get('why')}"
)
H, HKV, D, L = 6, 2, 64, 45


def sdpa(q, k, v, allowed):  # float64 reference, key/value heads copied to their query heads
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, attn_mask=allowed[None, None])
    return out.transpose(1, 2)  # [1, M, H, D]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
@pytest.mark.parametrize("d", [64, 40])
def test_row_attention_is_sdpa_for_additive_bool_and_causal_masks(rows, d):
    g = torch.Generator().manual_seed(rows * d)
    q, k, v = torch.randn(1, H, rows, d, generator=g), torch.randn(1, HKV, L, d, generator=g), torch.randn(1, HKV, L, d, generator=g)
    allowed = torch.rand(rows, L, generator=g) < 0.6
    allowed[:, 0] = True
    additive = additive_mask(allowed, torch.float32)  # [1, 1, rows, L]
    out = torch.ops.eagle.row_attention(q, k, v, additive, d**-0.5)
    assert out.shape == (1, rows, H, d)
    torch.testing.assert_close(out.double(), sdpa(q, k, v, allowed), rtol=0, atol=2e-6)
    assert torch.equal(torch.ops.eagle.row_attention(q, k, v, allowed[None, None], d**-0.5), out)
    causal = torch.ones(rows, L, dtype=torch.bool).tril(L - rows)
    torch.testing.assert_close(torch.ops.eagle.row_attention(q, k, v, None, d**-0.5).double(),
                               sdpa(q, k, v, causal), rtol=0, atol=2e-6)  # fmt: skip


@needs_kernel
def test_a_row_over_masked_gaps_equals_the_row_over_its_keys_alone():
    """Batch invariance: the keys a row may not see (a tree's other branches) and the other rows change nothing."""
    g = torch.Generator().manual_seed(0)
    rows = 5
    q, k, v = torch.randn(1, H, rows, D, generator=g), torch.randn(1, HKV, L, D, generator=g), torch.randn(1, HKV, L, D, generator=g)
    allowed = torch.rand(rows, L, generator=g) < 0.5
    out = torch.ops.eagle.row_attention(q, k, v, allowed[None, None], D**-0.5)
    for i in range(rows):
        keys = allowed[i].nonzero()[:, 0]
        alone = torch.ops.eagle.row_attention(q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], None, D**-0.5)
        assert torch.equal(alone[0, 0], out[0, i])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_trees_rows_split_in_tasks_over_their_shared_context_equal_each_row_alone(threads):
    """Many rows over one context: row 0's chunks are shared by the rows with the same keys, and such a group is
    split in tasks of fewer rows to balance the threads. However the rows are split and whatever the threads, each
    row equals, bit for bit, the row over its keys alone; the additive mask's blocked values (finfo.min and -inf,
    mixed) hide keys as a bool mask does."""
    g = torch.Generator().manual_seed(threads)
    rows, context = 16, 300
    length = context + rows
    q = torch.randn(1, H, rows, D, generator=g)
    k, v = torch.randn(1, HKV, length, D, generator=g), torch.randn(1, HKV, length, D, generator=g)
    allowed = torch.zeros(rows, length, dtype=torch.bool)
    allowed[:, :context] = True
    allowed[:, context:] = (torch.rand(rows, rows, generator=g) < 0.5).tril()  # tree-like: some earlier rows
    allowed[torch.arange(rows), context + torch.arange(rows)] = True
    additive = additive_mask(allowed, torch.float32)
    additive[0, 0, ::2][additive[0, 0, ::2] < 0] = float("-inf")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.eagle.row_attention(q, k, v, additive, D**-0.5)
        assert torch.equal(torch.ops.eagle.row_attention(q, k, v, allowed[None, None], D**-0.5), out)
        for i in range(rows):
            keys = allowed[i].nonzero()[:, 0]
            alone = torch.ops.eagle.row_attention(q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], None, D**-0.5)
            assert torch.equal(alone[0, 0], out[0, i])
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), sdpa(q, k, v, allowed), rtol=0, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("length", [129, 300, 1030])
def test_a_long_row_in_chunks_is_sdpa_and_the_row_over_its_keys_alone(length):
    """Past 128 keys a row's keys are split in chunks (tasks of their own): still SDPA, and still batch invariant:
    a tree row over the context and its own gaps (a consecutive prefix, then keys gathered) equals, bit for bit, the
    row over those keys alone (all consecutive)."""
    g = torch.Generator().manual_seed(length)
    rows = 6
    q = torch.randn(1, H, rows, D, generator=g)
    k, v = torch.randn(1, HKV, length, D, generator=g), torch.randn(1, HKV, length, D, generator=g)
    allowed = torch.rand(rows, length, generator=g) < 0.7
    allowed[:, : length - rows - 20] = True  # the context, then tree-like gaps
    allowed[torch.arange(rows), length - rows + torch.arange(rows)] = True
    out = torch.ops.eagle.row_attention(q, k, v, allowed[None, None], D**-0.5)
    torch.testing.assert_close(out.double(), sdpa(q, k, v, allowed), rtol=0, atol=2e-6)
    for i in range(rows):
        keys = allowed[i].nonzero()[:, 0]
        alone = torch.ops.eagle.row_attention(q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], None, D**-0.5)
        assert torch.equal(alone[0, 0], out[0, i])


@needs_kernel
def test_a_quantized_base_gives_a_tree_node_the_one_row_steps_logits_bit_for_bit(tmp_path):
    base = quantized_tiny_base(tmp_path / "tiny.gguf", layers=3)
    few_rows.install(base)
    assert row_attention.installed(base)
    ids = torch.randint(0, base.config.vocab_size, (1, 61), generator=torch.Generator().manual_seed(0))
    ctx = 60  # (SDPA gives the tree node other logits here)
    with torch.no_grad(), few_rows.few_row_kernels():
        from transformers import DynamicCache

        def prefilled():
            cache = DynamicCache(config=base.config)
            base(ids[:, :ctx], past_key_values=cache, use_cache=True)
            return cache

        one = base(ids[:, ctx : ctx + 1], past_key_values=prefilled(), use_cache=True).logits[0, -1]
        # three siblings at the same position, each seeing the context and itself; the first is the token above
        siblings = torch.tensor([[ids[0, ctx], 5, 7]])
        allowed = torch.zeros(3, ctx + 3, dtype=torch.bool)
        allowed[:, :ctx] = True
        allowed[torch.arange(3), ctx + torch.arange(3)] = True
        tree = base(siblings, position_ids=torch.full((1, 3), ctx), past_key_values=prefilled(), use_cache=True,
                    attention_mask=additive_mask(allowed, torch.float32)).logits[0]  # fmt: skip
    assert torch.equal(tree[0], one)
    few_rows.uninstall(base)
    assert not row_attention.installed(base) and base.config._attn_implementation == "sdpa"


@needs_kernel
def test_a_float32_base_and_its_draft_head_attend_row_by_row_within_rounding_of_sdpa(monkeypatch):
    """Every float32 CPU base with the kernel library attends with the operator (not only the quantized ones), and so
    does the draft head's layer; both stay within float32 rounding of SDPA (the path without the library)."""
    from tiny import draft_config, tiny_base

    from eagle.models.draft_head import DraftConfig, DraftHead
    from eagle.models.kv_cache import TreeKVCache

    base = tiny_base("llama", layers=3)
    ids = torch.randint(0, 16, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sdpa_logits = base(ids).logits
        few_rows.install(base)
        assert row_attention.installed(base)
        calls = []
        op = torch.ops.eagle.row_attention
        monkeypatch.setattr(torch.ops.eagle, "row_attention", lambda *a: calls.append(a[0].shape) or op(*a),
                            raising=False)  # fmt: skip
        with few_rows.few_row_kernels():
            torch.testing.assert_close(base(ids).logits, sdpa_logits, rtol=0, atol=2e-5)
        assert len(calls) == 3  # a layer, a call
        few_rows.uninstall(base)

        cfg = DraftConfig.from_dict(draft_config(base, eagle3=False), eagle3=False)
        head = DraftHead(cfg).eval()
        attention = head.layers[0].self_attn
        x = torch.randn(1, 4, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
        cos, sin = head.rotary_emb(x, torch.arange(20, 24)[None])
        allowed = torch.ones(4, 24, dtype=torch.bool).tril(20)
        mask = additive_mask(allowed, torch.float32)

        def attend():
            cache = TreeKVCache(1, 32).allocate(cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
            shape = (1, cfg.num_key_value_heads, 20, cfg.head_dim)
            cache.layers[0].keys[:, :, :20] = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
            cache.layers[0].values[:, :, :20] = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
            return attention(x, cos, sin, mask, cache, 20)

        calls.clear()
        rows = attend()
        assert len(calls) == 1
        monkeypatch.setattr(panel_kernel, "loaded", lambda: False)  # the library not loaded: SDPA
        torch.testing.assert_close(rows, attend(), rtol=0, atol=2e-6)
        assert len(calls) == 1


@needs_kernel
def test_queries_keys_and_values_are_read_in_place_from_the_views_a_graph_passes():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, H, D, generator=g).transpose(1, 2)  # the projection's [1, M, Hq, D], heads and rows swapped
    buffers = torch.randn(2, 1, HKV, L + 20, D, generator=g)  # [k | v, 1, Hkv, capacity, D]
    k, v = buffers[0, :, :, :L], buffers[1, :, :, :L]  # the cache's views of its first L rows
    assert not q.is_contiguous() and not k.is_contiguous()
    out = torch.ops.eagle.row_attention(q, k, v, None, D**-0.5)
    assert torch.equal(out, torch.ops.eagle.row_attention(q.contiguous(), k.contiguous(), v.contiguous(), None,
                                                          D**-0.5))  # fmt: skip
    torch.testing.assert_close(out.double(), sdpa(q, k, v, torch.ones(3, L, dtype=torch.bool).tril(L - 3)),
                               rtol=0, atol=2e-6)  # fmt: skip


AVX2_CHECK = """
import sys, torch
torch.ops.load_library(sys.argv[1])
g = torch.Generator().manual_seed(1)
H, HKV = 6, 2
for rows, L, D in ((1, 45, 64), (5, 45, 64), (9, 45, 64), (1, 300, 64), (5, 300, 64), (5, 300, 128)):
    q, k, v = (torch.randn(1, h, n, D, generator=g) for h, n in ((H, rows), (HKV, L), (HKV, L)))
    allowed = torch.rand(rows, L, generator=g) < 0.6
    allowed[:, -rows:] |= torch.eye(rows, dtype=torch.bool)
    out = torch.ops.eagle.row_attention(q, k, v, allowed[None, None], D**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1),
        v.double().repeat_interleave(3, 1), attn_mask=allowed[None, None]).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    for i in range(rows):  # blocks of 8 keys and a tail: a row's keys alone give it bit for bit
        keys = allowed[i].nonzero()[:, 0]
        alone = torch.ops.eagle.row_attention(q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], None, D**-0.5)
        assert torch.equal(alone[0, 0], out[0, i])
"""


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
def test_the_avx2_build_of_row_attention_is_sdpa_and_batch_invariant(kernel_variant):
    """The AVX2 code path (8 keys a block, its own lane sums; rows of one chunk and of several; heads of 64 and of
    128, sixteen 8-lane vectors), built and checked in a process of its own."""
    library = kernel_variant(AVX2)
    subprocess.run([sys.executable, "-c", AVX2_CHECK, str(library)], check=True, timeout=120)


@needs_kernel
def test_inputs_the_operator_does_not_take_go_to_transformers_sdpa(monkeypatch):
    """A batch of sequences, another dtype or values narrower than the keys (the interface is installed on every
    float32 base, which HF `generate` may batch): transformers' SDPA, never the operator."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []
    op = torch.ops.eagle.row_attention
    monkeypatch.setattr(torch.ops.eagle, "row_attention", lambda *a: calls.append(1) or op(*a), raising=False)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=H // HKV, training=False)
    g = torch.Generator().manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    cases = [
        (rand(2, H, 3, D), rand(2, HKV, 9, D), rand(2, HKV, 9, D)),  # a batch
        tuple(t.bfloat16() for t in (rand(1, H, 3, D), rand(1, HKV, 9, D), rand(1, HKV, 9, D))),  # another dtype
        (rand(1, H, 3, D), rand(1, HKV, 9, D), rand(1, HKV, 9, D // 2)),  # values narrower than keys
    ]
    for q, k, v in cases:
        mask = torch.ones(q.shape[0], 1, 3, 9, dtype=torch.bool).tril(6)
        out, _ = row_attention.attention(module, q, k, v, mask)
        ref, _ = sdpa_attention_forward(module, q, k, v, mask)
        assert torch.equal(out, ref)
    assert calls == []
    q, k, v = (t[:1] for t in cases[0])  # one float32 sequence: the operator
    torch.testing.assert_close(row_attention.attention(module, q, k, v, None)[0].double(),
                               sdpa(q, k, v, torch.ones(3, 9, dtype=torch.bool).tril(6)), rtol=0, atol=2e-6)  # fmt: skip
    assert calls == [1]
