"""One preallocated, compactable KV cache for the base and the draft head, written at explicit positions.

Each layer owns fixed buffers `keys`/`values` of shape [1, kv_heads, capacity, head_dim] and writes a pass's rows
with one method, `write(keys, values, at, read)`: `at` an int (rows at at.., keys read up to the last row written)
or a [q] long tensor of positions (rows scattered there, keys read over the buffers' first `read` positions: a
static span, as captured and compiled graphs need). Only the first `length` positions are valid, one length for all
layers (the cache's).

The base runs through transformers' decoder, which calls each layer's `update` (the `Cache` API): rows go to the
cache's length, and the last layer's update advances it (so a compiled pass takes and returns one int, not one a
layer), or, while `write_positions` is set (a device tensor [q], a CUDA-graph runner's static buffer), to those
positions over `read_span` keys, the mask spanning as many (`masks.widened`), the runner keeping the length. The
draft head (draft_head.py) calls `write` itself with the positions it drafts at, and its caller keeps the length.
`update` returns views of the valid prefix, so a forward pass never concatenates (DynamicCache copies the whole
cache on every step). After tree verification, `compact` moves the accepted tree rows into the contiguous prefix
and rejected rows are simply overwritten by the next pass. A cache made with `zeroed=True` starts with zero buffers:
a captured pass reads whole spans, and garbage (NaN) under a mask would still reach its output (0 * NaN).

A conversation's cache kept between turns (decoding/prefix_cache.py) starts the next generation with its first rows:
`start_from` copies them into a cache (a runner's static one, `lent`), `seeded_cache` hands the kept cache itself
over where it has the room, and `TreeKVCache.like` makes the copy a lent cache's rows are kept in.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from eagle.kernels import panel_kernel
from eagle.transfer import to_device


class PreallocatedLayer(CacheLayerMixin):
    """One attention layer's cache; buffers are allocated on first use (on the device of the layer) or by
    `allocate`. Its length is `cache`'s; `last`: the layer whose update advances it."""

    is_croppable = True
    is_sliding = False

    def __init__(self, capacity: int, cache: "TreeKVCache", last: bool):
        super().__init__()
        self.capacity = capacity
        self.cache = cache
        self.last = last

    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.empty(1, kv_heads, self.capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        if self.cache.zeroed:
            self.keys.zero_()
            self.values.zero_()
        self.dtype, self.device = dtype, device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(key_states.shape[1], key_states.shape[-1], key_states.dtype, key_states.device)

    def write(self, key_states, value_states, at: int | torch.Tensor, read: int | None = None):
        """Rows key_states, value_states [1, kv_heads, q, head_dim] written at positions `at`: an int (at.., keys
        read up to the last row written) or a [q] long tensor on the buffers' device (keys read over the first
        `read` positions). Returns the keys and values to attend over, views of the buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if isinstance(at, torch.Tensor):
            self.keys.index_copy_(2, at, key_states)
            self.values.index_copy_(2, at, value_states)
            return self.keys[:, :, :read], self.values[:, :, :read]
        end = at + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: {end} positions needed, {self.capacity} allocated. "
                "Raise max_length in eagenerate (the cache is sized max_length + tree size)."
            )
        self.keys[:, :, at:end] = key_states
        self.values[:, :, at:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' call: rows at the cache's `write_positions` if set, else appended at its length."""
        at = self.cache.write_positions  # [q] on the layer's device, or None
        if at is not None:
            return self.write(key_states, value_states, at, self.cache.read_span)
        out = self.write(key_states, value_states, self.cache.length)
        if self.last:
            self.cache.length += key_states.shape[-2]
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.cache.write_positions is not None:
            return self.cache.read_span, 0
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


class TreeKVCache(Cache):
    """A `Cache` of `PreallocatedLayer`s with one shared length; see the module docstring."""

    def __init__(self, num_layers: int, capacity: int, zeroed: bool = False, lent: bool = False):
        """zeroed: buffers start at zero (a CUDA-graph runner's cache, read by whole spans). lent: a runner's own
        cache (static buffers its graphs hold the addresses of), lent to one generation at a time: rows are kept
        from it by copy, never the cache itself."""
        self.length = 0  # valid positions in every layer
        self.zeroed = zeroed
        self.lent = lent
        layers = [PreallocatedLayer(capacity, self, last=i == num_layers - 1) for i in range(num_layers)]
        super().__init__(layers=layers)
        self.capacity = capacity
        self.write_positions: torch.Tensor | None = None  # [q] set by a CUDA-graph runner around a captured pass
        self.read_span: int | None = None  # the positions that pass attends over (a span: cuda_graphs.SPANS)

    def allocate(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> "TreeKVCache":
        """Every layer's buffers now (a cache whose writes are the caller's own: the draft head's)."""
        for layer in self.layers:
            layer.allocate(kv_heads, head_dim, dtype, device)
        return self

    def crop_to(self, length: int) -> None:
        self.length = length

    @classmethod
    def like(cls, other: "TreeKVCache", capacity: int) -> "TreeKVCache":
        """A new cache of `capacity` positions with `other`'s layers (count, shapes, dtype, devices), allocated."""
        cache = cls(len(other.layers), capacity)
        for layer, source in zip(cache.layers, other.layers):
            if source.is_initialized:
                _, kv_heads, _, head_dim = source.keys.shape
                layer.allocate(kv_heads, head_dim, source.keys.dtype, source.keys.device)
        return cache

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers allocated (the whole capacity, not only the valid rows)."""
        layers = [layer for layer in self.layers if layer.is_initialized]
        return sum(b.numel() * b.element_size() for layer in layers for b in (layer.keys, layer.values))

    def start_from(self, source: "TreeKVCache | None", rows: int) -> "TreeKVCache":
        """This cache holding `source`'s first `rows` positions (every layer's keys and values, copied on their
        devices; layers not allocated yet take the source's shapes), its length `rows`. source None: rows is 0, the
        cache emptied. Returns the cache."""
        if rows > self.capacity:
            raise ValueError(f"{rows} kept rows do not fit a cache of {self.capacity} positions")
        if rows:
            for layer, src in zip(self.layers, source.layers, strict=True):
                if not layer.is_initialized:
                    _, kv_heads, _, head_dim = src.keys.shape
                    layer.allocate(kv_heads, head_dim, src.keys.dtype, src.keys.device)
                layer.keys[:, :, :rows].copy_(src.keys[:, :, :rows])  # [1, KV, rows, D]
                layer.values[:, :, :rows].copy_(src.values[:, :, :rows])
        self.length = rows
        return self

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


def seeded_cache(new, capacity: int, kept: TreeKVCache | None, rows: int, bound: int | None = None) -> TreeKVCache:
    """A cache of our own of at least `capacity` positions holding `kept`'s first `rows`: `kept` itself where it has
    the room (nothing copied), else `new(size)` with the rows copied in, size grown past `capacity` towards twice
    kept's (the next turn is longer still) but never past `bound` (the most any generation under its max_length
    needs). new: capacity -> an empty cache of the caller's layers (allocated now or on first write)."""
    if kept is None:
        return new(capacity)
    if not kept.lent and kept.capacity >= capacity:
        kept.crop_to(rows)
        return kept
    size = max(capacity, min(2 * kept.capacity, bound or capacity))
    return new(size).start_from(kept, rows)


def kept_copy(cache: TreeKVCache, rows: int, spare: TreeKVCache | None = None) -> TreeKVCache:
    """What a generation's cache leaves to keep its first `rows` positions: the cache itself where it is our own,
    else (a runner's `lent` one) a copy of those rows, into `spare` (a kept cache no longer in use) where it has the
    room, or into a new cache of `rows` positions."""
    if not cache.lent:
        return cache
    if spare is None or spare.lent or spare is cache or spare.capacity < rows or not _same_layers(spare, cache):
        spare = TreeKVCache.like(cache, max(rows, 1))
    return spare.start_from(cache, rows)


def _same_layers(a: TreeKVCache, b: TreeKVCache) -> bool:
    """Whether two caches' layers hold rows of one layout (kv heads, head dim, dtype, device; allocated alike)."""
    def layout(layer):
        k = layer.keys if layer.is_initialized else None
        return None if k is None else (k.shape[1], k.shape[3], k.dtype, k.device)

    return len(a.layers) == len(b.layers) and all(layout(x) == layout(y) for x, y in zip(a.layers, b.layers))
