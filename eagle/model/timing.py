"""Wall-clock timing of device work: CUDA is synchronised before and after, so queued kernels are counted."""

from __future__ import annotations

import time
from typing import Callable

import torch


def timed(device: torch.device, fn):
    """(fn(), wall seconds), with the device synchronised before and after on CUDA."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize(device)
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
