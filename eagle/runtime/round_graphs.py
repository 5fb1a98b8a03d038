"""Runners of a greedy EAGLE-2 round's two steps (round_steps.py), one interface:

    runner.draft(cache, start, features, ids, n, root, rows) -> DeviceTree   (rows: the commit's real rows, a host
                                                                 count; None = unknown)
    runner.verify(cache, committed, tree, chain) -> Verdict   (chain: a context draft added first, or None)
    runner.keep(cache, committed, path, verdict)                (the accepted path's KV rows kept, the rest dropped)
    runner.prefill(cache, features, ids, start)  (a prompt's rows before the first draft step's, into the head's cache
                                                  at draft positions start..: past the rows a conversation kept)
    with runner.leased_draft_cache(capacity, kept, rows, bound) as draft_cache: ...  (the head's cache for one
                                                  generation, holding kept's first rows: prefix_cache.py)

`EagerRound` calls the step functions; `CompiledRound` (CPU) runs each as one inductor graph per tree shape, with the
machinery of the base's graphs (compiled.py: weights frozen, the panel kernel for float32 linears, the context
length symbolic), and calls the step functions eagerly where a graph does not apply: a prompt shorter than a commit
(its rows are not the shape's; a longer one's first rows are the head's `prefill`) and contexts of 0 or 1 rows
(dynamo would specialise those ints into graphs of their own). On CUDA, cuda_round.py's `CudaRound` captures the same
steps as CUDA graphs.
"""

from __future__ import annotations

import contextlib
import time

import torch

from eagle.decoding.context_draft import ChainDraft
from eagle.decoding.draft import HeadStep
from eagle.decoding.round_steps import (
    DeviceTree,
    TreeShape,
    Verdict,
    attach_chain,
    commit_step,
    draft_step,
    verify_step,
)
from eagle.kernels.few_rows import few_row_kernels
from eagle.models.kv_cache import seeded_cache
from eagle.timing import repeated_seconds

from .compiled import BucketGraphs, static_rows


class EagerRound:
    """The step functions called as they are."""

    def __init__(self, base, step: HeadStep, shape: TreeShape):
        self.base, self.step, self.shape = base, step, shape

    def draft(self, cache, start: int, features, ids, n, root, rows: int | None = None) -> DeviceTree:
        features, ids = self.commit_of(features, ids, rows)
        with few_row_kernels():  # float32 CPU linears: the plan's kernel per row count (few_rows.py)
            return draft_step(self.step, cache, start, features, ids, n, root, self.shape)

    def prefill(self, cache, features, ids, start: int = 0) -> None:
        """The head over a prompt's first rows (features [m, F], ids [m]) at draft positions start..start+m-1 (start:
        the rows a conversation kept, already in the cache), eagerly: the prompt's last rows and its first tree are
        then the first round's draft step, in its graph where it has one. The caller sets `cache.length = start + m`."""
        with few_row_kernels():
            commit_step(self.step, cache, start, features, ids)

    def commit_of(self, features, ids, rows: int | None):
        """The commit a draft step takes: with context chains in the shape, the rows of a path of the head's own
        depth where the `rows` real ones fit in them (most rounds: no copy was accepted), so that the head does not
        run over a chain's worth of padding; else all C rows."""
        short = self.shape.head_commit_rows
        if rows is not None and rows <= short < ids.shape[0]:
            return features[:short], ids[:short]  # [C', F], [C']
        return features, ids

    def verify(self, cache, committed: int, tree: DeviceTree, chain=None) -> Verdict:
        """The verify step (on the tree with `chain` attached: a context_draft.ChainDraft or None); the cache holds
        the whole tree's rows after it."""
        if chain is not None:
            tree = attach_chain(tree, chain.proposal, chain.count, chain.nodes)
        with few_row_kernels():
            return verify_step(self.base, cache, committed, tree, self.shape)

    def keep(self, cache, committed: int, path: list[int], verdict: Verdict) -> None:
        """Keep the accepted path's KV rows (path: its nodes, root first) at positions committed.. of the base's
        cache and drop the rest of the tree's: no row copied where the path is in place already."""
        cache.compact([committed + i for i in path], committed)

    @contextlib.contextmanager
    def leased_draft_cache(self, capacity: int, kept=None, rows: int = 0, bound: int | None = None):
        """The head's cache for one generation of `capacity` positions, holding `kept`'s first `rows` (a
        conversation's: kept itself where it has the room, else a new cache grown towards `bound`)."""
        yield seeded_cache(self.step.head.new_cache, capacity, kept, rows, bound)


