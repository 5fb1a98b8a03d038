"""A greedy EAGLE-2 round as two functions of tensors, each one graph when compiled (round_graphs.py):

    draft_step:  commit the accepted path to the draft cache, grow the tree level by level, select its nodes
    commit_step: the commit alone (a prompt's rows before the first draft step's)
    verify_step: the base pass over the tree, greedy acceptance, the next commit's inputs (then the caller keeps
                 the accepted path's KV rows, from the path in the packet it reads)
    attach_chain: a context draft (a copy of earlier text, context_draft.py) added to the tree before the pass

Nothing inside either reads the device from the host: the accepted path, its length and the next root stay tensors
and feed the next round's `draft_step` directly. The host reads one small tensor a round (`Verdict.packet`).
Shapes are static for a tree shape (top_k, depth, total_token); the context length is the only symbolic size, or,
with `span` given, none: the keys are then the cache's first `span` positions and the context length a [] tensor
(CUDA graphs, cuda_round.py). Run eagerly, these functions are the reference the compiled graphs are tested
against.

Shapes: N = tree nodes with the root (the head's; + M context nodes after `attach_chain`), D = the deepest node's
depth, C = commit rows (D + 1: the longest accepted path with the root; a prompt's first commit is its last head
depth + 1 rows, after `commit_step` over the rest, or the whole prompt where shorter), P = context tokens proposed
(head depth + M), F = base feature width, H = head width, Vd = draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from eagle.models.masks import additive_mask, tree_mask, with_tree

from .tree import ancestors_on_device


@dataclass(frozen=True)
class TreeShape:
    """The static shape of an EAGLE-2 dynamic tree: `levels` head expansions of `top_k` nodes each after the root's
    children, `nodes` kept (with the root), the deepest at depth `levels + 1`; with `chain` > 0, rounds may add a
    chain of up to that many context nodes (`attach_chain`; of one of the sizes `chain_sizes`), and every path,
    commit and packet is sized for the longest."""

    top_k: int
    levels: int
    nodes: int
    chain: int = 0  # M, the longest chain
    chains: tuple[int, ...] = ()  # the chain sizes rounds may add (() with a chain: `chain` alone)

    @classmethod
    def of(cls, total_token: int, depth: int, top_k: int) -> "TreeShape":
        levels = min(depth, total_token - 2)  # expansion `level` drafts nodes of depth level + 1
        pool = top_k + levels * top_k * top_k
        return cls(top_k, levels, min(total_token - 1, pool) + 1)

    def with_chain(self, chain: int) -> "TreeShape":
        return self.with_chains((chain,))

    def with_chains(self, chains) -> "TreeShape":
        sizes = tuple(sorted({m for m in chains if m}))
        return TreeShape(self.top_k, self.levels, self.nodes, max(sizes, default=0), sizes if len(sizes) > 1 else ())

    @property
    def chain_sizes(self) -> tuple[int, ...]:
        return self.chains or ((self.chain,) if self.chain else ())

    @property
    def head_depth(self) -> int:  # the head's deepest node
        return self.levels + 1

    @property
    def max_depth(self) -> int:  # D: a context chain hangs at most under the head's deepest node
        return self.head_depth + self.chain

    @property
    def proposal(self) -> int:  # P: context tokens a round offers (a prefix the head's nodes share, then the chain)
        return self.head_depth + self.chain

    @property
    def commit_rows(self) -> int:  # C: an accepted path of D drafted tokens plus the root
        return self.max_depth + 1

    @property
    def head_commit_rows(self) -> int:  # a path of the head's nodes alone plus the root (no context node on it)
        return self.head_depth + 1

    @property
    def without_chains(self) -> "TreeShape":  # the head's tree alone
        return TreeShape(self.top_k, self.levels, self.nodes)

    @property
    def draft_entries(self) -> int:  # draft-cache rows a tree writes after the commit
        return self.levels * self.top_k


class DeviceTree(NamedTuple):
    """tree.TreeDraft's fields as a tuple, which a compiled graph returns as it is (`TreeDraft(*tree)` reads it)."""

    tokens: torch.Tensor  # [N] long; tokens[0] is the root; -1: a padding node, never accepted (base reads id 0)
    parents: torch.Tensor  # [N] long; parents[0] == -1, parents[i] < i
    depth: torch.Tensor  # [N] long; root 0
    ancestors: torch.Tensor  # [N, N] bool: row i = i and its ancestors


