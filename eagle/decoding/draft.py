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

from eagle.kernels.few_rows import few_row_kernels
from eagle.models.draft_head import DraftHead
from eagle.models.kv_cache import TreeKVCache, seeded_cache
from eagle.models.masks import additive_mask
from eagle.transfer import to_device

from .round_steps import TreeShape, grow_tree
from .tree import DraftTree, TreeDraft, static_tree_levels


class HeadStep:
    """One draft-head forward over m rows and what each row predicts, as log-probabilities: the step drafting
    repeats (compiled per bucket of rows by compiled_draft.py)."""

    def __init__(self, head: DraftHead, base_lm_head: nn.Module):
        self.head = head
        self.base_lm_head = base_lm_head

    def __call__(self, hidden, input_ids, position_ids, mask, cache, write_at: int):
        """hidden [1, m, H]; ids, positions [1, m]; mask additive [1, 1, m, write_at + m] -> out [m, H] and
        log-probs [m, draft vocab] float32."""
        out = self.head(hidden, input_ids, position_ids, mask, cache, write_at)[0]
        return out, self.log_probs(out)

    def log_probs(self, out: torch.Tensor) -> torch.Tensor:
        # [m, H] -> [m, draft vocab] float32
        return torch.log_softmax(self.head.logits(out, self.base_lm_head).float(), dim=-1)


