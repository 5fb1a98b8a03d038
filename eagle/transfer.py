"""Host-to-device copies that do not stall the host.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and then waits for the device's stream
to drain: a host sync. The decoding loop reads the device once per round (the verified tree); every other
transfer goes through `to_device`, which on CUDA copies from pinned memory asynchronously (the caching host
allocator keeps the pinned buffer alive until the copy has run)."""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of `values` (a list or a CPU tensor) on `device`, without a host sync."""
    device = torch.device(device)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
