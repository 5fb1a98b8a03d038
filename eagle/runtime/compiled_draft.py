"""The draft head's step compiled: a head forward over m rows plus the log-probabilities of what each row predicts
(`draft.HeadStep`), one inductor graph per bucket of rows, with the machinery of the base's graphs (compiled.py:
weights frozen, the panel kernel for a float32 head's linears and inductor's C++ GEMMs for a bfloat16 one, rows
static and the context symbolic).

Buckets 1, 2, 4, 8 cover what a dynamic tree drafts: its width (top_k) per level and the 1 to depth + 1 tokens a
round commits. EAGLE-3 commits fuse the base features eagerly first (`DraftHead.fuse`, one matmul), so commits and
expansions share the graphs. A step with fewer rows than its bucket is padded like the base's (pads see the prefix
and themselves, no real row sees a pad; their outputs are dropped and their cache rows, written after the real ones,
are overwritten before anything reads them). More rows than the largest bucket (a prompt's commit) run eagerly.
"""

from __future__ import annotations

import torch

from eagle.kernels import few_rows
from eagle.models.masks import additive_mask

from .compiled import BucketGraphs, BucketRunner, fresh, pad_rows, static_rows, timed_buckets

DRAFT_BUCKETS = (1, 2, 4, 8)


class CompiledDraft(BucketRunner):
    """`HeadStep` compiled per bucket; `run` pads, calls the graph and drops the pads."""

    def __init__(self, step, buckets=DRAFT_BUCKETS):
        self.step = step
        # a float32 head's linears call the panel kernel in the graphs where it runs here (as the base's do, see
        # BaseModel.compile); outside `few_row_kernels()` eager drafting with the same head is plain nn.Linear
        if "panel" in few_rows.usable_kernels():
            few_rows.install(step.head, few_rows.uniform_plan("panel"))
        def head_step(hidden, input_ids, position_ids, mask, cache, write_at):
            return step(hidden, input_ids, position_ids, mask, cache, write_at)

        self.graphs = BucketGraphs(head_step, buckets, (step.head, step.base_lm_head), "compiled draft steps")
        self.buckets = self.graphs.buckets

    def run(
        self,
        hidden: torch.Tensor,  # [1, q, H] the head's width (EAGLE-3 features fused already)
        input_ids: torch.Tensor,  # [1, q]
        position_ids: torch.Tensor,  # [1, q]
        mask: torch.Tensor,  # additive [1, 1, q, write_at + q]
        cache,
        write_at: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # out [q, H], log-probs [q, draft vocab] float32
        q = input_ids.shape[1]
        rows = self.bucket(q)
        ids, positions, mask = pad_rows(input_ids, position_ids, mask, rows)
        hidden = torch.cat([hidden, hidden[:, -1:].expand(1, rows - q, -1)], dim=1)  # [1, rows, H]
        hidden, ids, positions, mask = map(fresh, (hidden, ids, positions, mask))
        static_rows((hidden, 1), (hidden, 2), (ids, 1), (positions, 1), (mask, 2))
        out, log_probs = self.graphs.call(rows, (hidden, ids, positions, mask, cache, write_at))
        return out[:q], log_probs[:q]

    def warm(self, log=None, context: int = 64, rows: list[int] | None = None) -> dict[int, float]:
        """Compile every bucket (or those in `rows`) now, a step over dummy rows after `context` cached ones; returns
        seconds per bucket."""
        head = self.step.head
        dtype, H = head.fc.weight.dtype, head.config.hidden_size
        buckets = self.buckets if rows is None else rows
        with torch.inference_mode():  # the cache too: a tensor made outside it has other dispatch keys (a guard)
            cache = head.new_cache(context + 2 * max(self.buckets))

            def passes(rows: int) -> None:
                allowed = torch.ones(rows, context + rows, dtype=torch.bool).tril(context)
                self.run(torch.zeros(1, rows, H, dtype=dtype), torch.zeros(1, rows, dtype=torch.long),
                         torch.arange(context, context + rows)[None], additive_mask(allowed, dtype), cache, context)  # fmt: skip

            return timed_buckets(buckets, passes, log, lambda n, s: (
                f"compiled the {n}-row draft step ({head.dtype_name}) in {s:.1f} s "
                f"(linears: {self.graphs.linears(n)})"))  # fmt: skip
