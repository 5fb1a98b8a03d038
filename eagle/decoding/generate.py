"""The decoding loops, as streams of rounds: prefill, then draft -> verify -> accept until a stop.

One round = one base forward pass. Each yields a `Round` with the tokens it produced, of which the first
`accepted` were proposed by the draft and accepted, and the last one (if not cut by a stop) is the base's own.
Vanilla decoding is the same loop with a root-only tree: every round yields exactly one base token.

`start` (every loop): the caches come holding the first `start` positions of the prompt already (a conversation's
kept rows, prefix_cache.py: the base's rows 0..start-1 and the head's, row i from the base's feature at i and token
i + 1), and the prefill reads the prompt from there: the base over positions start..P-1, the head over the rows
start..P-1 their features make (the last one with the first token). start < P: the last prompt token's logits pick
the first token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from eagle.models.base import BaseModel
from eagle.models.masks import tree_mask
from eagle.transfer import to_device

from .context_draft import ContextDrafter
from .draft import Drafter
from .round_steps import DeviceTree, TreeShape, attach_chain
from .tree import DraftTree, TreeDraft
from .verify import TokenPicker, accept


@dataclass
class Round:
    tokens: list[int]  # the new token ids of this round, in order
    accepted: int  # tokens[:accepted] were drafted and accepted; tokens[accepted:] came from the base itself
    seconds: float  # wall time of the round (device work included: the loop syncs to read the tokens)
    stop: str | None = None  # "eos", "max_new_tokens" or "max_length" on the last round
    context: int = 0  # tokens[accepted - context : accepted] were context drafts (copies of earlier text)
    # the first round only (0 on later ones): prompt tokens whose KV rows came from the conversation's kept cache (not
    # prefilled), and seconds from the stream's start to the first token (the caches leased and the kept rows put in
    # them, the prefill of the rest, the first pick): the time to the first token; the round's `seconds` is its own
    cached: int = 0
    prefill_s: float = 0.0

    @property
    def from_draft(self) -> list[bool]:
        return [i < self.accepted for i in range(len(self.tokens))]

    @property
    def from_context(self) -> list[bool]:
        return [self.accepted - self.context <= i < self.accepted for i in range(len(self.tokens))]


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2 dynamic tree (total_token, depth, top_k) or, with `choices`, an EAGLE-1 static tree."""

    total_token: int = 60
    depth: int = 7
    top_k: int = 10
    choices: tuple | None = None
    chain: int = 0  # M: nodes a context draft may add to a round's tree at most (context_draft.py); 0 = none

    @property
    def max_depth(self) -> int:  # the head's deepest node
        if self.choices:
            return max(map(len, self.choices))
        return TreeShape.of(self.total_token, self.depth, self.top_k).head_depth

    @property
    def max_nodes(self) -> int:  # with a context chain's
        return (len(self.choices) + 1 if self.choices else self.total_token) + self.chain

    @property
    def max_draft_entries(self) -> int:
        return len(self.choices) if self.choices else self.depth * self.top_k