class Verdict(NamedTuple):
    packet: torch.Tensor  # [2D + 4] long: path length L (root included), the L - 1 accepted tokens, pads, next root,
    #                       how many of the accepted tokens (the last ones) are context nodes, then `path`
    path: torch.Tensor  # [D + 1] long: the path's node at each depth (root first; 0 past its end)
    features: torch.Tensor  # [C, F] base features of the path's nodes (rows >= L: padding)
    commit_ids: torch.Tensor  # [C] the token after each path node: accepted tokens then the next root (pads after)
    length: torch.Tensor  # [] long, L
    root: torch.Tensor  # [] long, the base's own next token


# -------------------------------------------------------------------------------------------------------------
def draft_step(step, cache, start, features, ids, n, root, shape: TreeShape, span: int | None = None) -> DeviceTree:
    """Commit n rows at draft position `start`, then draft a tree under `root`.

    step: draft.HeadStep; cache: the head's TreeKVCache with `start` committed rows; features [C, F or H] and ids
    [C] the commit (rows >= n are padding, ignored); n, root [] long. Padding rows are written after the real ones
    and no real row attends to them; tree entries go after all C rows and are overwritten by the next commit, so the
    caller sets `cache.length = start + n` afterwards. span: None (start an int, the keys end at the last row
    written) or the keys' static width (start a [] long tensor; the commit and the tree fit in the span)."""
    C = ids.shape[0]
    out = commit_step(step, cache, start, features, ids, span)  # [C, H]
    last = out.index_select(0, (n - 1).reshape(1))  # [1, H]
    return grow_tree(step, cache, start, C, start + n, last, step.log_probs(last), root, shape, span)


def commit_step(step, cache, start, features, ids, span: int | None = None) -> torch.Tensor:
    """The head over C committed rows at draft positions start.., each seeing the rows before it: their KV rows
    written, their outputs [C, H] returned. features [C, F or H], ids [C]; start and span as `draft_step`'s. A
    prompt's rows but its last few are committed this way alone (eagerly, once), the rest by the first draft step."""
    head = step.head
    device = ids.device
    C = ids.shape[0]
    hidden = features[None].to(head.fc.weight.dtype)  # [1, C, F]
    if head.eagle3 and hidden.shape[-1] != head.config.hidden_size:
        hidden = head.fuse(hidden)  # [1, C, H]
    at = start + torch.arange(C, device=device)  # [C] the rows' positions
    if span is None:
        causal, write = torch.ones(C, start + C, dtype=torch.bool, device=device).tril(start), start  # [C, start + C]
    else:
        causal, write = torch.arange(span, device=device)[None] <= at[:, None], at  # [C, span]
    return head(hidden, ids[None], at[None], additive_mask(causal, hidden.dtype), cache, write)[0]  # [C, H]


