"""Random GGUF blocks, the error bound of the quantized panel kernel's tests, and a tiny base with its GGUF
(imports no kernel library: the AVX2 check loads its own build in a process of its own)."""

import gguf
import numpy as np
import torch
from tiny import tiny_base
from torch import nn

from eagle.kernels import quant_gguf, quant_panels
from eagle.kernels.quant_panels import Q4_1


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """GGUF blocks uint8 [n, k / 32 * bytes] of random quants, with scales (and minimums) of trained weights' size."""
    g = torch.Generator().manual_seed(seed)
    nb = k // 32
    b = torch.randint(0, 256, (n, nb, quant_panels.BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    b[..., 0:2] = ((torch.rand(n, nb, generator=g) + 0.05) * 0.02).half().view(torch.uint8).reshape(n, nb, 2)
    if qtype == Q4_1:
        b[..., 2:4] = (-torch.rand(n, nb, generator=g) * 0.15).half().view(torch.uint8).reshape(n, nb, 2)
    return b.reshape(n, -1)


def error_bound(x: torch.Tensor, qtype: int, blocks: torch.Tensor, bias: torch.Tensor | None,
                input_bits: int | None = None) -> torch.Tensor:
    """How far the quantized kernel's out[..., j] may be from the exact x . w_j (+ bias_j), w the blocks dequantized:
    each input is rounded to `input_bits` (default: quant_panels.INPUT_BITS[qtype]) against its block's largest
    magnitude, an error of at most s / 2 (1 + 2^-8) with s = max |x| / L (L = 32767 for 16 bits, 127 for 8), weighted
    by |w|; then float32 sums of K products and (Q4_1) of the block sums times the minimums, 2 K u each, u = 2^-24."""
    k = x.shape[-1]
    w = quant_panels.dequantize(qtype, blocks)  # [N, K]
    xb = x.reshape(*x.shape[:-1], k // 32, 32)
    levels = 2 ** ((input_bits or quant_panels.INPUT_BITS[qtype]) - 1) - 1
    s = (xb.abs().amax(-1, keepdim=True) / levels).expand_as(xb).reshape(x.shape)  # [..., K]
    rounding = (0.5 * (1 + 2.0**-8) * s) @ w.abs().T
    _, m, _ = quant_panels._split(qtype, blocks)
    minimums = 0 if m is None else x.abs() @ m.float().abs().repeat_interleave(32, dim=1).T
    u = 2.0**-24
    return rounding + 2 * k * u * (x.abs() @ w.abs().T + minimums) + 2 * u * (0 if bias is None else bias.abs())


GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's order of q/k rows (transformers undoes it at load)."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, -1).swapaxes(1, 2).reshape(rows.shape)


def quantized_tiny_base(path, layers: int = 2, seed: int = 0):
    """A tiny llama whose linear weights are Q4_1 blocks dequantized (the lm_head Q8_0), and the GGUF at `path`
    holding those blocks as llama.cpp writes them (q/k rows permuted); its config names the file."""
    base = tiny_base("llama", seed=seed, layers=layers, hidden_size=64, intermediate_size=128)
    cfg = base.config
    writer = gguf.GGUFWriter(str(path), "llama")
    with torch.no_grad():
        for name, module in base.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            qtype = gguf.GGMLQuantizationType.Q8_0 if name == "lm_head" else gguf.GGMLQuantizationType.Q4_1
            blocks = gguf.quantize(module.weight.numpy(), qtype)  # [N, K / 32 * bytes]
            module.weight.copy_(torch.from_numpy(gguf.dequantize(blocks, qtype)).reshape(module.weight.shape))
            if name == "lm_head":
                writer.add_tensor("output.weight", blocks, raw_dtype=qtype)
                continue
            layer, kind = name.split(".")[2], name.split(".")[-1]
            if kind in ("q_proj", "k_proj"):
                heads = cfg.num_attention_heads if kind == "q_proj" else cfg.num_key_value_heads
                blocks = _permute(blocks, heads)
            writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[kind]}.weight", np.ascontiguousarray(blocks), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    setattr(cfg, quant_gguf.CONFIG_KEY, str(path))
    return base
