"""Context drafts: a copy of earlier text offered as a chain beside the head's tree, when it is likely to pay.

Each round the host looks up the longest earlier occurrence of the sequence's end (context_index.py) and may offer
the tokens that followed it; round_steps.attach_chain hangs them in the same tree as the head's drafts, and the one
base pass verifies both. Verification is unchanged, so the output is too (greedy and sampled): a chain is a
deterministic function of the context, as the head's top-k drafts are.

Whether a round offers a chain is decided by measurement (`ContextStats`, kept per model across generations): a
chain costs the verify pass M more rows and earns the context nodes it gets accepted. With a round of T0 seconds
that yields tau tokens, a chain that makes the round T1 long pays when its expected gain g > tau * (T1 / T0 - 1).
g is learnt per bucket of match length (a long match is copied text; a one-token match is chance); a bucket that
does not pay is still tried every `EXPLORE` rounds, so that what it earns stays measured.

How many nodes a chain gets (M) is chosen per bucket and machine when the tree is tuned (`pick_chains`), among at
most two sizes (each a verify graph to compile): from the measured verify costs of n + M rows and a profile of how
far copies are accepted per bucket (`ContextStats.profile`, measured over ShareGPT openings by
eagle/train/context_profile.py and shipped beside the head as context_profile.json).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .context_index import ContextIndex

BUCKETS = (1, 2, 3, 4, 8, 16)  # match lengths: a bucket holds lengths from its bound up to the next one's
EXPLORE = 32  # a declined bucket is offered once in this many rounds
PRIOR_GAIN = 2.0  # tokens a chain is assumed to earn before a bucket has been measured (so that it gets tried)
CHAINS = (4, 8, 12, 16)  # chain sizes (M) the tuner chooses among


@dataclass
class Mean:
    """A running mean that turns into an exponential one after `window` values (recent rounds count most)."""

    value: float
    seen: int = 0
    window: int = 24

    def add(self, x: float) -> None:
        self.seen += 1
        self.value += (x - self.value) / min(self.seen, self.window)


@dataclass
class ContextStats:
    """What chains earned on this machine: per match bucket the context tokens accepted per offer; the round's
    seconds without a chain and with one of each size, and the tokens a round's head tree yields."""

    gain: list[Mean] = field(default_factory=lambda: [Mean(PRIOR_GAIN) for _ in BUCKETS])
    seconds: dict[int, Mean] = field(default_factory=dict)  # per chain nodes (0: no chain)
    tokens: Mean = field(default_factory=lambda: Mean(1.0))  # per round from the head's tree and the base
    declined: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    always: bool = False  # offer every match, measured or not (for tests and comparisons)
    # the profile: rounds seen; per bucket rounds whose sequence end matched in it, rounds offered a chain, and of
    # those the rounds with at least k context tokens accepted (reached[b][k - 1])
    rounds: int = 0
    matched: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    offered: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    reached: list[list[int]] = field(default_factory=lambda: [[] for _ in BUCKETS])

    def pays(self, bucket: int, nodes: int) -> bool:
        """Whether a chain of `nodes` for a match in `bucket` is expected to raise tokens per second."""
        without, with_chain = self.seconds.get(0), self.seconds.get(nodes)
        if without is None or with_chain is None:
            return True  # nothing to compare yet: measure both
        cost = self.tokens.value * max(with_chain.value / without.value - 1.0, 0.0)  # tokens the extra rows cost
        return self.gain[bucket].value > cost

    def offer(self, bucket: int, nodes: int) -> bool:
        if self.always or self.pays(bucket, nodes):
            return True
        self.declined[bucket] += 1
        return self.declined[bucket] % EXPLORE == 0

    def observe(self, bucket: int | None, from_context: int, seconds: float, tokens: int, nodes: int = 0) -> None:
        """A finished round: bucket of the chain offered (None: none) and its nodes, its accepted context tokens,
        its seconds and tokens (a whole round, the base's own token included)."""
        self.seconds.setdefault(nodes if bucket is not None else 0, Mean(0.0)).add(seconds)
        self.tokens.add(tokens - from_context)  # what the head's tree alone yields (a chain's nodes are beyond it)
        self.rounds += 1
        if bucket is not None:
            self.gain[bucket].add(from_context)
            self.offered[bucket] += 1
            self._add_reached(bucket, [1] * from_context)

    def merge(self, other: "ContextStats") -> None:
        """Add `other`'s profile counts (rounds, matched, offered, reached) to this one's."""
        self.rounds += other.rounds
        for b in range(len(BUCKETS)):
            self.matched[b] += other.matched[b]
            self.offered[b] += other.offered[b]
            self._add_reached(b, other.reached[b])

    def _add_reached(self, bucket: int, counts: list[int]) -> None:
        """reached[bucket][k] += counts[k], the list grown to the longest run seen."""
        reached = self.reached[bucket]
        reached += [0] * (len(counts) - len(reached))
        for k, n in enumerate(counts):
            reached[k] += n

    def profile(self) -> dict:
        """What chains were accepted, per bucket: `share` of all rounds whose sequence end matched in the bucket,
        and `survival[k - 1]`, the share of offered chains with at least k context tokens accepted (the format of
        context_profile.json, read by `pick_chains`)."""
        rounds = max(self.rounds, 1)
        return {
            "buckets": list(BUCKETS),
            "rounds": self.rounds,
            "share": [m / rounds for m in self.matched],
            "survival": [[r / o for r in reached] if o else [] for o, reached in zip(self.offered, self.reached)],
        }


