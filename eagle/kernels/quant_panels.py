"""Weights kept in their GGUF blocks, packed as panels for `torch.ops.eagle.quant_panel_linear` (quant_linear.cpp).

A GGUF block holds 32 consecutive weights of one output row: Q4_1 an fp16 scale d, an fp16 minimum m and 32
4-bit q (w = d * q + m), Q8_0 an fp16 scale d and 32 int8 q (w = d * q). `blocks` here are a weight's blocks as
the file stores them, uint8 [N, K / 32 * BLOCK_BYTES[qtype]], rows in the model's order. `pack` regroups them as
column panels of `width()` columns, the kernel's layout; `dequantize` gives the float32 weight exactly as gguf-py
(and so transformers' GGUF loading) computes it: the weights the kernel multiplies (q as integers, then d and m),
with the inputs rounded to `INPUT_BITS` a block (quant_linear.cpp states the bound).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

Q4_1, Q8_0 = 3, 8  # ggml's type numbers (gguf.GGMLQuantizationType), passed to the operator
NAMES = {Q4_1: "q4_1", Q8_0: "q8_0"}
BLOCK = 32  # weights per block
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}  # bytes per block in the file
# The inputs' rounding the engine uses per weight type, one arithmetic for every pass (batch invariance): 8-bit
# inputs as llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 products (four multiply-adds a lane per instruction where 16-bit
# inputs give two; on the embedded default as faithful to the float32 model as llama.cpp, docs/benchmarks.md). Q4_1 also
# takes 16-bit inputs (the kernel's other arithmetic, for comparison); Q8_0 only 8-bit ones.
INPUT_BITS = {Q4_1: 8, Q8_0: 8}
# The order of a group of 8 k in which the kernel takes 8-bit inputs (quant_linear.cpp's PERM8): Q8_0's words match it
PERM8 = (0, 4, 1, 5, 2, 6, 3, 7)


class Tiling(NamedTuple):
    """How the kernel's tiles cover the panels (speed only: every tiling gives the same bits)."""

    wide_rows: int  # calls of up to this many rows (0 to wide_rows()) take wide tiles (AVX-512: two panels, AVX2: one)
    prefetch: int  # bytes ahead of a tile's block that it prefetches into L1 (a multiple of 64)
    # a streamed weight's blocks (`linear(..., streamed=True)`: a base's) prefetched non-temporally, so that a pass
    # displaces less of what the next call reuses (the KV cache, a draft head's weights)
    stream_nta: bool = False


def wide_rows() -> int:
    """The most rows a wide tile holds in the kernel loaded here (2 with AVX-512, 4 with AVX2): needs
    panel_kernel.available()."""
    return torch.ops.eagle.quant_panel_wide_rows()


def default_tiling() -> Tiling:
    """The tiling of a process that has measured none: wide tiles wherever the build has them."""
    return Tiling(wide_rows(), 16384, False)


def tilings() -> tuple[Tiling, ...]:
    """What the tuner times on a machine (tuner.panel_tiling), the default first: which is fastest differs between
    CPUs and memory systems."""
    wide = default_tiling().wide_rows
    return tuple(Tiling(w, ahead, nta) for nta in (False, True) for ahead in (16384, 4096) for w in (wide, 0))


def tiling() -> Tiling:
    """The tiling in force in this process: needs panel_kernel.available()."""
    wide, ahead, nta = torch.ops.eagle.quant_panel_tiling()
    return Tiling(wide, ahead, bool(nta))


def set_tiling(t: Tiling) -> None:
    """Process-wide; takes effect at the next call (compiled graphs included)."""
    torch.ops.eagle.quant_panel_set_tiling(t.wide_rows, t.prefetch, t.stream_nta)


@contextlib.contextmanager
def tiled(t: Tiling):
    """`t` in force inside, the tiling before restored after."""
    before = tiling()
    set_tiling(t)
    try:
        yield
    finally:
        set_tiling(before)


def width() -> int:
    """Columns per panel of the kernel loaded here (32 with AVX-512, 16 with AVX2): needs panel_kernel.available()."""
    return torch.ops.eagle.quant_panel_width()


