"""Verification: decide which drafted tokens the base model accepts. Shared by EAGLE-1/2/3 and vanilla decoding.

Vocabulary (as in vLLM): *accepted* = drafted tokens the base agrees with; the round always ends with one token the
base produces itself (the *bonus* token after a fully accepted path, or the *recovered* token where the draft
diverged). Vanilla decoding is the same procedure on a tree that holds only the root.

The rule: walk down from the root. At each node, draw the base's next token y from the base distribution at that
node, p(. | prefix) after temperature / top-k / top-p (greedy: y = argmax). If a child of the node carries y,
descend to it (y was accepted); otherwise stop and emit y.

Why this is lossless: every emitted token is a draw from the base distribution given exactly the tokens emitted
before it, so the output sequence is distributed as plain autoregressive sampling from the base, whatever the
draft proposed. The tree only decides how many of those draws one base forward pass can serve. This is exactly
EAGLE-2's multi-candidate rejection sampling with deterministic (top-k) drafts, where q(x) = 1: trying sibling x_1
with probability p(x_1), then x_2 with p(x_2) / (1 - p(x_1)) on the renormalised residual, and so on, accepts x_i
with total probability p(x_i) and, when all are rejected, draws from p restricted to the untried tokens. That is
one categorical draw from p, decomposed; we make the draw directly. Drafts must be a deterministic function of
the context (they are: top-k of the head), never of the verification's random numbers. Per node, the draw is made
in fp32 from the base logits only; the draft's probabilities never enter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .tree import DraftTree, TreeDraft


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_p in (0, 1) and top_k > 0 switch those filters on (0 = off), as in the reference."""

    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1] (0 or 1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


class TokenPicker:
    """Draws the base's token at a node, with the same processing as transformers' `generate(do_sample=True)`
    (temperature, then top-k, then top-p). batched: when sampling, one draw for every node of the tree at once
    (`exponential_race`: no host sync) rather than one per node the walk reaches; a cost choice, made by the
    caller (`RuntimeConfig.batched_draws`): either is exact."""

    def __init__(self, params: SamplingParams, batched: bool = False):
        self.params = params
        self.batched = batched
        self.warpers = []
        if not params.greedy:
            if params.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                self.warpers.append(TopKLogitsWarper(params.top_k))
            if 0 < params.top_p < 1:
                self.warpers.append(TopPLogitsWarper(params.top_p))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, V] raw base logits -> [n, V] fp32 probabilities of the (processed) base distribution."""
        scores = logits.float()
        for warp in self.warpers:
            scores = warp(None, scores)
        return torch.softmax(scores, dim=-1)

    def draws(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[n, V] logits of the tree nodes -> [n] one base token per node, on the device: the argmax, or when
        `batched`, one draw per node at once. Independent draws per node keep the walk exact: the nodes it visits
        are decided by earlier draws, never by their own. None when sampling unbatched (`node_picker` draws)."""
        if self.params.greedy:
            return logits.argmax(dim=-1)
        return exponential_race(self.probs(logits)) if self.batched else None

    def node_picker(self, logits: torch.Tensor):
        """[n, V] logits -> a function node -> base token, drawn when the walk reaches the node."""
        return lambda node: int(torch.multinomial(self.probs(logits[node : node + 1])[0], 1))


def exponential_race(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """[n, V] probabilities -> [n] one draw per row, token x with probability p(x): the first of V exponential
    clocks of rates p(x) to ring, argmin E(x) / p(x) = argmax p(x) / E(x) with E iid Exp(1). Unlike
    torch.multinomial it never waits for the device; tokens of probability 0 never win (E > 0 is kept above
    the smallest normal float, which moves no draw of a float32 probability)."""
    clocks = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / clocks).argmax(-1)


def accept(tree: TreeDraft | DraftTree, logits: torch.Tensor, picker: TokenPicker) -> tuple[DraftTree, list[int], int]:
    """Walk the tree under the base logits ([n, V], row i = prediction after node i). The round's one host read
    brings the base's draws and, if it is still on the device, the tree.

    Returns (the tree on the host, path, token): the accepted nodes from the root (path[0] == 0) and the base's own
    next token.
    """
    draws = picker.draws(logits)  # [n] or None
    if isinstance(tree, TreeDraft):
        tree, rows = tree.read(*([] if draws is None else [draws]))
    else:
        rows = [] if draws is None else [draws.tolist()]
    pick = rows[0].__getitem__ if rows else picker.node_picker(logits)
    path, node = [0], 0
    while True:
        token = pick(node)
        child = tree.children[node].get(token)
        if child is None:
            return tree, path, token
        path.append(child)
        node = child
