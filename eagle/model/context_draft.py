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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .context_index import ContextIndex

BUCKETS = (1, 2, 3, 4, 8, 16)  # match lengths: a bucket holds lengths from its bound up to the next one's
EXPLORE = 32  # a declined bucket is offered once in this many rounds
PRIOR_GAIN = 2.0  # tokens a chain is assumed to earn before a bucket has been measured (so that it gets tried)


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
    seconds with and without a chain, and the tokens a round's head tree yields."""

    gain: list[Mean] = field(default_factory=lambda: [Mean(PRIOR_GAIN) for _ in BUCKETS])
    seconds: list[Mean] = field(default_factory=lambda: [Mean(0.0), Mean(0.0)])  # [without, with] a chain
    tokens: Mean = field(default_factory=lambda: Mean(1.0))  # per round from the head's tree and the base
    declined: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))
    always: bool = False  # offer every match, measured or not (for tests and comparisons)

    def pays(self, bucket: int) -> bool:
        """Whether a chain for a match in `bucket` is expected to raise tokens per second."""
        without, with_chain = self.seconds
        if not without.seen or not with_chain.seen:
            return True  # nothing to compare yet: measure both
        cost = self.tokens.value * max(with_chain.value / without.value - 1.0, 0.0)  # tokens the extra rows cost
        return self.gain[bucket].value > cost

    def offer(self, bucket: int) -> bool:
        if self.always or self.pays(bucket):
            return True
        self.declined[bucket] += 1
        return self.declined[bucket] % EXPLORE == 0

    def observe(self, bucket: int | None, from_context: int, seconds: float, tokens: int) -> None:
        """A finished round: bucket of the chain offered (None: none), its accepted context tokens, its seconds
        and tokens (a whole round, the base's own token included)."""
        self.seconds[bucket is not None].add(seconds)
        self.tokens.add(tokens - from_context)  # what the head's tree alone yields (a chain's nodes are beyond it)
        if bucket is not None:
            self.gain[bucket].add(from_context)


def bucket_of(match: int) -> int:
    return max(i for i, bound in enumerate(BUCKETS) if match >= bound)


class ContextDrafter:
    """One generation's context drafts: the sequence so far (prompt, then every token produced, the pending root
    included: `extend`), and per round the chain offered, if any."""

    def __init__(self, chain: int, proposal: int, stats: ContextStats, device):
        """chain: M, nodes a chain adds to the tree; proposal: P, tokens a round offers (round_steps.TreeShape)."""
        self.index = ContextIndex()
        self.chain, self.size, self.stats, self.device = chain, proposal, stats, device
        self.bucket: int | None = None  # the bucket of the chain offered this round

    def propose(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(proposal [P] long, count [] long) for round_steps.attach_chain, or None: no chain this round."""
        tokens, match = self.index.propose(self.size)
        self.bucket = None
        if not tokens or not self.stats.offer(bucket_of(match)):
            return None
        if len(tokens) < self.size:  # the copy reached the end of the text: it repeats itself (a period of the text)
            tokens = (tokens * -(-self.size // len(tokens)))[: self.size]
        self.bucket = bucket_of(match)
        padded = torch.tensor(tokens + [0] * (self.size - len(tokens)), device=self.device)  # [P]
        return padded, torch.tensor(len(tokens), device=self.device)

    def extend(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def observe(self, tokens: list[int], from_context: int, seconds: float) -> None:
        """The round's new tokens (accepted, then the base's own), how many came from the chain, its seconds."""
        self.stats.observe(self.bucket, from_context, seconds, len(tokens))
        self.index.extend(tokens)