def grow_tree(
    step, cache, start, gap: int, committed, last, log_probs, root, shape: TreeShape, span: int | None = None
) -> DeviceTree:
    """EAGLE-2: expand the top_k best nodes per level by cumulative log-probability (a beam of width top_k), then
    keep the nodes - 1 best of all candidates seen.

    The draft cache holds `committed` ([] long) real rows from 0, then rows up to start + gap nobody may see; tree
    entries are written from start + gap. last [1, H], log_probs [1, Vd]: the head at the last committed row.
    span: as `draft_step` (start an int, or a [] tensor and the keys `span` wide).

    Ancestor closure: a child's score is its parent's plus a log-prob <= 0, so it never beats its parent; a stable
    sort breaks ties in favour of the lower pool index, which is the parent's (the pool is level-ordered). So every
    kept node brings its ancestors; were closure broken, a node would hang on the root: wasted, never wrong."""
    head, k, device = step.head, shape.top_k, last.device
    dtype = last.dtype
    scores, ids = log_probs[0].topk(k)  # [k]
    tokens = head.to_target_ids(ids)  # [k]
    pool_scores, pool_tokens = [scores], [tokens]
    pool_parents = [torch.full((k,), -1, device=device)]
    pool_depths = [torch.full((k,), 1, device=device)]
    frontier = torch.arange(k, device=device)  # [k] pool indices of the frontier
    hidden = last.expand(k, -1)  # [k, H] the frontier's parents' outputs
    ancestors = torch.eye(k, dtype=torch.bool, device=device)  # [k, written + k] over tree entries
    tree_at = start + gap  # the first tree entry's position
    seen = torch.arange(tree_at if span is None else span, device=device) < committed  # [keys] the committed rows
    pool_size, written = k, 0
    for level in range(1, shape.levels + 1):
        allowed = with_tree(seen, ancestors, tree_at, span)  # [k, tree_at + written + k] or [k, span]
        positions = (committed + level - 1).expand(1, k)  # [1, k] all nodes of a level share a position
        write = tree_at + written if span is None else tree_at + written + torch.arange(k, device=device)
        out, lp = step(hidden[None], tokens[None], positions, additive_mask(allowed, dtype), cache, write)
        # out [k, H], lp [k, Vd]
        written += k
        child_lp, child_ids = lp.topk(k, dim=-1)  # [k, k]
        cumulative = (child_lp + scores[:, None]).flatten()  # [k * k] path log-probs
        child_tokens = head.to_target_ids(child_ids.flatten())  # [k * k]
        pool_scores.append(cumulative)
        pool_tokens.append(child_tokens)
        pool_parents.append(frontier.repeat_interleave(k))
        pool_depths.append(torch.full((k * k,), level + 1, device=device))
        scores, best = cumulative.topk(k)  # [k]
        rows = best // k
        hidden, tokens, frontier = out[rows], child_tokens[best], pool_size + best
        ancestors = torch.cat([ancestors[rows], torch.eye(k, dtype=torch.bool, device=device)], dim=1)
        pool_size += k * k

    n = shape.nodes - 1
    order = torch.sort(torch.cat(pool_scores), descending=True, stable=True).indices[:n]
    chosen = torch.sort(order).values  # [n] pool indices in pool (= level) order
    node_of_pool = torch.zeros(pool_size, dtype=torch.long, device=device)
    node_of_pool[chosen] = torch.arange(1, n + 1, device=device)
    parent_pool = torch.cat(pool_parents)[chosen]  # [n], -1 for the root's children
    parents = torch.where(parent_pool >= 0, node_of_pool[parent_pool.clamp(min=0)], 0)
    parents = torch.cat([torch.full((1,), -1, device=device), parents])  # [N]
    tokens = torch.cat([root.reshape(1), torch.cat(pool_tokens)[chosen]])  # [N]
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=device), torch.cat(pool_depths)[chosen]])  # [N]
    return DeviceTree(tokens, parents, depth, ancestors_on_device(parents, shape.head_depth))


# -------------------------------------------------------------------------------------------------------------
def verify_step(base, cache, committed, tree: DeviceTree, shape: TreeShape, span: int | None = None) -> Verdict:
    """The base pass over the tree's N nodes after `committed` cached positions, and greedy acceptance.

    base: base.BaseModel (its `decode`, the forward itself); cache: its TreeKVCache at length `committed`, which the
    pass writes the N nodes' rows after; the caller then keeps the path's (`packet`). Nodes from `shape.nodes` on are
    context nodes (`attach_chain`). span: None (committed an int) or the keys' static width (committed a [] long
    tensor; the cache's `write_positions` set to committed.. and its `read_span` to `span`: kv_cache.py)."""
    ids, depth, ancestors = tree.tokens, tree.depth, tree.ancestors
    mask = tree_mask(committed, ancestors, base.dtype, ids.device, span)  # [1, 1, N, committed + N or span]
    inputs = ids.clamp(min=0)[None]  # [1, N] padding nodes read token 0
    logits, features = base.decode(inputs, (committed + depth)[None], mask, cache, True, False)  # [N, V], [N, F]
    draws = logits.argmax(dim=-1)  # [N] the base's token after each node
    path, length = accept_path(tree, draws, shape.max_depth)  # [D + 1], []
    root = draws.index_select(0, path.index_select(0, (length - 1).reshape(1)))[0]  # [] the draw after the path
    accepted = ids.index_select(0, path[1:])  # [D] the path's drafted tokens (pads past L - 1)
    at = torch.arange(shape.commit_rows, device=ids.device)  # [C]
    commit_ids = torch.where(at == length - 1, root, torch.cat([accepted, root.reshape(1)]))  # [C]
    levels = torch.arange(shape.max_depth + 1, device=ids.device)  # [D + 1]
    from_context = ((path >= shape.nodes) & (levels < length)).sum()  # [] accepted context nodes
    packet = torch.cat([length.reshape(1), accepted, root.reshape(1), from_context.reshape(1), path])  # [2D + 4]
    return Verdict(packet, path, features.index_select(0, path), commit_ids, length, root)