def pick_chains(profile: dict, tau: float, round_seconds: float, extra_seconds: Callable[[int], float],
                candidates: tuple[int, ...] = CHAINS, sizes: int = 2) -> tuple[int, ...]:  # fmt: skip
    """The chain size (M) each bucket offers, of at most `sizes` sizes among `candidates` (each size is a verify
    graph to compile), for the highest expected speed-up over the head alone: a round of `round_seconds` yields
    `tau` tokens; one with a chain of M nodes takes `extra_seconds(M)` more and earns the bucket's expected accepted
    copy, the sum over k <= M of survival[k - 1]. A bucket whose chain would not pay is declined at run time
    (`ContextStats.pays`), so it counts as no change; buckets weigh by their share of rounds. Ties: fewer, shorter."""
    if list(profile.get("buckets", ())) != list(BUCKETS):
        raise ValueError(f"context profile: buckets {profile.get('buckets')} are not {list(BUCKETS)} "
                         "(measure it again: python -m eagle.train.context_profile)")  # fmt: skip
    gains = {m: [(tau + sum(survival[:m])) / (round_seconds + extra_seconds(m)) * round_seconds / tau - 1.0
                 for survival in profile["survival"]] for m in candidates}  # fmt: skip
    best = None
    for n in range(1, sizes + 1):
        for chosen in itertools.combinations(sorted(candidates), n):
            per_bucket = tuple(max(chosen, key=lambda m: (gains[m][b], -m)) for b in range(len(BUCKETS)))
            value = sum(share * max(gains[m][b], 0.0)
                        for b, (share, m) in enumerate(zip(profile["share"], per_bucket)))  # fmt: skip
            rank = (value, -n, -sum(chosen))
            if best is None or rank > best[0]:
                best = (rank, per_bucket)
    return best[1]


def bucket_of(match: int) -> int:
    return max(i for i, bound in enumerate(BUCKETS) if match >= bound)


class ChainDraft(NamedTuple):
    """A round's context draft for round_steps.attach_chain."""

    proposal: torch.Tensor  # [P] long: the context's guess of the tokens after the root, padded
    count: torch.Tensor  # [] long: how many of them are real
    nodes: int  # M: the chain's nodes this round (its bucket's size)


class ContextDrafter:
    """One generation's context drafts: the sequence so far (prompt, then every token produced, the pending root
    included: `extend`), and per round the chain offered, if any."""

    def __init__(self, chains: tuple[int, ...], proposal: int, stats: ContextStats, device):
        """chains: M per match bucket (`pick_chains`); proposal: P, tokens a round offers (round_steps.TreeShape:
        the head's depth plus the largest M)."""
        self.index = ContextIndex()
        self.chains, self.size, self.stats, self.device = chains, proposal, stats, device
        self.bucket: int | None = None  # the bucket of the chain offered this round
        self.nodes = 0  # and its nodes

    def propose(self) -> ChainDraft | None:
        """The chain for round_steps.attach_chain, or None: no chain this round."""
        tokens, match = self.index.propose(self.size)
        self.bucket, self.nodes = None, 0
        if not tokens:
            return None
        bucket = bucket_of(match)
        self.stats.matched[bucket] += 1
        if not self.stats.offer(bucket, self.chains[bucket]):
            return None
        if len(tokens) < self.size:  # the copy reached the end of the text: it repeats itself (a period of the text)
            tokens = (tokens * -(-self.size // len(tokens)))[: self.size]
        self.bucket, self.nodes = bucket, self.chains[bucket]
        padded = torch.tensor(tokens + [0] * (self.size - len(tokens)), device=self.device)  # [P]
        return ChainDraft(padded, torch.tensor(len(tokens), device=self.device), self.nodes)

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def observe(self, tokens: list[int], from_context: int, seconds: float) -> None:
        """The round's new tokens (accepted, then the base's own), how many came from the chain, its seconds."""
        self.stats.observe(self.bucket, from_context, seconds, len(tokens), self.nodes)
        self.index.extend(tokens)
