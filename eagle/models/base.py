"""The base model, run through transformers' own model classes with a tree mask, explicit positions and our cache.

Features handed to the draft head:
- EAGLE-1/2: the post-final-norm last hidden state [.., H] (what transformers returns as `last_hidden_state`);
- EAGLE-3: hidden_states[2], [L // 2], [L - 3] concatenated [.., 3H] (the inputs of those decoder layers), or the
  layers the head names (`DraftConfig.base_feature_layers`).

Logits are the lm_head's followed by the base's own processing (soft-capping, scaling: eagle/models/logits.py), as
its `*ForCausalLM.forward` computes them; a base whose forward does something else is refused at construction.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from eagle.kernels import few_rows, shared_kv_sdpa
from eagle.timing import seconds_in_turns

from .kv_cache import TreeKVCache, seeded_cache
from .logits import logit_transform
from .masks import additive_mask


def eagle3_feature_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


class BaseModel:
    """Thin runner around a `*ForCausalLM`: one forward, logits only for the rows asked, features when needed.

    Invariant: the logits it returns are those of the model's own forward for the same hidden states (checked
    at construction by `check_logits`)."""

    def __init__(self, model: nn.Module, eagle3: bool, feature_layers: tuple[int, ...] | None = None,
                 few_row_plan: dict[int, str] | bool | None = None):  # fmt: skip
        """feature_layers: the hidden_states an EAGLE-3 head fuses (None = the reference's three). few_row_plan:
        the kernels of float32 CPU layers (few_rows.py; None = its DEFAULT_PLAN, False = plain nn.Linear)."""
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        cfg = model.config.get_text_config()
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.vocab_size = self.lm_head.weight.shape[0]
        self.feature_layers = (feature_layers or eagle3_feature_layers(self.num_layers)) if eagle3 else None
        # F: the width of the features a verify pass hands the head (EAGLE-3: its taps side by side)
        self.feature_width = self.hidden_size * (len(self.feature_layers) if self.feature_layers else 1)
        self.dtype = self.lm_head.weight.dtype
        self.input_device = model.get_input_embeddings().weight.device
        self.logit_transform = logit_transform(model.config)  # None = the lm_head's logits are the model's
        if self.input_device.type == "cpu":  # SDPA sharing each key/value head among its query heads, not copying it
            shared_kv_sdpa.install(model)
        if few_row_plan is not False:  # float32 CPU layers: faster decode-sized matmuls (see few_rows.py)
            few_rows.install(model, few_row_plan or None)
        self.compiled = None  # the forwards' graphs in use (runners.decode_graphs builds them)
        self.eager_plan = None  # the few-row plan set aside while compiled
        self.check_logits()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [..., H] (post final norm) -> the base's logits [..., V]: lm_head, then its processing."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.device))
        return logits if self.logit_transform is None else self.logit_transform(logits)

    @torch.no_grad()
    def check_logits(self, tokens: int = 8) -> None:
        """Refuse a base whose forward turns hidden states into logits otherwise than `logits` does.

        One forward of the model over `tokens` fixed ids, no cache; the decoder's output is captured on its way, so both
        sides see the very same hidden states and differ only by what follows the decoder. Tolerance, relative to
        the largest logit: 1e-3 in float32, 2e-2 in 16-bit dtypes (room for rounding, as minicpm3's division of
        the hidden state before the lm_head; a scale or a cap that matters is far beyond it)."""
        captured = []
        hook = self.decoder.register_forward_hook(lambda module, args, out: captured.append(out[0]))
        step = max(1, self.vocab_size // (2 * tokens))  # the first half: multimodal placeholders sit at the end
        ids = (torch.arange(tokens) * step % self.vocab_size)[None].to(self.input_device)  # [1, tokens]
        try:
            own = self.model(input_ids=ids, use_cache=False).logits  # [1, tokens, V']
        finally:
            hook.remove()
        if not captured:
            found = "its forward never ran get_decoder()"
        else:
            ours = self.logits(captured[0])  # [1, tokens, V]
            if ours.shape != own.shape:
                found = f"its logits have shape {list(own.shape)}, lm_head's {list(ours.shape)}"
            else:
                error = float((ours.float() - own.float().to(ours.device)).abs().max() / own.float().abs().max())
                if error <= (1e-3 if self.dtype == torch.float32 else 2e-2):
                    return
                found = f"they differ by {error:.1%} of the largest logit"
        raise ValueError(
            f"{type(self.model).__name__} (model_type {self.model.config.model_type!r}) is not supported: its "
            f"forward processes the lm_head's logits in a way this engine does not apply ({found}), so EAGLE "
            "decoding would not follow its distribution. If the processing is an elementwise function of the "
            "config, add the model type to TRANSFORMS in eagle/models/logits.py."
        )

    @property
    def cache_slack(self) -> int:
        """Positions a cache needs past a generation's own: a padded pass of the graphs in use writes a whole bucket."""
        return max(self.compiled.buckets) if self.compiled is not None else 0

    def new_cache(self, capacity: int) -> TreeKVCache:
        return TreeKVCache(self.num_layers, capacity + self.cache_slack)

    @contextlib.contextmanager
    def leased_cache(self, capacity: int, kept: TreeKVCache | None = None, rows: int = 0, bound: int | None = None):
        """A cache for one generation: the runner's own where it has one and it is free (CUDA graphs), else a new
        one (which CUDA graphs do not take: the passes then run eagerly). kept: a conversation's cache whose first
        `rows` positions the generation starts from (prefix_cache.py): copied into the runner's cache, else `kept`
        itself where it has the room, else a new one (grown towards `bound` positions: kv_cache.seeded_cache)."""
        runner = self.compiled
        cache = runner.lease(capacity) if runner is not None else None
        try:
            if cache is not None:
                yield cache.start_from(kept, rows)
            else:
                slack = self.cache_slack
                new = lambda size: TreeKVCache(self.num_layers, size)  # noqa: E731
                yield seeded_cache(new, capacity + slack, kept, rows, bound and bound + slack)
        finally:
            if cache is not None:
                runner.release(cache)

    def decompile(self) -> None:
        """Back to eager forwards, with the few-row plan in force before the graphs (runners.decode_graphs)."""
        self.compiled = None
        if self.eager_plan is not None:
            if few_rows.plan_of(self.model) is None:
                few_rows.install(self.model, self.eager_plan)
            else:
                few_rows.set_plan(self.model, self.eager_plan)
            self.eager_plan = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [1, q]
        position_ids: torch.Tensor,  # [1, q]
        cache: TreeKVCache,
        mask: torch.Tensor | None = None,  # additive [1, 1, q, cache.length + q]; None = causal
        features: bool = True,
        last_logits_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (logits [q or 1, V] in the model dtype, features [q, F] or None)."""
        input_ids, position_ids = input_ids.to(self.input_device), position_ids.to(self.input_device)
        q = input_ids.shape[1]
        with few_rows.few_row_kernels():
            runner = self.compiled
            if runner is None or last_logits_only or not runner.takes(cache, q, cache.length):
                return self.decode(input_ids, position_ids, mask, cache, features, last_logits_only)
            if mask is None:
                causal = torch.ones(q, cache.length + q, dtype=torch.bool, device=self.input_device)
                mask = additive_mask(causal.tril(cache.length), self.dtype)
            return self.compiled.run(input_ids, position_ids, mask, cache, features)

    def decode(self, input_ids, position_ids, mask, cache, features: bool, last_logits_only: bool):
        """The forward itself (what the graphs compile): transformers' decoder over the new rows, the lm_head
        over the rows asked, the feature taps."""
        kwargs = {}
        if features and self.feature_layers is not None:
            kwargs["output_hidden_states"] = list(self.feature_layers)
        out = self.decoder(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask, past_key_values=cache,
            use_cache=True, **kwargs,
        )  # fmt: skip
        hidden = out.last_hidden_state[0]  # [q, H], post final norm
        logits = self.logits(hidden[-1:] if last_logits_only else hidden)  # [q or 1, V]
        if not features:
            return logits, None
        if self.feature_layers is None:
            return logits, hidden
        taps = [out.hidden_states[i][0] for i in self.feature_layers]
        return logits, torch.cat([t.to(hidden.device) for t in taps], dim=-1)  # [q, n_features * H]

    @torch.inference_mode()
    def pass_seconds(self, rows: list[int], context: int = 256, repeats: int = 5) -> dict[int, float]:
        """Median wall time of a forward over n new tokens after `context` cached ones for each n in `rows`:
        a vanilla step for n = 1, a verify pass (features included) otherwise; the row counts take turns
        (`seconds_in_turns`)."""
        ids = torch.randint(0, self.vocab_size, (1, context + max(rows)))
        device = self.lm_head.weight.device
        with self.leased_cache(context + max(rows)) as cache:
            self.forward(ids[:, :context], torch.arange(context)[None], cache, features=False, last_logits_only=True)

            def call(n: int):
                new, positions = ids[:, context : context + n], torch.arange(context, context + n)[None]
                return lambda: self.forward(new, positions, cache, features=n > 1)

            return seconds_in_turns(device, {n: call(n) for n in rows}, repeats, after=lambda: cache.crop_to(context))