def _split(qtype: int, blocks: torch.Tensor):
    """blocks uint8 [N, nb * BLOCK_BYTES] -> d fp16 [N, nb], m fp16 [N, nb] or None, q [N, nb, 32] (uint8 0..15 for
    Q4_1, int8 for Q8_0) in k order."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGML type {qtype} has no panel kernel; supported: {', '.join(NAMES.values())}")
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BLOCK_BYTES[qtype])  # [N, nb, bytes]
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [N, nb]
    if qtype == Q8_0:
        return d, None, b[..., 2:].contiguous().view(torch.int8)
    m = b[..., 2:4].contiguous().view(torch.float16)[..., 0]
    qs = b[..., 4:]  # [N, nb, 16]: byte i holds weight i (low nibble) and weight i + 16 (high nibble)
    return d, m, torch.cat((qs & 15, qs >> 4), dim=-1)


def dequantize(qtype: int, blocks: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of `blocks`, computed as gguf-py does: (d * q) + m, d * q (Q8_0)."""
    d, m, q = _split(qtype, blocks)
    w = d.float()[..., None] * q.float()  # [N, nb, 32]
    if m is not None:
        w = w + m.float()[..., None]
    return w.reshape(blocks.shape[0], -1)


def pack(qtype: int, blocks: torch.Tensor, nb: int | None = None) -> torch.Tensor:
    """blocks uint8 [N, K / 32 * BLOCK_BYTES] -> panels uint8 [ceil(N / NB), K / 32 * BLOCK_BYTES * NB] (a new
    tensor; zero columns past N: d = m = q = 0, weights 0). Per panel, block after block: d[NB] fp16, (Q4_1) m[NB]
    fp16, then Q4_1 4 groups of 8 k x NB uint32 words (the group's q[k + 2p] in bits 4p..4p+3, q[k + 2p + 1] in
    bits 16+4p..19+4p), Q8_0 4 groups of 8 k x 2 x NB uint32 words (word h: q + 128 of k + PERM8[4h + i] in byte
    i): quant_linear.cpp's layout."""
    nb = nb or width()
    d, m, q = _split(qtype, blocks)
    n, nblocks = d.shape
    p = -(-n // nb)

    def panels(t: torch.Tensor) -> torch.Tensor:  # [N, nblocks, ...] -> [P, nblocks, ..., NB] as bytes
        padded = t.new_zeros(p * nb, *t.shape[1:])
        padded[:n] = t
        t = padded.view(p, nb, *t.shape[1:]).movedim(1, -1)  # [P, nblocks, ..., NB]
        return t.contiguous().view(torch.uint8).reshape(p, nblocks, -1)

    parts = [panels(d)]  # [P, nblocks, 2 NB]
    if qtype == Q4_1:
        pairs = q.to(torch.int32).view(n, nblocks, 4, 4, 2)  # [N, nblocks, group, p, k + 2p | k + 2p + 1]
        shifts = 4 * torch.arange(4, dtype=torch.int32)  # [p]
        words = ((pairs[..., 0] << shifts) | (pairs[..., 1] << (shifts + 16))).sum(-1, dtype=torch.int32)
        parts += [panels(m), panels(words)]  # [P, nblocks, 2 NB], [.., 16 NB]: words [N, nblocks, 4]
    else:
        u = (q.to(torch.int16) + 128).to(torch.uint8).view(n, nblocks, 4, 8)[..., PERM8]  # [N, nblocks, group, 8]
        words = u.contiguous().view(torch.int32)  # [N, nblocks, 4, 2]: word h holds bytes 4h..4h+3
        parts.append(panels(words.reshape(n, nblocks, 8)))  # [P, nblocks, 32 NB]
    return torch.cat(parts, dim=-1).reshape(p, -1)  # [P, nblocks * BLOCK_BYTES * NB]


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int, qtype: int,
           input_bits: int | None = None, streamed: bool = False):
    """x [..., K] float32 -> [..., N]: the operator on packed panels, the inputs rounded to `input_bits` (default:
    INPUT_BITS[qtype]). streamed: the weight is evicted by the rest of its model's pass before it is read again (a
    base's), so its blocks may be prefetched past the caches (Tiling.stream_nta); speed only."""
    bits = input_bits or INPUT_BITS.get(qtype, 16)  # an unknown qtype: the operator says which it takes
    return torch.ops.eagle.quant_panel_linear(x, panels, bias, out_features, qtype, bits, streamed)
