"""Drafting: feed committed tokens to the draft head and grow a tree of candidate continuations.

Draft positions: position t holds (base feature f_t, token x_{t+1}). With P tokens committed to the base cache
(positions 0..P-1) and the root x_P pending, the draft cache holds P committed positions and its last output
predicts the root's children. A node at tree depth d is expanded at draft position P + d - 1, attending to all
committed positions plus its own ancestors; tree entries live after the committed ones and are overwritten by
the next round, so the draft cache only ever keeps committed positions.
"""

from __future__ import annotations

import torch
from torch import nn

from .base import additive_mask
from .draft_head import DraftHead
from .tree import DraftTree, static_tree_levels


class Drafter:
    def __init__(self, head: DraftHead, base_lm_head: nn.Module, capacity: int):
        self.head = head
        self.base_lm_head = base_lm_head
        self.cache = head.new_cache(capacity)
        self.dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device
        self.last: torch.Tensor | None = None  # [1, H] the head's output at the last committed position

    # ---------------------------------------------------------------------------------------------------------
    def commit(self, features: torch.Tensor, next_tokens: list[int]) -> None:
        """Append n committed positions: features [n, F] of base positions P..P+n-1 and the tokens after them."""
        n, start = len(next_tokens), self.cache.length
        ids = torch.tensor([next_tokens], device=self.device)
        positions = torch.arange(start, start + n, device=self.device)[None]
        causal = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)
        out = self.head(features[None].to(self.device), ids, positions, additive_mask(causal, self.dtype), self.cache, start)
        self.cache.length = start + n
        self.last = out[:, -1]

    def _log_probs(self, out: torch.Tensor) -> torch.Tensor:
        # [m, H] -> [m, draft vocab] fp32
        return torch.log_softmax(self.head.logits(out, self.base_lm_head).float(), dim=-1)

    def _expand(self, hidden, tokens, ancestors, depth: int, written: int) -> torch.Tensor:
        """Run the head on m nodes of one tree level.

        hidden [m, H]: the parents' outputs; tokens [m]: target ids; ancestors [m, written + m] bool over the tree
        entries already in the cache plus these nodes. Returns [m, H]."""
        m, committed = tokens.shape[0], self.cache.length
        allowed = torch.ones(m, committed + written + m, dtype=torch.bool, device=self.device)
        allowed[:, committed:] = ancestors
        positions = torch.full((1, m), committed + depth - 1, device=self.device)
        out = self.head(
            hidden[None], tokens[None], positions, additive_mask(allowed, self.dtype), self.cache, committed + written
        )
        return out[0]

    # ---------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def dynamic_tree(self, root: int, total_token: int, depth: int, top_k: int) -> DraftTree:
        """EAGLE-2: expand the top_k best nodes per level by cumulative log-probability (a beam of width top_k,
        depth + 1 levels), then keep the total_token - 1 best nodes of all candidates seen.

        Ancestor closure: a child's score is its parent's plus a log-prob <= 0, so it never beats its parent; a
        stable sort breaks ties in favour of the lower pool index, which is the parent's (pool is level-ordered).
        So a kept node at depth d brings its d - 1 ancestors: levels deeper than total_token - 1 are never kept
        and are not drafted."""
        k = top_k
        depth = min(depth, total_token - 2)  # expansion `level` drafts nodes of depth level + 1
        log_probs = self._log_probs(self.last)[0]  # [Vd]
        scores, ids = log_probs.topk(k)  # [k]
        tokens = self.head.to_target_ids(ids)
        pool_scores, pool_tokens = [scores], [tokens]
        pool_parents = [torch.full((k,), -1, device=self.device)]
        frontier = torch.arange(k, device=self.device)  # pool indices of the frontier nodes
        hidden = self.last.expand(k, -1)
        ancestors = torch.eye(k, dtype=torch.bool, device=self.device)
        pool_size, written = k, 0
        for level in range(1, depth + 1):
            out = self._expand(hidden, tokens, ancestors, level, written)  # [k, H]
            written += k
            child_lp, child_ids = self._log_probs(out).topk(k, dim=-1)  # [k, k]
            cumulative = (child_lp + scores[:, None]).flatten()  # [k * k] path log-probs
            child_tokens = self.head.to_target_ids(child_ids.flatten())
            pool_scores.append(cumulative)
            pool_tokens.append(child_tokens)
            pool_parents.append(frontier.repeat_interleave(k))
            scores, best = cumulative.topk(k)
            rows = best // k
            hidden, tokens, frontier = out[rows], child_tokens[best], pool_size + best
            ancestors = torch.cat([ancestors[rows], torch.eye(k, dtype=torch.bool, device=self.device)], dim=1)
            pool_size += k * k

        all_scores = torch.cat(pool_scores)
        n = min(total_token - 1, all_scores.numel())
        order = torch.sort(all_scores, descending=True, stable=True).indices[:n]
        chosen = torch.sort(order).values
        node_tokens = torch.cat(pool_tokens)[chosen].tolist()
        parent_pool = torch.cat(pool_parents)[chosen].tolist()
        position = {p: i + 1 for i, p in enumerate(chosen.tolist())}
        parents = [position[p] if p >= 0 else 0 for p in parent_pool]  # KeyError here = closure broken
        return DraftTree([root] + node_tokens, [-1] + parents)

    @torch.inference_mode()
    def static_tree(self, root: int, choices: list[list[int]]) -> DraftTree:
        """EAGLE-1: a fixed tree of top-k ranks (e.g. MC_SIM_7B_63)."""
        levels = static_tree_levels(choices)
        top = max(rank for level in levels for _, rank in level) + 1
        tokens_out, parents_out = [root], [-1]
        log_probs = self._log_probs(self.last)  # [1, Vd] for the root
        hidden = self.last
        level_positions = [0]  # tree indices of the previous level's nodes (the root)
        written, ancestors = 0, torch.zeros(1, 0, dtype=torch.bool, device=self.device)
        for depth, level in enumerate(levels, start=1):
            parent_rows = torch.tensor([p for p, _ in level], device=self.device)
            ranks = torch.tensor([r for _, r in level], device=self.device)
            ids = log_probs.topk(top, dim=-1).indices[parent_rows, ranks]
            tokens = self.head.to_target_ids(ids)
            m = len(level)
            parents_out += [level_positions[p] for p, _ in level]
            first = len(tokens_out)
            tokens_out += tokens.tolist()
            level_positions = list(range(first, first + m))
            if depth == len(levels):
                break
            eye = torch.eye(m, dtype=torch.bool, device=self.device)
            ancestors = torch.cat([ancestors[parent_rows], eye], dim=1)  # [m, written + m]
            hidden = self._expand(hidden[parent_rows], tokens, ancestors, depth, written)
            written += m
            log_probs = self._log_probs(hidden)
        return DraftTree(tokens_out, parents_out)