class Drafter:
    """The draft side of one generation; a context manager: leaving it gives back a leased cache."""

    def __init__(self, head: DraftHead, base_lm_head: nn.Module, capacity: int, compiled=None,
                 kept: TreeKVCache | None = None, rows: int = 0, bound: int | None = None):  # fmt: skip
        """compiled: a runner of this head's steps (runners.draft_graphs), which takes the steps it `takes` and may
        lease its own cache for the generation (CUDA graphs); the others run eagerly. kept: a conversation's head
        cache whose first `rows` committed positions this generation starts from (prefix_cache.py): copied into a
        leased cache, else kept itself where it has the room, else a new one grown towards `bound` positions."""
        self.head = head
        self.step = HeadStep(head, base_lm_head)
        self.compiled = compiled
        self.leased = compiled.lease(capacity) if compiled is not None else None
        slack = max(compiled.buckets) if compiled is not None else 0  # a padded step writes a whole bucket
        if self.leased is not None:
            self.cache = self.leased.start_from(kept, rows)
        else:
            self.cache = seeded_cache(head.new_cache, capacity + slack, kept, rows, bound and bound + slack)
        self.dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device
        self.last: torch.Tensor | None = None  # [1, H] the head's output at the last committed position
        self.last_log_probs: torch.Tensor | None = None  # [1, draft vocab] what it predicts (the root's children)
        self._static: dict[tuple, tuple] = {}  # static-tree choices -> their shape on the device (_static_shape)

    def __enter__(self) -> "Drafter":
        return self

    def __exit__(self, *exc) -> None:
        if self.leased is not None:
            self.compiled.release(self.leased)
            self.leased = None

    def _compiled_fits(self, rows: int, write_at: int) -> bool:
        """Whether the runner takes a step of `rows` rows written at `write_at` in this generation's cache."""
        return self.compiled is not None and self.compiled.takes(self.cache, rows, write_at)

    def _run(self, hidden, ids, positions, mask, write_at: int):
        """`HeadStep` on m rows: compiled where a bucket holds them. hidden [1, m, H] -> ([m, H], [m, Vd])."""
        if self._compiled_fits(ids.shape[1], write_at):
            return self.compiled.run(hidden, ids, positions, mask, self.cache, write_at)
        return self.step(hidden, ids, positions, mask, self.cache, write_at)

    # ---------------------------------------------------------------------------------------------------------
    def commit(self, features: torch.Tensor, next_tokens: list[int]) -> None:
        """Append n committed positions: features [n, F] of base positions P..P+n-1 and the tokens after them."""
        n, start = len(next_tokens), self.cache.length
        ids = to_device([next_tokens], self.device)
        positions = torch.arange(start, start + n, device=self.device)[None]
        causal = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(start)
        mask = additive_mask(causal, self.dtype)
        hidden = features[None].to(device=self.device, dtype=self.dtype)  # [1, n, F]
        if self.head.eagle3 and hidden.shape[-1] != self.head.config.hidden_size:
            with few_row_kernels():  # a compiled float32 head's fc takes the panel kernel (compiled_draft.py)
                hidden = self.head.fuse(hidden)  # [1, n, H]: commits and expansions then share the compiled steps
        if self._compiled_fits(n, start):
            out, log_probs = self.compiled.run(hidden, ids, positions, mask, self.cache, start)
            self.last, self.last_log_probs = out[-1:], log_probs[-1:]
        else:  # a prompt: the head over all its rows, the log-probs of the last only
            self.last = self.head(hidden, ids, positions, mask, self.cache, start)[:, -1]
            self.last_log_probs = self.step.log_probs(self.last)
        self.cache.length = start + n

    def _expand(self, hidden, tokens, ancestors, depth: int, written: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head on m nodes of one tree level.

        hidden [m, H]: the parents' outputs; tokens [m]: target ids; ancestors [m, written + m] bool over the tree
        entries already in the cache plus these nodes. Returns the outputs [m, H] and their log-probs [m, Vd]."""
        m, committed = tokens.shape[0], self.cache.length
        allowed = torch.ones(m, committed + written + m, dtype=torch.bool, device=self.device)
        allowed[:, committed:] = ancestors
        positions = torch.full((1, m), committed + depth - 1, device=self.device)
        return self._run(hidden[None], tokens[None], positions, additive_mask(allowed, self.dtype), committed + written)

    # ---------------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def dynamic_tree(self, root: int, total_token: int, depth: int, top_k: int) -> TreeDraft:
        """EAGLE-2 (round_steps.grow_tree), each level's head step compiled where a bucket holds it. Everything stays
        on the device: the host reads the tree with the verification."""
        committed = torch.tensor(self.cache.length, device=self.device)
        root_id = to_device([root], self.device)[0]
        shape = TreeShape.of(total_token, depth, top_k)
        tree = grow_tree(_BucketStep(self), self.cache, self.cache.length, 0, committed, self.last,
                         self.last_log_probs, root_id, shape)  # fmt: skip
        return TreeDraft(*tree)

    @torch.inference_mode()
    def static_tree(self, root: int, choices: list[list[int]]) -> TreeDraft:
        """EAGLE-1: a fixed tree of top-k ranks (e.g. MC_SIM_7B_63); its shape is read once per choices."""
        parents, depth, ancestors, level_rows, level_ranks, top = self._static_shape(choices)
        log_probs = self.last_log_probs  # [1, Vd] for the root
        hidden = self.last
        tokens = [to_device([root], self.device)]
        written, level_ancestors = 0, torch.zeros(1, 0, dtype=torch.bool, device=self.device)
        for level, (rows, ranks) in enumerate(zip(level_rows, level_ranks), start=1):
            ids = log_probs.topk(top, dim=-1).indices[rows, ranks]  # [m] the ranks asked, under each parent
            tokens.append(self.head.to_target_ids(ids))
            if level == len(level_rows):
                break
            m = rows.shape[0]
            eye = torch.eye(m, dtype=torch.bool, device=self.device)
            level_ancestors = torch.cat([level_ancestors[rows], eye], dim=1)  # [m, written + m]
            hidden, log_probs = self._expand(hidden[rows], tokens[-1], level_ancestors, level, written)
            written += m
        return TreeDraft(torch.cat(tokens), parents, depth, ancestors)

    def _static_shape(self, choices) -> tuple:
        """On the device: parents [n], depth [n], ancestors [n, n], per level the parent rows in the level above and
        the ranks; and the largest rank + 1."""
        key = tuple(map(tuple, choices))
        if key not in self._static:
            levels = static_tree_levels(choices)
            parents, depth, first = [-1], [0], 0  # first: tree index of the level above's first node
            for d, level in enumerate(levels, start=1):
                parents += [first + p for p, _ in level]
                depth += [d] * len(level)
                first = len(parents) - len(level)
            tree = DraftTree([0] * len(parents), parents)
            self._static[key] = (
                to_device(parents, self.device), to_device(depth, self.device),
                tree.ancestor_mask().to(self.device), [to_device([p for p, _ in lv], self.device) for lv in levels],
                [to_device([r for _, r in lv], self.device) for lv in levels], 1 + max(r for c in choices for r in c),
            )  # fmt: skip
        return self._static[key]


class _BucketStep:
    """`HeadStep`'s interface over a Drafter's steps: compiled where a bucket holds the rows (`Drafter._run`)."""

    def __init__(self, drafter: Drafter):
        self.head, self.log_probs, self._run = drafter.head, drafter.step.log_probs, drafter._run

    def __call__(self, hidden, input_ids, position_ids, mask, cache, write_at: int):
        return self._run(hidden, input_ids, position_ids, mask, write_at)
