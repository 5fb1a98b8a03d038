"""The panel kernel on GGUF blocks (eagle/kernels/quant_panels.py, quant_linear.cpp): Q4_1 and Q8_0 weights as
gguf-py stores them multiplied as integers by the inputs rounded to 8 or (Q4_1) 16 bits a block, within the stated
bound of F.linear on the dequantized weights, and each row independent of the others."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from kernel_builds import VARIANTS
from q4_fixtures import error_bound, random_blocks

from eagle.kernels import panel_kernel, quant_panels
from eagle.kernels.quant_panels import Q4_1, Q8_0

needs_kernel = pytest.mark.skipif(
    not panel_kernel.available(), reason=f"panel kernel: {panel_kernel._state.get('why')}"
)
QTYPES = [Q4_1, Q8_0]
ROUNDINGS = [(Q4_1, 8), (Q4_1, 16), (Q8_0, 8)]  # (weights, input bits): every arithmetic the kernel has


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_gguf_py_bit_for_bit(qtype):
    blocks = random_blocks(qtype, 40, 96)
    ref = gguf.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(qtype)).reshape(40, 96)
    assert torch.equal(quant_panels.dequantize(qtype, blocks), torch.from_numpy(ref))


@needs_kernel
@pytest.mark.parametrize("qtype, bits", ROUNDINGS)
@pytest.mark.parametrize("n, k", [(1, 32), (31, 64), (32, 64), (33, 96), (3 * 32 + 5, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16])
def test_quant_panel_linear_is_f_linear_on_the_dequantized_weight(qtype, bits, n, k, rows):
    blocks = random_blocks(qtype, n, k, seed=n * 100 + rows)
    w = quant_panels.dequantize(qtype, blocks)  # [n, k]
    panels = quant_panels.pack(qtype, blocks)
    nb = quant_panels.width()
    assert panels.shape == (-(-n // nb), k // 32 * quant_panels.BLOCK_BYTES[qtype] * nb)
    x, b = torch.randn(2, rows, k), torch.randn(n)
    for bias in (None, b):
        out = quant_panels.linear(x, panels, bias, n, qtype, bits)
        assert out.shape == (2, rows, n) and out.is_contiguous()
        ref = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert ((out - ref).abs() <= error_bound(x, qtype, blocks, bias, bits)).all()


def _one_hot_blocks(qtype: int, k: int, q: int) -> torch.Tensor:
    """GGUF blocks [K, K / 32 * bytes] of the weight q * identity (d = 1, Q4_1's minimum 0)."""
    blocks = torch.zeros(k, k // 32, quant_panels.BLOCK_BYTES[qtype], dtype=torch.uint8)  # [N = K, blocks, bytes]
    blocks[..., 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    for j in range(k):
        if qtype == Q4_1:  # byte i holds weight i (low nibble) and weight i + 16 (high nibble)
            blocks[j, j // 32, 4 + (j % 32) % 16] = q if (j % 32) < 16 else q << 4
        else:
            blocks[j, j // 32, 2 + j % 32] = q & 0xFF  # int8 as a byte
    return blocks.reshape(k, -1)


@needs_kernel
@pytest.mark.parametrize("qtype, q", [(Q4_1, 1), (Q4_1, 15), (Q8_0, 1), (Q8_0, -127), (Q8_0, 127)])
def test_8_bit_inputs_round_each_input_as_stated(qtype, q):
    """With 8-bit inputs the kernel multiplies round(x * 127 / max |x|) of each block: a weight of q at column k
    gives back exactly q times that input times its block's scale (the weights' byte order is matched by the
    inputs'; Q8_0's q + 128 taken back off)."""
    k = 64
    panels = quant_panels.pack(qtype, _one_hot_blocks(qtype, k, q))
    x = torch.randn(3, k)
    xb = x.view(3, k // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    expected = (q * torch.round(xb * (127 / amax)) * (amax / 127)).view(3, k)  # round half to even, as the kernel
    assert torch.allclose(quant_panels.linear(x, panels, None, k, qtype, 8), expected, rtol=2**-20, atol=0)
    if qtype == Q4_1:
        assert not torch.allclose(quant_panels.linear(x, panels, None, k, Q4_1, 16), expected, rtol=2**-20, atol=0)


@needs_kernel
@pytest.mark.parametrize("qtype, bits", ROUNDINGS)
def test_a_row_alone_equals_the_same_row_among_8_or_16(qtype, bits):
    """Batch invariance: a verify pass's rows (tree siblings, padding) never change a row's result, bit for bit,
    so greedy EAGLE and greedy vanilla see the same logits for the same tokens."""
    n, k = 200, 192
    panels = quant_panels.pack(qtype, random_blocks(qtype, n, k))
    x = torch.randn(1, k)
    alone = quant_panels.linear(x, panels, None, n, qtype, bits)
    for rows in (2, 4, 5, 8, 9, 16):
        others = 100 * torch.randn(rows - 1, k)
        assert torch.equal(quant_panels.linear(torch.cat([x, others]), panels, None, n, qtype, bits)[:1], alone)
        assert torch.equal(quant_panels.linear(torch.cat([others, x]), panels, None, n, qtype, bits)[-1:], alone)


@needs_kernel
@pytest.mark.parametrize("qtype, bits", ROUNDINGS)
def test_every_tiling_gives_the_same_bits(qtype, bits):
    """The tiling a machine measures fastest (which panels a tile covers, how far ahead it prefetches, whether a
    streamed weight is prefetched non-temporally) is speed only: no output changes with it, so greedy tokens never
    depend on where the tuner ran."""
    n, k = 4 * quant_panels.width() + 7, 192  # five panels, the last partial: wide tiles over pairs and a lone one
    panels = quant_panels.pack(qtype, random_blocks(qtype, n, k))
    tilings = [*quant_panels.tilings(), quant_panels.Tiling(1, 0), quant_panels.Tiling(1, 0, True)]
    assert any(t.stream_nta for t in quant_panels.tilings())  # the tuner times both kinds of prefetch
    for rows in (1, 2, 3, 8, 16):
        x = torch.randn(rows, k)
        outs = []
        for t in tilings:
            with quant_panels.tiled(t):
                assert quant_panels.tiling() == t
                for streamed in (False, True):
                    outs.append((t, streamed, quant_panels.linear(x, panels, None, n, qtype, bits, streamed=streamed)))
        for t, streamed, out in outs[1:]:
            assert torch.equal(out, outs[0][2]), f"{t} (streamed {streamed}) changed the result of {rows} rows"


@needs_kernel
def test_a_tiling_the_kernel_cannot_run_is_refused_and_the_tiling_kept():
    before = quant_panels.tiling()
    too_wide = quant_panels.wide_rows() + 1
    with pytest.raises(RuntimeError, match=f"wide_rows must be 0 to {too_wide - 1} in this build, got {too_wide}"):
        quant_panels.set_tiling(quant_panels.Tiling(too_wide, 4096))
    with pytest.raises(RuntimeError, match="prefetch must be a multiple of 64 bytes"):
        quant_panels.set_tiling(quant_panels.Tiling(0, 100))
    assert quant_panels.tiling() == before


@needs_kernel
def test_blocks_that_do_not_match_are_refused_with_the_fix():
    panels = quant_panels.pack(Q4_1, random_blocks(Q4_1, 64, 64))
    with pytest.raises(RuntimeError, match="pack the blocks with eagle.kernels.quant_panels.pack"):
        quant_panels.linear(torch.randn(1, 96), panels, None, 64, Q4_1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant_panels.linear(torch.randn(1, 48), panels, None, 64, Q4_1)
    with pytest.raises(RuntimeError, match="Q4_1"):
        quant_panels.linear(torch.randn(1, 64), panels, None, 64, 2)
    q8 = quant_panels.pack(Q8_0, random_blocks(Q8_0, 64, 64))
    with pytest.raises(RuntimeError, match="input_bits 16 is not 8, or 16 with Q4_1 weights"):
        quant_panels.linear(torch.randn(1, 64), q8, None, 64, Q8_0, 16)


CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from q4_fixtures import random_blocks, error_bound
from eagle.kernels import quant_panels
torch.ops.load_library(sys.argv[1])
assert quant_panels.width() == int(sys.argv[3]), quant_panels.width()  # the build asked for
for qtype, bits in ((quant_panels.Q4_1, 8), (quant_panels.Q4_1, 16), (quant_panels.Q8_0, 8)):
    for n, k in [(1, 32), (15, 64), (16, 64), (17, 96), (200, 576)]:
        blocks = random_blocks(qtype, n, k)
        w, panels = quant_panels.dequantize(qtype, blocks), quant_panels.pack(qtype, blocks)
        for rows in (1, 2, 3, 4, 5, 8, 13, 16):
            x, b = torch.randn(rows, k), torch.randn(n)
            out = quant_panels.linear(x, panels, b, n, qtype, bits)
            ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
            assert ((out - ref).abs() <= error_bound(x, qtype, blocks, b, bits)).all()
            assert torch.equal(quant_panels.linear(x[-1:], panels, b, n, qtype, bits), out[-1:])
q, k, v = torch.randn(1, 4, 3, 40), torch.randn(1, 2, 30, 40), torch.randn(1, 2, 30, 40)  # row_attention.cpp
causal = torch.ones(3, 30, dtype=torch.bool).tril(27)
ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                       attn_mask=causal).transpose(1, 2)
assert (torch.ops.eagle.row_attention(q, k, v, None, 40**-0.5) - ref).abs().max() < 1e-5
"""


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 flag")
@pytest.mark.parametrize("flags", list(VARIANTS.values()), ids=list(VARIANTS))
def test_the_avx2_and_no_vnni_builds_compute_the_same(kernel_variant, flags):
    """The AVX2 code (CI machines without AVX-512) built and checked here too, in a process of its own (the
    attention of row_attention.cpp too); without AVX-VNNI too (a Zen 3: the integer dot products by vpmaddubsw and
    vpmaddwd), and this machine's build without AVX-512 VNNI (a Skylake-X, where it has AVX-512)."""
    library = kernel_variant(flags)
    root, tests = str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)
    width = 16 if "-mno-avx512f" in flags else quant_panels.width()
    subprocess.run([sys.executable, "-c", CHECK, str(library), tests, str(width)], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": root})  # fmt: skip


@needs_kernel
def test_no_rows_give_no_rows():
    panels = quant_panels.pack(Q4_1, random_blocks(Q4_1, 40, 64))
    assert quant_panels.linear(torch.randn(0, 64), panels, None, 40, Q4_1).shape == (0, 40)
