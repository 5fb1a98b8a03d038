"""The one place that picks how compiled passes run, from the model's `RuntimeConfig` (config.py): inductor graphs
on a CPU (compiled.py, compiled_draft.py, round_graphs.py), CUDA graphs on CUDA (cuda_graphs.py, cuda_round.py).
Each builder returns a runner that its caller puts in use (`BaseModel.compiled`, `EaModel.compiled_draft`,
`EaModel.compiled_rounds`); the algorithm (generate.py, draft.py, round_steps.py) never imports this module.

A runner of passes or of the head's steps, whatever its backend, answers the same calls:
- `takes(cache, rows, at)`: whether it runs a pass of `rows` rows written at position `at` of `cache` (else the
  caller runs it eagerly);
- `run(...)`: that pass, as the eager function would (`BaseModel.decode`, `draft.HeadStep`);
- `lease(capacity)` / `release(cache)`: a cache of its own for one generation, or None (then the caller makes one,
  with `max(buckets)` rows of room past `capacity`: a padded pass writes a whole bucket);
- `buckets`: the row counts it holds graphs for; `kind`: its backend, by name ("inductor", "CUDA graphs").
A round's runner (round_graphs.EagerRound and its subclasses) answers `draft`, `verify` and `keep`.
"""

from __future__ import annotations

import torch

from eagle.decoding.round_steps import TreeShape
from eagle.kernels import few_rows

from . import compiled, compiled_draft, cuda_graphs
from .config import RuntimeConfig
from .cuda_round import CudaRound
from .round_graphs import CompiledRound


def device_settings(config: RuntimeConfig) -> None:
    """Process-wide settings for the device a model runs on, applied when a model is built there (idempotent).
    CUDA: scaled_dot_product_attention without cuDNN's kernel. For a call with an explicit mask (every tree pass,
    the prefill, the head's levels) torch sends it to cuDNN first on Hopper and later GPUs, and cuDNN builds an
    execution plan for every new shape before its first call: each new prompt length, and each key length the
    eager parts of a round meet, then waits for a plan (docs/history/2026-11-27-session-50-h100-real-weights.md).
    The memory-efficient kernel takes the same masks and needs no plan."""
    if config.cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)


def decode_graphs(base, config: RuntimeConfig):
    """Graphs of the base's vanilla step and verify passes over `config.base_buckets` rows, built lazily or now with
    their `warm()`; `forward` runs them once set as `base.compiled` (between generations: a cache is sized for the
    graphs in use when it is made). `config.inductor_kernels` (CUDA): the vanilla step's graphs and the round's of
    inductor's fused kernels, compiled first (a minute or so a graph; the CPU's graphs are inductor's always)."""
    if config.cuda:
        return cuda_graphs.GraphedDecode(base, config.base_buckets, inductor=config.inductor_kernels)
    # The graphs' linears: the panel kernel where it runs here (an operator inductor calls as is, on panels made
    # once), else plain nn.Linear layers, for inductor's own GEMMs: dynamo lifts a custom module's weights as graph
    # inputs, which inductor cannot freeze. Swapping a layer's plan or class under a running eager forward is
    # harmless: every kernel computes the same product. `base.decompile()` puts the eager plan back.
    if base.eager_plan is None:
        base.eager_plan = few_rows.plan_of(base.model)
    panels = few_rows.uniform_plan("panel")
    if base.eager_plan is None or few_rows.set_plan(base.model, panels) != panels:
        few_rows.uninstall(base.model)
    return compiled.CompiledDecode(base, config.base_buckets)


def draft_graphs(step, config: RuntimeConfig):
    """Graphs of the draft head's steps (`draft.HeadStep`) over `config.draft_buckets` rows; the head's dtype and
    weights are frozen into them."""
    if config.cuda:
        return cuda_graphs.GraphedDraft(step, config.draft_buckets)
    return compiled_draft.CompiledDraft(step, config.draft_buckets)


def graphed_on_cuda(base) -> bool:
    """Whether the base's forwards in use are CUDA graphs (the round's graphs are then cuda_round.py's)."""
    return getattr(base.compiled, "kind", None) == cuda_graphs.GraphedDecode.kind


def round_graphs(base, step, shape: TreeShape) -> CompiledRound | CudaRound:
    """A greedy round's draft and verify steps, one graph each for `shape` (CPU: inductor), or where the base's
    forwards are CUDA graphs, CUDA graphs of them per span of keys and one of the keep, over those graphs' static
    cache and captured as they are (`decode_graphs` first)."""
    if graphed_on_cuda(base):
        return CudaRound(base, step, shape, capture=base.compiled.steps.capture)
    return CompiledRound(base, step, shape)