class CompiledRound(EagerRound):
    """The draft step and the verify step, each one graph for this tree shape (compiled on first use or `warm`), and
    with context chains in the shape, a verify graph for trees that carry one, per chain size (`verify_chain`)."""

    steps_text = "two compiled steps (draft, verify)"  # the Model panel's words

    def __init__(self, base, step: HeadStep, shape: TreeShape):
        super().__init__(base, step, shape)

        def verify(cache, committed, tokens, parents, depth, ancestors):
            return verify_step(base, cache, committed, DeviceTree(tokens, parents, depth, ancestors), shape)

        def verify_chain(chain: int):  # the step with a chain of `chain` nodes (a size in the closure: not symbolic)
            def step(cache, committed, tokens, parents, depth, ancestors, proposal, count):
                tree = attach_chain(DeviceTree(tokens, parents, depth, ancestors), proposal, count, chain)
                return verify_step(base, cache, committed, tree, shape)

            return step

        self.draft_graph = _draft_graph(step, shape)
        # with chains: the draft step over a commit of the head's depth (commit_of), the plain shape's graph
        self.short_draft_graph = _draft_graph(step, shape.without_chains) if shape.chain else None
        # commit rows -> the draft graph of that commit (without chains the two sizes are one: the shape's own graph)
        self.draft_graphs = {shape.head_commit_rows: self.short_draft_graph, shape.commit_rows: self.draft_graph}
        self.verify_graph = BucketGraphs(verify, (shape.nodes,), (base.model,), "compiled verify steps")
        self.verify_chain_graphs = {  # chain nodes M -> the verify step's graph over the N + M rows
            m: BucketGraphs(verify_chain(m), (shape.nodes + m,), (base.model,),
                            f"compiled verify steps with a context chain of {m}")  # fmt: skip
            for m in shape.chain_sizes
        }

    def draft(self, cache, start: int, features, ids, n, root, rows: int | None = None) -> DeviceTree:
        features, ids = self.commit_of(features, ids, rows)
        graph = self.draft_graphs.get(ids.shape[0])
        if start < 2 or graph is None:  # a short prompt's commit (its own rows), or a cache of 0 or 1 rows
            return super().draft(cache, start, features, ids, n, root)
        static_rows((features, 0), (features, 1), (ids, 0))
        return DeviceTree(*graph.call(self.shape.nodes, (cache, start, features, ids, n, root)))

    def verify(self, cache, committed: int, tree: DeviceTree, chain=None) -> Verdict:
        if committed < 2:
            return super().verify(cache, committed, tree, chain)
        static_rows((tree.tokens, 0), (tree.parents, 0), (tree.depth, 0), (tree.ancestors, 0), (tree.ancestors, 1))
        undo = lambda: cache.crop_to(committed)  # noqa: E731
        if chain is None:
            out = self.verify_graph.call(self.shape.nodes, (cache, committed, *tree), undo=undo)
        else:
            static_rows((chain.proposal, 0))
            graphs, rows = self.verify_chain_graphs[chain.nodes], self.shape.nodes + chain.nodes
            out = graphs.call(rows, (cache, committed, *tree, chain.proposal, chain.count), undo=undo)
        return Verdict(*out)

    def warm(self, log=None, context: int = 64, steps=None) -> dict[str, float]:
        """Compile the graphs of `steps` now (a step left out runs eagerly): a round over dummy tokens after
        `context` cached positions. steps: of "draft", "verify", "verify_chain" (default: all the shape has).
        Returns seconds per step."""
        steps = steps or ("draft", "verify", "verify_chain")[: 3 if self.shape.chain else 2]
        shape = self.shape
        seconds = {}
        with torch.inference_mode():  # the caches too: tensors made outside it have other dispatch keys (a guard)
            cache, draft_cache, features, commit = self._dummy_round(context)
            draft = self.draft if "draft" in steps else super().draft
            t0 = time.perf_counter()
            if self.short_draft_graph is not None and "draft" in steps:  # a commit that fits the short one
                draft(draft_cache, context, features, commit, torch.tensor(2), torch.tensor(0), rows=2)
            tree = draft(draft_cache, context, features, commit, torch.tensor(2), torch.tensor(0))
            seconds["draft"] = time.perf_counter() - t0
            if "verify" in steps:
                t0 = time.perf_counter()
                self.verify(cache, context, tree)
                seconds["verify"] = time.perf_counter() - t0
            if "verify_chain" in steps:  # every chain size
                t0 = time.perf_counter()
                for m in shape.chain_sizes:
                    cache.crop_to(context)
                    self.verify(cache, context, tree, ChainDraft(torch.zeros(shape.proposal, dtype=torch.long),
                                                                 torch.tensor(2), m))  # fmt: skip
                seconds["verify_chain"] = time.perf_counter() - t0
        if log:
            log(f"compiled the round's {', '.join(steps)} step{'s' if len(steps) > 1 else ''} in "
                + " + ".join(f"{seconds[s]:.1f}" for s in steps) + f" s (a tree of {shape.nodes} nodes, "
                f"{shape.levels} draft levels of width {shape.top_k})")  # fmt: skip
        return seconds

    def draft_seconds(self, context: int = 256, repeats: int = 7) -> float:
        """Median seconds of the draft step (its graph, compiled now if it is not) after `context` positions."""
        with torch.inference_mode():
            _, draft_cache, features, commit = self._dummy_round(context, base_cache=False)
            n, root = torch.tensor(2), torch.tensor(0)

            def forget() -> None:  # back to the committed context
                draft_cache.length = context

            step = lambda: self.draft(draft_cache, context, features, commit, n, root)  # noqa: E731
            return repeated_seconds(features.device, step, repeats, after=forget)[repeats // 2]

    def _dummy_round(self, context: int, base_cache: bool = True) -> tuple:
        """(base cache after `context` dummy positions or None, the head's cache at `context` positions, features
        [C, F] and ids [C] of a commit) for warming up and timing."""
        base, head, shape = self.base, self.step.head, self.shape
        cache = None
        if base_cache:
            cache = base.new_cache(context + shape.nodes + shape.chain + shape.commit_rows)
            ids = torch.zeros(1, context, dtype=torch.long)
            # eager, with features: transformers installs its hidden-state hooks on first use (a graph break if that
            # happened inside the graph)
            base.forward(ids, torch.arange(context)[None], cache, features=True, last_logits_only=True)
        draft_cache = head.new_cache(context + shape.commit_rows + shape.draft_entries + 1)
        draft_cache.length = context
        features = torch.zeros(shape.commit_rows, base.feature_width, dtype=base.dtype)
        return cache, draft_cache, features, torch.zeros(shape.commit_rows, dtype=torch.long)


def _draft_graph(step: HeadStep, shape: TreeShape) -> BucketGraphs:
    """The draft step of `shape` as one graph (a commit of shape.commit_rows rows): one function for every round
    of the shape, so that a round with chains and one without share the file of the plain shape's graph."""

    def draft(cache, start, features, ids, n, root):
        return draft_step(step, cache, start, features, ids, n, root, shape)

    return BucketGraphs(draft, (shape.nodes,), (step.head, step.base_lm_head), "compiled draft steps")