class Budget:
    """Stops: a stop token (kept, nothing after it), max_new_tokens and max_length (prompt + new)."""

    def __init__(self, prompt_len: int, max_new_tokens: int, max_length: int, stop_ids: set[int]):
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if prompt_len >= max_length:
            raise ValueError(
                f"the prompt has {prompt_len} tokens, max_length is {max_length}: no room to generate. "
                "Shorten the prompt or raise max_length."
            )
        self.limit = min(max_new_tokens, max_length - prompt_len)
        self.limit_reason = "max_new_tokens" if max_new_tokens <= max_length - prompt_len else "max_length"
        self.stop_ids = stop_ids
        self.produced = 0

    def take(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Cut a round's tokens at the first stop token (inclusive) or the length limit."""
        for i, t in enumerate(tokens):
            if t in self.stop_ids:
                tokens, reason = tokens[: i + 1], "eos"
                break
        else:
            reason = None
        room = self.limit - self.produced
        if len(tokens) >= room:
            tokens, reason = tokens[:room], reason if len(tokens) == room and reason else self.limit_reason
        self.produced += len(tokens)
        return tokens, reason


def _context_accepted(accepted: int, drafted: int, from_context: int) -> int:
    """Of the `accepted` tokens kept of a path of `drafted`, the last `from_context` of which are context nodes:
    how many kept ones are context nodes."""
    return max(0, accepted - (drafted - from_context))


def _prefill(base: BaseModel, input_ids: torch.Tensor, cache, features: bool, start: int = 0):
    """The base over the prompt's positions start..P-1 (the cache holds the first `start`): the last one's logits
    [1, V] and the features [P - start, F] of all of them (or None)."""
    n = input_ids.shape[1]
    if cache.length != start or not 0 <= start < n:
        raise ValueError(f"a prefill from position {start} of {n} needs a cache of {start} rows, not {cache.length}")
    positions = torch.arange(start, n, device=base.input_device)[None]
    return base.forward(input_ids[:, start:], positions, cache, features=features, last_logits_only=True)


# -------------------------------------------------------------------------------------------------------------
def vanilla_rounds(
    base: BaseModel, input_ids: torch.Tensor, picker: TokenPicker, budget: Budget, cache, start: int = 0
) -> Iterator[Round]:
    """One token per base forward, on the same model code and cache as EAGLE (the baseline)."""
    root_only = DraftTree([0], [-1])
    t0 = time.perf_counter()
    logits, _ = _prefill(base, input_ids, cache, features=False, start=start)
    position = input_ids.shape[1]
    while True:
        _, _, token = accept(root_only, logits, picker)
        tokens, stop = budget.take([token])
        yield Round(tokens, 0, time.perf_counter() - t0, stop)
        if stop:
            return
        t0 = time.perf_counter()
        step = to_device([[token], [position]], base.input_device)  # [2, 1] one transfer: id, position
        logits, _ = base.forward(step[:1], step[1:], cache, features=False)
        position += 1


def eagle_rounds(
    base: BaseModel, drafter: Drafter, input_ids: torch.Tensor, picker: TokenPicker, budget: Budget,
    tree_spec: TreeSpec, cache, context: ContextDrafter | None = None, start: int = 0,
) -> Iterator[Round]:  # fmt: skip
    """context: context drafts offered beside the head's tree (the sequence so far is given to it here). start: rows
    both caches hold already (the drafter's cache has `start` committed rows)."""
    t0 = time.perf_counter()
    prompt = input_ids[0].tolist()  # input_ids is on the host
    # prefill: the base reads the prompt and produces the first token (the first root)
    logits, features = _prefill(base, input_ids, cache, features=True, start=start)  # [1, V], [P - start, F]
    _, _, root = accept(DraftTree([0], [-1]), logits, picker)
    tokens, stop = budget.take([root])
    yield Round(tokens, 0, time.perf_counter() - t0, stop)
    if stop:
        return
    t0 = time.perf_counter()
    committed = input_ids.shape[1]  # tokens in the base cache; the root is pending
    drafter.commit(features, prompt[start + 1 :] + [root])  # head rows start..P-1
    if context is not None:
        context.extend(prompt + [root])
    while True:
        # draft: the tree stays on the device
        if tree_spec.choices:
            draft = drafter.static_tree(root, tree_spec.choices)
        else:
            draft = drafter.dynamic_tree(root, tree_spec.total_token, tree_spec.depth, tree_spec.top_k)
        head_nodes = len(draft)
        chain = context.propose() if context is not None else None
        if chain is not None:  # a copy of earlier text in the same tree (round_steps.attach_chain)
            head = DeviceTree(draft.tokens, draft.parents, draft.depth, draft.ancestors)
            draft = TreeDraft(*attach_chain(head, chain.proposal, chain.count, chain.nodes))
        # verify: one base pass over all tree nodes, then the round's one host read (accept)
        mask = tree_mask(committed, draft.ancestors, base.dtype, base.input_device)
        inputs = draft.tokens.clamp(min=0)[None]  # [1, N] a chain's padding nodes (-1) read token 0
        logits, features = base.forward(inputs, committed + draft.depth[None], cache, mask=mask)
        tree, path, root = accept(draft, logits, picker)
        # accept: keep the path's KV rows, feed the path to the draft
        cache.compact([committed + i for i in path], committed)
        new_tokens = tree.path_tokens(path[1:]) + [root]
        tokens, stop = budget.take(new_tokens)
        accepted = min(len(path) - 1, len(tokens))
        from_context = sum(node >= head_nodes for node in path)
        seconds = time.perf_counter() - t0
        yield Round(tokens, accepted, seconds, stop, _context_accepted(accepted, len(path) - 1, from_context))
        if stop:
            return
        t0 = time.perf_counter()
        if context is not None:
            context.observe(new_tokens, from_context, seconds)
        index = to_device(path, features.device)
        drafter.commit(features.index_select(0, index), new_tokens)
        committed += len(path)


def greedy_tree_rounds(
    base: BaseModel, runner, input_ids: torch.Tensor, budget: Budget, cache, draft_cache,
    context: ContextDrafter | None = None, start: int = 0,
) -> Iterator[Round]:  # fmt: skip
    """Greedy EAGLE-2 rounds, each three calls of `runner` (round_graphs.py: `draft`, `verify`, `keep`) and one host
    read, after the prefill (the base's, then the head's over the prompt but its last rows: `runner.prefill`); the
    same tokens as `eagle_rounds` with a greedy picker. draft_cache: the head's, with room for the prompt, the budget,
    one commit and one tree (round_steps.TreeShape). context: context drafts offered beside the head's tree (the
    runner's shape has room for them). start: rows both caches hold already (the draft cache's length)."""
    t0 = time.perf_counter()
    logits, features = _prefill(base, input_ids, cache, features=True, start=start)  # [1, V], [P - start, F]
    root = logits[-1].argmax()  # [] the first token
    tokens, stop = budget.take([int(root)])
    yield Round(tokens, 0, time.perf_counter() - t0, stop)
    if stop:
        return
    t0 = time.perf_counter()
    prompt = input_ids.shape[1]
    # [P - start] the token after each prefilled position
    ids = torch.cat([to_device(input_ids[0, start + 1 :], root.device), root.reshape(1)])
    # base cache rows; draft cache rows (`start`, the draft cache's length from here on); rows the next commit brings
    committed, n = prompt, prompt - start
    head_rows = n - runner.shape.head_commit_rows  # the head reads these alone; the rest as a round's commit
    if head_rows > 0:
        runner.prefill(draft_cache, features[:head_rows], ids[:head_rows], start)
        draft_cache.length = start = start + head_rows
        features, ids, n = features[head_rows:], ids[head_rows:], n - head_rows  # [C', F], [C']
    length = to_device(torch.tensor(n), root.device)  # [] n on the device
    if context is not None:
        context.extend(input_ids[0].tolist() + tokens)
    depth = runner.shape.max_depth  # D: the packet's layout (round_steps.Verdict)
    while True:
        tree = runner.draft(draft_cache, start, features, ids, length, root, rows=n)
        draft_cache.length = start = start + n
        verdict = runner.verify(cache, committed, tree, context.propose() if context is not None else None)
        packet = verdict.packet.tolist()  # the round's one host read
        n, root_id, from_context = packet[0], packet[depth + 1], packet[depth + 2]  # n: path nodes, root included
        path = packet[depth + 3 : depth + 3 + n]
        runner.keep(cache, committed, path, verdict)
        new_tokens = packet[1:n] + [root_id]
        tokens, stop = budget.take(new_tokens)
        accepted, seconds = min(n - 1, len(tokens)), time.perf_counter() - t0
        yield Round(tokens, accepted, seconds, stop, _context_accepted(accepted, n - 1, from_context))
        if stop:
            return
        t0 = time.perf_counter()
        if context is not None:
            context.observe(new_tokens, from_context, seconds)
        committed += n
        features, ids, length, root = verdict.features, verdict.commit_ids, verdict.length, verdict.root
