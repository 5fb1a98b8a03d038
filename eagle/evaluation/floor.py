"""The bandwidth floor: the fastest any plain decoder can go on this machine.

A one-token decode step reads every weight of the base once (the embedding contributes a row, unless it is tied
to the lm_head, which reads it whole). With the machine's measured streaming bandwidth B and those bytes W,
no plain decoder makes more than B / W tokens per second; EAGLE beats that bound only by producing several
tokens per weight read. `x_floor` = a method's tokens/s divided by the floor's.
"""

from __future__ import annotations

import torch

from eagle.timing import repeated_seconds


def stream_bandwidth(device: str = "cpu", mib: int = 256, repeats: int = 7) -> float:
    """Bytes per second of reading a `mib`-MiB float32 tensor (torch.sum, the threads torch uses now); the best of
    `repeats` timed reads after one warm-up: the most the machine streams, so the floor is never too low."""
    x = torch.ones(mib << 18, dtype=torch.float32, device=device)  # mib MiB
    best = repeated_seconds(x.device, x.sum, repeats)[0]  # x.sum() returns a device scalar: the read itself
    return x.numel() * x.element_size() / best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a one-token forward of `model` (a transformers causal LM) reads: every parameter and
    buffer-free weight once, except an untied input embedding (one row)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p is embed and not tied:
            total += p.shape[-1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def read_bytes_per_token(model) -> int:
    """Bytes of weights a one-token forward reads where linears read GGUF blocks (eagle/kernels/few_rows.py): the
    float32 weights of the others, the panels of those (blocks, scales and minimums)."""
    from eagle.kernels import few_rows

    total = weight_bytes_per_token(model)
    for layer in model.modules():
        if type(layer) is few_rows.FewRowLinear and layer.reads_gguf:
            total += layer.panels.nbytes - layer.weight.numel() * layer.weight.element_size()
    return total


def floor(model: torch.nn.Module, device: str = "cpu", weights: int | None = None) -> dict:
    """{bandwidth_gb_s, weight_mb, tokens_per_s, ms_per_token}: the plain-decoding bound on this machine, for
    `weights` bytes per token (default: the float32 weights, weight_bytes_per_token)."""
    bandwidth = stream_bandwidth(device)
    weights = weights or weight_bytes_per_token(model)
    return {"bandwidth_gb_s": bandwidth / 1e9, "weight_mb": weights / 1e6, "tokens_per_s": bandwidth / weights,
            "ms_per_token": 1e3 * weights / bandwidth}  # fmt: skip
