"""A preallocated, compactable KV cache that plugs into transformers' `Cache` API.

Each layer owns fixed buffers `keys`/`values` of shape [1, kv_heads, capacity, head_dim]; only the first `length`
positions are valid, one length for all layers (the cache's): a pass writes every layer's rows at the same positions,
and the last layer's `update` advances it (so a compiled pass takes and returns one int, not one a layer). `update`
writes new states in place and returns views of the valid prefix, so a forward pass never concatenates
(DynamicCache copies the whole cache on every step). After tree verification, `compact` moves the accepted tree rows
into the contiguous prefix and rejected rows are simply overwritten by the next pass.

For CUDA graphs (cuda_graphs.py) a cache must keep its addresses and every captured pass its shapes: a
`TreeKVCache(..., static=True)` is owned by the graphs' runner, and while `write_positions` is set (a device tensor
[q], the runner's static buffer) each layer writes its rows there and returns the buffers' first `read_span`
positions, the mask spanning as many (`masks.widened`); the runner keeps the length. Otherwise it behaves as any
TreeKVCache (eager passes).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from eagle.kernels import panel_kernel
from eagle.transfer import to_device


class PreallocatedLayer(CacheLayerMixin):
    """One attention layer's cache; buffers are allocated on first use, on the device of the layer. Its length is
    `cache`'s; `last`: the layer whose update advances it."""

    is_croppable = True
    is_sliding = False

    def __init__(self, capacity: int, cache: "TreeKVCache", last: bool):
        super().__init__()
        self.capacity = capacity
        self.cache = cache
        self.last = last

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        self.keys = key_states.new_empty(batch, heads, self.capacity, head_dim)
        self.values = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, start = key_states.shape[-2], self.cache.length
        end = start + n
        if end > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: {end} positions needed, {self.capacity} allocated. "
                "Raise max_length in eagenerate (the cache is sized max_length + tree size)."
            )
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        if self.last:
            self.cache.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.cache.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` positions (transformers' 5.18+ convention: a negative count). The cache's
        `crop` calls every layer's: the last one moves the shared length, as in `update`."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if self.last:
            self.cache.length = max(0, self.cache.length + tokens_to_remove)

    def compact(self, keep: torch.Tensor, start: int) -> None:
        """Move positions `keep` (ascending, all >= start) to [start, start + len(keep)) and truncate there."""
        if not self.is_initialized:
            return
        n = keep.numel()
        keep = keep.to(self.keys.device)  # no-op when the caller put it there (TreeKVCache.compact does)
        # index_select copies first, so overlapping source and destination ranges are safe.
        self.keys[:, :, start : start + n] = self.keys.index_select(2, keep)
        self.values[:, :, start : start + n] = self.values.index_select(2, keep)
        self.cache.length = start + n


class StaticLayer(PreallocatedLayer):
    """A layer of a static cache: in a captured pass (the cache's `write_positions` set) rows go to those positions
    and attention sees the buffers' first `read_span` positions; the length, a host int, is the runner's to keep.
    Eager otherwise."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys.zero_()  # a captured pass reads the whole buffers: garbage (NaN) under the mask would still
        self.values.zero_()  # reach its output (0 * NaN)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        at = self.cache.write_positions  # [q] on the layer's device
        if at is None:
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, at, key_states)
        self.values.index_copy_(2, at, value_states)
        span = self.cache.read_span
        return self.keys[:, :, :span], self.values[:, :, :span]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.cache.write_positions is not None:
            return self.cache.read_span, 0
        return super().get_mask_sizes(query_length)


class TreeKVCache(Cache):
    """A `Cache` of `PreallocatedLayer`s with one shared length; see the module docstring."""

    def __init__(self, num_layers: int, capacity: int, static: bool = False):
        """static: layers that captured passes write by position (`StaticLayer`), for CUDA graphs."""
        self.length = 0  # valid positions in every layer
        kind = StaticLayer if static else PreallocatedLayer
        super().__init__(layers=[kind(capacity, self, last=i == num_layers - 1) for i in range(num_layers)])
        self.capacity = capacity
        self.write_positions: torch.Tensor | None = None  # [q] set by the graphs' runner around a captured pass
        self.read_span: int | None = None  # the positions that pass attends over (a span: cuda_graphs.SPANS)

    def crop_to(self, length: int) -> None:
        self.length = length

    def compact(self, keep: list[int], start: int) -> None:
        """Keep cache positions `keep` (absolute, ascending) as positions start, start+1, ...; drop the rest. Rows
        already in place (a leading run of keep[i] == start + i) are not copied."""
        moved = next((i for i, position in enumerate(keep) if position != start + i), len(keep))
        if moved == len(keep):  # all in place: only truncate
            self.crop_to(start + len(keep))
            return
        layers = [layer for layer in self.layers if layer.is_initialized]
        buffers = [b for layer in layers for b in (layer.keys, layer.values)]
        if panel_kernel.loaded() and all(b.device.type == "cpu" and b.is_contiguous() for b in buffers):
            torch.ops.eagle.compact_rows(buffers, keep[moved:], start + moved)  # every layer in one call
            self.crop_to(start + len(keep))
            return
        index = {}  # one copy per device the layers live on (a device_map spreads them), not one per layer
        for layer in self.layers:
            if layer.is_initialized:
                device = layer.keys.device
                index.setdefault(device, to_device(keep[moved:], device))
                layer.compact(index[device], start + moved)
