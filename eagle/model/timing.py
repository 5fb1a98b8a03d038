"""Wall-clock timing of device work: CUDA is synchronised before and after, so queued kernels are counted; every
visible GPU, since a model spread by a device_map queues work on all of them."""

from __future__ import annotations

import time
from typing import Callable

import torch


def synchronize_all() -> None:
    """Wait for every visible GPU (one `torch.cuda.synchronize()` waits for the current one only)."""
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


def timed(device: torch.device, fn):
    """(fn(), wall seconds), with the GPUs synchronised before and after when `device` is CUDA."""
    cuda = device.type == "cuda"
    if cuda:
        synchronize_all()
    t0 = time.perf_counter()
    result = fn()
    if cuda:
        synchronize_all()
    return result, time.perf_counter() - t0


def repeated_seconds(device: torch.device, fn: Callable, repeats: int, after: Callable | None = None) -> list[float]:
    """Seconds of `repeats` calls of `fn` after one untimed warm-up call, sorted; `after` runs (untimed) after
    every call, e.g. to drop the cache entries the call wrote."""
    times = []
    for i in range(repeats + 1):
        _, seconds = timed(device, fn)
        if after is not None:
            after()
        if i:
            times.append(seconds)
    return sorted(times)
