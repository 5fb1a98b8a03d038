"""Wall-clock timing of device work: CUDA is synchronised before and after, so queued kernels are counted; every
visible GPU, since a model spread by a device_map queues work on all of them."""

from __future__ import annotations

import statistics
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


def seconds_in_turns(device: torch.device, calls: dict, repeats: int, after: Callable | None = None) -> dict:
    """Median seconds of each of `calls` (key -> fn), the calls taking turns: one of each per repeat after an untimed
    first turn, so that a drift of the machine's speed (a VM's moves by a fifth within minutes) hits them alike and
    their ratios hold. `after` runs (untimed) after every call."""
    times = {key: [] for key in calls}
    for turn in range(repeats + 1):
        for key, fn in calls.items():
            _, seconds = timed(device, fn)
            if after is not None:
                after()
            if turn:
                times[key].append(seconds)
    return {key: statistics.median(t) for key, t in times.items()}