def attach_chain(tree: DeviceTree, proposal: torch.Tensor, count: torch.Tensor, chain: int) -> DeviceTree:
    """The tree with a chain of `chain` (M) context nodes added: proposal [P] holds the context's guess of the tokens
    after the root (`count` [] long of them real, the rest padding). The chain hangs under the deepest head node
    whose path spells a prefix of the proposal (the root when none), carries the proposal's next M tokens, and its
    nodes past the proposal's end carry -1 (never accepted). So no head node is drafted twice and the chain's first
    node differs from the head's children there: a context node on the accepted path is a token the head did not
    propose. Returns N + M nodes; parents still precede children."""
    tokens, parents, depth, ancestors = tree
    N, device = tokens.shape[0], tokens.device
    wanted = proposal.index_select(0, (depth - 1).clamp(min=0))  # [N] the proposal's token at each node's depth
    spells = ((wanted == tokens) & (depth <= count)) | (depth == 0)  # [N]
    on_proposal = ~(ancestors & ~spells[None, :]).any(dim=1)  # [N] the node and its ancestors spell the proposal
    attach = torch.where(on_proposal, depth, -1).argmax().reshape(1)  # [1] the deepest such node
    at = depth.index_select(0, attach) + torch.arange(chain, device=device)  # [M] proposal index of each chain node
    chain_tokens = torch.where(at < count, proposal.index_select(0, at), -1)  # [M]
    chain_parents = torch.cat([attach, N + torch.arange(chain - 1, device=device)])  # [M]
    above = ancestors.index_select(0, attach).expand(chain, N)  # [M, N] the attach node and its ancestors
    own = torch.ones(chain, chain, dtype=torch.bool, device=device).tril()  # [M, M] the chain's own prefix
    rows = torch.cat([torch.cat([ancestors, ancestors.new_zeros(N, chain)], dim=1), torch.cat([above, own], dim=1)])
    return DeviceTree(torch.cat([tokens, chain_tokens]), torch.cat([parents, chain_parents]),
                      torch.cat([depth, at + 1]), rows)  # fmt: skip


def accept_path(tree: DeviceTree, draws: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance on the device: a node is accepted when its token is the base's draw at its parent, and it
    is on the path when it and all its ancestors are. Siblings carry distinct tokens (the top-k of one row), so the
    path is one chain: the same nodes as verify.accept's walk. Returns the path's node at each depth [D + 1]
    (root first; 0 past its end) and its length [] (nodes, root included)."""
    tokens, parents, depth, ancestors = tree
    match = (tokens == draws[parents.clamp(min=0)]) | (parents < 0)  # [N] the root always
    on_path = ~(ancestors & ~match[None, :]).any(dim=1)  # [N]
    deepest = torch.where(on_path, depth, -1).argmax().reshape(1)  # [1] the path's last node
    levels = torch.arange(max_depth + 1, device=tokens.device)  # [D + 1]
    at_level = ancestors.index_select(0, deepest) & (depth[None, :] == levels[:, None])  # [D + 1, N]
    path = at_level.to(torch.int32).argmax(dim=1)  # [D + 1]
    return path, depth.index_select(0, deepest)[0] + 1
