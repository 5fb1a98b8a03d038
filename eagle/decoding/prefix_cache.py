"""A conversation's caches kept between turns: the next turn prefills only the tokens past the longest common prefix.

A chat sends the whole conversation every turn. After a generation, the base's KV rows and the draft head's of the
sequence it ended on (prompt + reply, as token ids) stay with the conversation (`KeptPrefix`), in a store of several
conversations within a memory budget (`PrefixStore`, least recently used dropped first), under a key the caller
chooses (a browser session, an API conversation). The next turn whose prompt shares a prefix with that sequence
starts from the rows of the prefix both caches hold valid (`KeptPrefix.reuse_point`) and prefills the rest.

Which rows are valid for a new sequence S, with T the kept sequence and m = the common prefix of T and S:
- the base's row i depends on tokens 0..i: valid where i < m and i < base_rows (the rows written, at most len(T);
  the last token of a reply never went through the base);
- the head's row i is computed from the base's feature at i and token i + 1 (draft.py): valid where i < m - 1 and
  i < head_rows; the head lags the base by the rows of the last round's path, which were never committed to it;
- the reuse point L is the smaller bound, at most len(S) - 1 (the last prompt token's logits pick the first token),
  so that both caches hold exactly rows [0, L) valid for S and the base's prefill of positions L.. gives the features
  the head's rows L.. need. Vanilla turns read the base's rows alone.

The rows reused are those an earlier pass computed (a prefill, decode steps, tree verifications), so a warm turn sees
the same values a cold prefill of S computes wherever every row's arithmetic is independent of how many rows a pass
has (the quantized default model: one kernel at every row count, row attention); with float32 kernels that change
with the row count (MKL's GEMM for a long prefill, its GEMV for a step), a row may differ in the last bits, as a
tree's rows already may from a vanilla step's (eagle/kernels/few_rows.py).

Caches of our own are kept as they are; a runner's static cache (CUDA graphs: `TreeKVCache.lent`) gets the kept rows
by copy when a generation leases it and gives them back by copy before it is released (kv_cache.kept_copy).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from eagle.models.kv_cache import TreeKVCache, kept_copy

DEFAULT_BUDGET = 512 << 20  # bytes of kept caches in a store: the default model's 2,048-token conversation is ~100 MB


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass
class KeptPrefix:
    """One conversation's kept state. Invariants: base rows [0, base_rows) are those of tokens[:base_rows] (row i
    from tokens 0..i), base_rows <= len(tokens); head rows [0, head_rows) were computed by `head_of` in its dtype
    then, row i from the base's feature at i and tokens[i + 1], head_rows <= len(tokens) - 1."""

    tokens: list[int]  # the sequence the rows belong to: the last turn's prompt and reply
    base: TreeKVCache
    base_rows: int
    head: TreeKVCache | None = None
    head_rows: int = 0
    head_of: object = None  # the DraftHead whose rows `head` holds
    prefilled: int | None = None  # of the base rows, the first ones a prefill wrote (the prompt's); None: all

    def reuse_point(self, ids: list[int], head=None, exact: bool = True) -> int:
        """L: the rows of both caches valid for a generation whose prompt is `ids` (with `head` drafting; None: a
        vanilla generation, the base's rows alone), at most len(ids) - 1. exact: only the rows a prefill wrote, so
        that the generation sees the bits a cold prefill of `ids` computes (module docstring); else every row
        valid (for timing: a decoding step's row may differ from a prefill's in its last bits)."""
        same = common_prefix(self.tokens, ids)
        held = self.base_rows if not exact or self.prefilled is None else min(self.prefilled, self.base_rows)
        rows = min(held, same, len(ids) - 1)
        if head is not None:
            rows = min(rows, self.head_rows if self.head_holds(head) else 0, same - 1)
        return max(rows, 0)

    def head_holds(self, head) -> bool:
        """Whether the head rows kept are `head`'s (the same head, in the same dtype)."""
        if self.head is None or head is not self.head_of:
            return False
        return self.head.layers[0].keys.dtype == head.fc.weight.dtype

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + (self.head.nbytes if self.head is not None else 0)

    def copy(self) -> "KeptPrefix":
        """The same state in caches of its own (the valid rows copied): a generation that starts from it leaves this
        one as it was."""
        base = TreeKVCache.like(self.base, max(self.base_rows, 1)).start_from(self.base, self.base_rows)
        head = None
        if self.head is not None:
            head = TreeKVCache.like(self.head, max(self.head_rows, 1)).start_from(self.head, self.head_rows)
        return KeptPrefix(list(self.tokens), base, self.base_rows, head, self.head_rows, self.head_of, self.prefilled)


