"""Training objectives of both recipes, wrapped with the frozen base weights in one module.

EAGLE-3 (reference `eagle/traineagle3`): K unrolled steps (training-time test); step k's loss is the
cross-entropy of the draft's distribution over its reduced vocabulary against softmax(base logits restricted to
that vocabulary); positions whose base argmax is outside the draft vocabulary are left out; total = sum_k 0.8^k
loss_k. No feature regression.

`objective="accept"` (EAGLE-3) aims at acceptance itself instead: step k's loss is -log sum_x min(q(x), p_T(x)), q
the draft's distribution and p_T the base's at the decoding temperature T (restricted to the draft vocabulary):
sum_x min(q, p_T) is the chance that speculative sampling at T accepts a token drafted from q. At T = 0, p_T is the
base's greedy token and the loss is -log q(greedy), the cross-entropy against that token alone; at T = 1 it is
zero exactly when the draft matches the base.

EAGLE-1/2 (reference `eagle/train/main.py`): one step; smooth-L1 between the predicted and the real next feature
(averaged over the hidden dim) + 0.1 x soft cross-entropy of base logits of the predicted feature against
softmax(base logits of the real one) over the full vocabulary; the input features get uniform noise
U(-0.1, 0.1) * 512 / length during training.

"Base logits" of a feature h are the base's own: lm_head(h), then the base's processing after its lm_head
(soft-capping, scaling: eagle/models/logits.py; `logit_transform`), so soft targets follow the distribution the
base samples from. The transforms are elementwise, so restricting to the draft vocabulary commutes with them.

Both return the loss and metric *sums* (so they can be added across batches and processes): per step k the
top-1 agreement with the base's greedy token, and the greedy top-1 chain length (accepted draft tokens per chain
start: an estimate of acceptance without a tree).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from eagle.models.draft_head import DraftHead

from .ttt import chain_length, live_positions, shift, unrolled_forward


class DraftTrainer(nn.Module):
    def __init__(
        self,
        head: DraftHead,
        embed_weight: torch.Tensor,  # [V, H] the base embedding (frozen)
        lm_head_weight: torch.Tensor,  # [V, H] the base lm_head (frozen); EAGLE-3 keeps only the draft vocab rows
        steps: int = 7,
        decay: float = 0.8,
        p_weight: float = 0.1,
        noise: float = 0.0,  # EAGLE-1/2 uniform noise width (0.2 in the reference: U(-0.1, 0.1) * 512 / len)
        logit_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,  # the base's, after lm_head
        objective: str = "ce",  # EAGLE-3: "ce" (soft cross-entropy) or "accept" (-log acceptance at temperature)
        accept_temperature: float = 0.0,  # the decoding temperature "accept" aims at (0 = greedy)
    ):
        super().__init__()
        if objective not in ("ce", "accept"):
            raise ValueError(f"objective {objective!r}: 'ce' or 'accept'")
        self.objective, self.accept_temperature = objective, accept_temperature
        self.head = head
        self.eagle3 = head.eagle3
        self.steps, self.decay, self.p_weight, self.noise = steps, decay, p_weight, noise
        self.logit_transform = logit_transform
        # Frozen parameters, not buffers: DDP neither syncs nor broadcasts them.
        self.embed = nn.Embedding.from_pretrained(embed_weight.float(), freeze=True)
        if self.eagle3:
            rows = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=head.d2t.device))
            lm_head_weight = lm_head_weight[rows.to(lm_head_weight.device)]  # [Vd, H]
        self.target_head = nn.Parameter(lm_head_weight.float().clone(), requires_grad=False)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Features [..., H] -> the base's logits [..., V] (EAGLE-3: [..., Vd], the draft vocabulary's) in fp32:
        target_head, then the base's processing."""
        logits = (h @ self.target_head.T.to(h.dtype)).float()
        return logits if self.logit_transform is None else self.logit_transform(logits)

    def forward(self, batch: dict[str, torch.Tensor], steps: int | None = None) -> tuple[torch.Tensor, dict]:
        steps = steps or (self.steps if self.eagle3 else 1)
        features = batch["features"]  # [B, T, F]
        if self.training and self.noise > 0:
            width = self.noise * 512 / batch["lengths"].to(features.dtype)[:, None, None]
            features = features + (torch.rand_like(features) - 0.5) * width
        outs = unrolled_forward(self.head, self.embed, features, batch["input_ids"], steps)
        if self.eagle3:
            return self._eagle3_loss(outs, batch)
        return self._eagle1_loss(outs, batch)

    # ---------------------------------------------------------------------------------------------------------
    def _eagle3_loss(self, outs: list[torch.Tensor], batch: dict) -> tuple[torch.Tensor, dict]:
        head = self.head
        loss = torch.zeros((), device=batch["hidden"].device)
        stats, correct, continues = {}, [], []
        for k, out in enumerate(outs):
            live = live_positions(batch["loss_mask"], batch["lengths"], k)  # [B, T]
            greedy = shift(batch["argmax"], k + 1)  # [B, T] the base's greedy x_{j+k+2}
            keep = live & head.t2d[greedy]  # the draft vocabulary holds the greedy token
            # Only the kept rows go through the draft head's vocabulary projection: [N, H] -> [N, Vd]
            logp = head.lm_head(head.norm(out[keep])).float().log_softmax(-1)
            with torch.no_grad():
                target = shift(batch["hidden"], k + 1)[keep]  # [N, H] h_{j+k+1}: its logits predict x_{j+k+2}
                target_logits = self.base_logits(target)  # [N, Vd]
            if self.objective == "ce":
                ce = -(target_logits.softmax(-1) * logp).sum(-1)  # [N]
            else:
                ce = self._accept_loss(logp, target_logits)  # [N]
            n = keep.sum()
            loss_k = ce.sum() / n.clamp(min=1)
            loss = loss + self.decay**k * loss_k
            with torch.no_grad():
                ok = torch.zeros_like(live)
                ok[keep] = head.to_target_ids(logp.argmax(-1)) == greedy[keep]
                correct.append(ok)
                continues.append(greedy == shift(batch["input_ids"], k + 2))
                stats[f"loss_{k}"] = ce.detach().sum()
                stats[f"correct_{k}"] = ok.sum()
                stats[f"live_{k}"] = live.sum()
                stats[f"kept_{k}"] = n
        self._chain_stats(stats, correct, continues, batch)
        return loss, stats

    def _accept_loss(self, logp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """logp [N, Vd] the draft's log-probabilities, logits [N, Vd] the base's (`base_logits`) -> [N] -log sum_x
        min(q(x), p_T(x)): minus the log of the chance that speculative sampling at the temperature accepts q's
        draft."""
        with torch.no_grad():
            if self.accept_temperature > 0:
                p = (logits / self.accept_temperature).softmax(-1)
            else:  # greedy: the base's argmax alone
                p = F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logp.dtype)
        accepted = torch.minimum(logp.exp(), p).sum(-1)  # [N]
        return -accepted.clamp(min=1e-12).log()

    def _eagle1_loss(self, outs: list[torch.Tensor], batch: dict) -> tuple[torch.Tensor, dict]:
        stats, correct, continues = {}, [], []
        loss = None
        for k, out in enumerate(outs):
            live = live_positions(batch["loss_mask"], batch["lengths"], k)
            greedy = shift(batch["argmax"], k + 1)
            logits = self.base_logits(out)  # [B, T, V]
            if k == 0:
                target = shift(batch["hidden"], 1)  # [B, T, H] the real next feature f_{j+1}
                n = live.sum().clamp(min=1)
                vloss = F.smooth_l1_loss(out.float(), target.float(), reduction="none").mean(-1)  # [B, T]
                with torch.no_grad():
                    target_p = self.base_logits(target).softmax(-1)  # [B, T, V]
                ploss = -(target_p * logits.log_softmax(-1)).sum(-1)  # [B, T]
                vloss, ploss = (vloss * live).sum() / n, (ploss * live).sum() / n
                loss = vloss + self.p_weight * ploss
                stats["vloss"], stats["ploss"] = vloss.detach() * live.sum(), ploss.detach() * live.sum()
                stats["loss_0"] = loss.detach() * live.sum()
            with torch.no_grad():
                ok = (logits.argmax(-1) == greedy) & live
                correct.append(ok)
                continues.append(greedy == shift(batch["input_ids"], k + 2))
                stats[f"correct_{k}"] = ok.sum()
                stats[f"live_{k}"] = live.sum()
        self._chain_stats(stats, correct, continues, batch)
        return loss, stats

    @staticmethod
    def _chain_stats(stats: dict, correct: list, continues: list, batch: dict) -> None:
        with torch.no_grad():
            start = live_positions(batch["loss_mask"], batch["lengths"], 0)
            stats["chain_accepted"] = chain_length(correct, continues, start).sum()
            stats["chain_starts"] = start.sum()


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Metric sums -> means: loss_k, acc_k (top-1 agreement with the base's greedy token, over reply positions),
    tau (1 + mean accepted tokens of a greedy top-1 chain of len(acc) draft tokens)."""
    out = {}
    k = 0
    while f"live_{k}" in sums:
        live = max(sums[f"live_{k}"], 1)
        out[f"acc_{k}"] = sums[f"correct_{k}"] / live
        if f"loss_{k}" in sums:
            out[f"loss_{k}"] = sums[f"loss_{k}"] / max(sums.get(f"kept_{k}", sums[f"live_{k}"]), 1)
        k += 1
    for name in ("vloss", "ploss"):
        if name in sums:
            out[name] = sums[name] / max(sums["live_0"], 1)
    if "chain_starts" in sums:
        out["tau"] = 1 + sums["chain_accepted"] / max(sums["chain_starts"], 1)
    return out
