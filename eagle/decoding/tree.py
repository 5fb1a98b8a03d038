"""Draft trees: the structure verified by one base forward pass.

Node 0 is the root: the last token the base model produced, not yet in its KV cache. Every other node is a
drafted token. Invariants (checked in `DraftTree.__post_init__`):
- parents precede children (`parents[i] < i`), so the ancestor mask is lower-triangular and a path sorted by
  node index is a valid prefix order;
- the ancestor mask is closed: a node sees exactly itself and its ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# EAGLE-1's static tree ("mc_sim_7b_63" in the reference): each entry is a path of top-k ranks from the root;
# 25 drafted nodes plus the root, depth 5.
MC_SIM_7B_63 = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]  # fmt: skip


@dataclass
class DraftTree:
    tokens: list[int]  # [n] node tokens; tokens[0] is the root
    parents: list[int]  # [n] parent node of each node; parents[0] == -1
    depth: list[int] = field(init=False)  # [n] root = 0
    children: list[dict[int, int]] = field(init=False)  # node -> {token: child node}

    def __post_init__(self):
        if len(self.tokens) != len(self.parents) or self.parents[0] != -1:
            raise ValueError("a draft tree needs one parent per node and node 0 as root")
        self.depth = [0] * len(self.tokens)
        self.children = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            p = self.parents[i]
            if not 0 <= p < i:
                raise ValueError(f"tree node {i} has parent {p}: parents must precede children")
            self.depth[i] = self.depth[p] + 1
            # Siblings carry distinct tokens (top-k of one distribution); keep the first if a duplicate slips in.
            self.children[p].setdefault(self.tokens[i], i)

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: mask[i, j] is True iff j is i or an ancestor of i."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[i] for i in path]


@dataclass
class TreeDraft:
    """A drafted tree as the device holds it, before the host has read it: what the verify pass needs (ids,
    positions, mask) without a host sync. `read` brings it to the host in one transfer."""

    tokens: torch.Tensor  # [n] long; tokens[0] is the root
    parents: torch.Tensor  # [n] long; parents[0] == -1, parents[i] < i
    depth: torch.Tensor  # [n] long; root = 0
    ancestors: torch.Tensor  # [n, n] bool: row i = i and its ancestors

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def read(self, *extra: torch.Tensor) -> tuple[DraftTree, list[list[int]]]:
        """(the host tree, each of `extra` [n] as a list), in one device-to-host transfer."""
        n = len(self)
        values = torch.cat([self.tokens, self.parents, *(e.to(self.tokens.dtype) for e in extra)]).tolist()
        rows = [values[i : i + n] for i in range(0, len(values), n)]
        return DraftTree(rows[0], rows[1]), rows[2:]


def ancestors_on_device(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[n] parents (root -1) -> [n, n] bool ancestor mask, with max_depth gathers and no host sync."""
    n = parents.shape[0]
    rows = torch.arange(n, device=parents.device)
    mask = rows[:, None] == rows[None, :]  # [n, n] self
    up = parents  # [n] the ancestor `step` levels up, -1 past the root
    for _ in range(max_depth):
        seen = up >= 0  # [n]
        mask[rows, up.clamp(min=0)] |= seen
        up = torch.where(seen, parents[up.clamp(min=0)], up)
    return mask


def static_tree_levels(choices: list[list[int]]) -> list[list[tuple[int, int]]]:
    """Group static-tree choices by depth: per level, a list of (parent index in the previous level, rank).

    The root's children are level 1 with parent 0. Nodes are ordered by (depth, path), as the reference sorts them.
    """
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    for p in paths:
        if len(p) > 1 and p[:-1] not in paths:
            raise ValueError(f"tree choice {list(p)} has no parent {list(p[:-1])} in the choices")
    levels: list[list[tuple[int, int]]] = []
    index_in_level: dict[tuple, int] = {(): 0}
    for p in paths:
        d = len(p)
        while len(levels) < d:
            levels.append([])
        index_in_level[p] = len(levels[d - 1])
        levels[d - 1].append((index_in_level[p[:-1]], p[-1]))
    return levels
