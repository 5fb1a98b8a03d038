"""How a loaded model's passes run: one frozen object, built with the model (`RuntimeConfig.of`), read by runners.py
(the one place that builds runners) and by the model; the algorithm never sees it (a cost choice reaches it as an
argument: `TokenPicker(batched=...)`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import compiled, compiled_draft, cuda_graphs

COMPILE_MODES = ("off", "auto", "on", "inductor")


def check_compile(mode: str) -> str:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(map(repr, COMPILE_MODES))}, got {mode!r}")
    return mode


@dataclass(frozen=True)
class RuntimeConfig:
    """device: the type of the device the base's lm_head lives on ("cuda": compiled passes as CUDA graphs, any other:
    inductor's CPU graphs). compile: "off", "auto" (compiled where it measured faster here), "on", or "inductor" (CUDA:
    graphs of inductor's fused kernels; "on" on a CPU). base_buckets / draft_buckets: the row counts of the base's
    and the head's graphs (the backend's defaults unless given). batched_draws: sampling draws one token for every
    tree node at once, without a host sync (the default on a GPU), rather than one per node the walk visits (on a
    CPU: a top-p sort over every row costs more there than the few nodes a walk visits)."""

    device: str = "cpu"
    compile: str = "off"
    base_buckets: tuple[int, ...] = ()
    draft_buckets: tuple[int, ...] = ()
    batched_draws: bool | None = None

    def __post_init__(self):
        check_compile(self.compile)
        cuda = self.device == "cuda"
        if not self.base_buckets:
            object.__setattr__(self, "base_buckets", cuda_graphs.BUCKETS if cuda else compiled.BUCKETS)
        if not self.draft_buckets:
            drafts = cuda_graphs.DRAFT_BUCKETS if cuda else compiled_draft.DRAFT_BUCKETS
            object.__setattr__(self, "draft_buckets", drafts)
        if self.batched_draws is None:
            object.__setattr__(self, "batched_draws", cuda)

    @classmethod
    def of(cls, base_model: torch.nn.Module, compile: str = "off") -> RuntimeConfig:
        """The config of a model whose output embeddings (the lm_head) sit on `base_model`'s device."""
        return cls(base_model.get_output_embeddings().weight.device.type, compile)

    def with_buckets(self, base: tuple[int, ...] = (), draft: tuple[int, ...] = ()) -> RuntimeConfig:
        """The same config with graphs of these rows only (a subset compiled first, as the app does)."""
        return replace(self, base_buckets=tuple(base) or self.base_buckets,
                       draft_buckets=tuple(draft) or self.draft_buckets)  # fmt: skip

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def backend(self) -> str:
        """The compiled passes' backend, by the name runners give as their `kind`."""
        return cuda_graphs.GraphedRunner.kind if self.cuda else compiled.BucketRunner.kind

    @property
    def inductor_kernels(self) -> bool:
        """CUDA graphs of inductor's fused kernels (the vanilla step's and the round's), compiled first."""
        return self.cuda and self.compile == "inductor"
