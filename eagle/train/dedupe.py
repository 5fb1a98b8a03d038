"""Duplicates among training prompts: exact (the same words) and near (MinHash over word 3-grams, banded LSH).

A text's words are benchmark_guard's (lowercase runs of letters and digits). Two texts are near duplicates when the
MinHash estimate of the Jaccard similarity of their word 3-gram sets is >= `threshold`; candidates are the pairs that
agree on all rows of at least one band of the signature, so a pair at similarity s is found with probability
1 - (1 - s^rows)^bands (0.98 at s = 0.7 for 16 bands of 4 rows). Deterministic: the shingles are hashed with
blake2b (not Python's salted `hash`) and permuted by fixed (a, b) pairs modulo 2^31 - 1.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .benchmark_guard import ngrams, words

SHINGLE, BANDS, ROWS = 3, 16, 4
_PRIME = (1 << 31) - 1  # hashes and permutation constants below it: a * h + b < 2^63, exact in uint64
_rng = np.random.default_rng(20261126)
_A = _rng.integers(1, _PRIME, BANDS * ROWS, dtype=np.uint64)  # [P] the permutations' (a, b): h -> (a h + b) mod p
_B = _rng.integers(0, _PRIME, BANDS * ROWS, dtype=np.uint64)


def _hashes(text: str) -> np.ndarray:
    """The text's word 3-grams (its words, if fewer than 3) as 31-bit hashes [S] uint64."""
    ws = words(text)
    grams = ngrams(ws, SHINGLE) or {ws}
    digest = (hashlib.blake2b(" ".join(g).encode(), digest_size=8).digest() for g in grams)
    return np.fromiter((int.from_bytes(d, "little") % _PRIME for d in digest), dtype=np.uint64, count=len(grams))


def signature(text: str) -> np.ndarray:
    """MinHash signature [BANDS * ROWS] uint64: per permutation, the least permuted shingle hash."""
    h = _hashes(text)[:, None]  # [S, 1]
    return ((_A * h + _B) % np.uint64(_PRIME)).min(axis=0)  # [S, P] -> [P]


class UniqueTexts:
    """Texts kept so far, indexed by their words and by the bands of their MinHash signatures, so that a new text
    is checked against all of them at the cost of its own signature."""

    def __init__(self, threshold: float = 0.7):
        self.threshold = threshold
        self.exact: set[tuple[str, ...]] = set()
        self.buckets: dict[tuple[int, bytes], list[int]] = {}
        self.signatures: list[np.ndarray] = []

    @staticmethod
    def _keys(sig: np.ndarray) -> list[tuple[int, bytes]]:
        return [(b, sig[b * ROWS : (b + 1) * ROWS].tobytes()) for b in range(BANDS)]

    def holds(self, text: str) -> bool:
        """Whether a kept text has the same words as `text` or is its near duplicate (estimated Jaccard >=
        threshold)."""
        return self._repeat(text)[0]

    def add(self, text: str) -> bool:
        """Keep `text` unless `holds` it; returns whether it was kept."""
        repeat, sig = self._repeat(text)
        if repeat:
            return False
        self.exact.add(words(text))
        for key in self._keys(sig):
            self.buckets.setdefault(key, []).append(len(self.signatures))
        self.signatures.append(sig)
        return True

    def _repeat(self, text: str) -> tuple[bool, np.ndarray | None]:
        if words(text) in self.exact:
            return True, None
        sig = signature(text)
        candidates = {j for key in self._keys(sig) for j in self.buckets.get(key, ())}
        return any(np.mean(self.signatures[j] == sig) >= self.threshold for j in candidates), sig


def keep_unique(texts: list[str], threshold: float = 0.7) -> list[int]:
    """Indices of the texts kept, in order: each text is dropped when an earlier kept one has the same words or is
    its near duplicate (estimated Jaccard >= threshold)."""
    kept = UniqueTexts(threshold)
    return [i for i, text in enumerate(texts) if kept.add(text)]