class PrefixStore:
    """Kept conversations by key, within `budget` bytes (their caches' allocated buffers), the least recently used
    dropped first. A generation takes its conversation's state out (`take`) and puts the new one back (`put`), so two
    generations of one key at once never share caches: the second finds none and starts cold. Thread-safe."""

    def __init__(self, budget: int = DEFAULT_BUDGET):
        self._kept: OrderedDict[Hashable, KeptPrefix] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._budget = budget

    @property
    def budget(self) -> int:
        """Bytes the kept caches may take (a setting: a smaller one drops the least recently used now)."""
        return self._budget

    @budget.setter
    def budget(self, nbytes: int) -> None:
        with self._lock:
            self._budget = nbytes
            self._fit()

    def _fit(self) -> None:
        while self._kept and self.nbytes > self._budget:
            self._kept.popitem(last=False)

    def take(self, key: Hashable) -> KeptPrefix | None:
        with self._lock:
            return self._kept.pop(key, None)

    def put(self, key: Hashable, kept: KeptPrefix) -> None:
        """Keep `kept` under `key`, the most recently used; older conversations dropped until the store fits its
        budget (`kept` itself too, when it alone does not)."""
        with self._lock:
            self._kept.pop(key, None)
            if kept.nbytes <= self._budget:
                self._kept[key] = kept
            self._fit()

    def drop(self, key: Hashable) -> None:
        with self._lock:
            self._kept.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def keys(self) -> list[Hashable]:
        """The kept conversations, least recently used first."""
        with self._lock:
            return list(self._kept)

    def get(self, key: Hashable) -> KeptPrefix | None:
        """The state kept under `key` without taking it (for figures and tests)."""
        with self._lock:
            return self._kept.get(key)

    def borrow(self, key: Hashable) -> KeptPrefix | None:
        """A copy of the state kept under `key` (`KeptPrefix.copy`), which stays kept as it is, the most recently
        used: for a generation that reads a conversation without changing it (a reference timed beside a reply)."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
        return kept.copy() if kept is not None else None

    @property
    def nbytes(self) -> int:
        return sum(kept.nbytes for kept in self._kept.values())


class Turn:
    """One generation of a conversation: the state it starts from and, once its rounds end (finished, or the stream
    closed at a round), the state it leaves (`kept_after`). The caches it ran on are set by the caller as it leases
    them (`base_cache`, `head_cache`: a generation that drafts)."""

    def __init__(self, prompt: list[int], kept: KeptPrefix | None, head=None, exact: bool = True):
        """head: the DraftHead drafting this generation (None: vanilla). exact: `KeptPrefix.reuse_point`'s."""
        self.prompt, self.kept, self.head = prompt, kept, head
        self.start = kept.reuse_point(prompt, head, exact) if kept is not None else 0  # L: the rows reused
        self.produced: list[int] = []  # the tokens of the rounds so far
        self.base_cache: TreeKVCache | None = None
        self.head_cache: TreeKVCache | None = None

    @property
    def kept_base(self) -> TreeKVCache | None:
        return self.kept.base if self.kept is not None else None

    @property
    def kept_head(self) -> TreeKVCache | None:
        """The kept head cache where this generation drafts with the head whose rows it holds."""
        ok = self.kept is not None and self.head is not None and self.kept.head_holds(self.head)
        return self.kept.head if ok else None

    def kept_after(self) -> KeptPrefix:
        """The state to keep after the rounds so far; called at a round's end (the caches consistent: the base's
        rows those of the sequence, then rows of tokens the budget cut, which `base_rows` leaves out), before a
        runner's lent caches go back (their rows are copied out now)."""
        tokens = self.prompt + self.produced
        old = self.kept
        base_rows = min(self.base_cache.length, len(tokens))
        prefilled = min(len(self.prompt), base_rows)  # the prompt's rows: kept ones a prefill wrote, the rest prefilled
        base = kept_copy(self.base_cache, base_rows, old.base if old is not None else None)
        if self.head is not None and self.head_cache is not None:  # a drafting generation: its head's rows
            head_rows = min(self.head_cache.length, len(tokens) - 1)
            spare = old.head if old is not None else None
            return KeptPrefix(tokens, base, base_rows, kept_copy(self.head_cache, head_rows, spare), head_rows,
                              self.head, prefilled)  # fmt: skip
        if old is None or old.head is None:  # vanilla: the head's kept rows stay, those still of this sequence
            return KeptPrefix(tokens, base, base_rows, prefilled=prefilled)
        head_rows = max(0, min(old.head_rows, common_prefix(old.tokens, tokens) - 1))
        return KeptPrefix(tokens, base, base_rows, old.head, head_rows, old.head_of, prefilled)
