"""Acceptance profile of a draft head: how often the base takes the draft's rank-r candidate at depth d.

    python -m eagle.train.acceptance --head assets/smollm2-eagle3 --data HELDOUT_CACHE   # -> HEAD/acceptance.json

Measured on held-out samples of a prepared cache (`python -m eagle.train prepare`), with the head unrolled exactly
as it drafts (training-time test, `ttt.py`): at depth d the head has been fed the real tokens before it, i.e. the
path the base accepted so far. For each reply position and depth d < `depth`, with c_0..c_{K-1} the draft's top
K candidates (its own ranking):

- T = 0: accept[d][r] = P(c_r is the base's greedy token), over positions whose data follows the base's greedy
  path up to depth d (so the draft's prefix is one the base accepts);
- T > 0: accept[d][r] = E[p_T(c_r)], the base's probability of sampling c_r at temperature T (the chance a
  sample lands on that candidate), over every position.

A tree tuner reads the expected accepted length of a tree from it without a warm-up run: a node reached through
ranks (r_0, ..., r_d) is accepted with probability about prod_i accept[i][r_i].
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .ttt import live_positions, shift, unrolled_forward


@torch.no_grad()
def profile_sums(head, embed: torch.nn.Module, base_lm_head: torch.Tensor, batch: dict, depth: int, top_k: int,
                 temperatures: tuple[float, ...], transform=None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Sums over one collated batch (`fit.collate`): "count/T" [depth] positions and "hits/T" [depth, top_k].
    `transform`: the base's processing of its logits (eagle/models/logits.py), None = none."""
    outs = unrolled_forward(head, embed, batch["features"], batch["input_ids"], depth)
    sums: dict[str, torch.Tensor] = {}
    on_path = torch.ones_like(batch["loss_mask"])  # the data so far is the base's greedy path
    for d, out in enumerate(outs):
        live = live_positions(batch["loss_mask"], batch["lengths"], d)  # [B, T]
        greedy = shift(batch["argmax"], d + 1)  # [B, T] the base's greedy token at this depth
        if head.eagle3:
            logits = head.lm_head(head.norm(out[live]))  # [N, Vd]
        else:
            logits = out[live] @ base_lm_head.T.to(out.dtype)  # [N, V]
        cand = head.to_target_ids(logits.topk(min(top_k, logits.shape[-1]), -1).indices)  # [N, K] target ids
        for t in temperatures:
            key = f"{t:g}"
            if t == 0:
                keep = on_path[live]  # [N]
                hits = (cand[keep] == greedy[live][keep][:, None]).float().sum(0)  # [K]
                count = keep.sum()
            else:
                hidden = shift(batch["hidden"], d + 1)[live].float()  # [N, H] its logits give this depth's token
                base_logits = hidden @ base_lm_head.T.float()  # [N, V]
                if transform is not None:
                    base_logits = transform(base_logits)
                p = (base_logits / t).softmax(-1)  # [N, V]
                hits, count = p.gather(1, cand).sum(0), live.sum()
            sums.setdefault(f"hits/{key}", torch.zeros(depth, top_k))[d, : hits.numel()] += hits.cpu()
            sums.setdefault(f"count/{key}", torch.zeros(depth))[d] += count.cpu()
        on_path = on_path & (greedy == shift(batch["input_ids"], d + 2))
    return sums


def acceptance_profile(head, data, indices: list[int], depth: int = 7, top_k: int = 10,
                       temperatures: tuple[float, ...] = (0.0, 0.7), batch_tokens: int = 4096) -> dict:  # fmt: skip
    """The profile over samples `indices` of `data` (a `CachedData`), as a JSON-ready dict."""
    from eagle.models.logits import logit_transform

    from .fit import collate, make_batches

    transform = logit_transform(data.meta["base_config"], data.meta.get("base_model_type"))
    weights = data.base_weights()
    embed = torch.nn.Embedding.from_pretrained(weights["embed"].float())
    lm_head = weights["lm_head"].float()
    head = head.float().eval()
    totals: dict[str, torch.Tensor] = {}
    for b in make_batches([data.length(i) for i in indices], batch_tokens, 0):
        batch = collate([data[indices[i]] for i in b], head.eagle3, "cpu")
        for k, v in profile_sums(head, embed, lm_head, batch, depth, top_k, temperatures, transform).items():
            totals[k] = totals.get(k, 0) + v
    result = {"depth": depth, "top_k": top_k, "samples": len(indices), "accept": {}, "positions": {}}
    for t in temperatures:
        key = f"{t:g}"
        count = totals[f"count/{key}"]
        result["accept"][key] = (totals[f"hits/{key}"] / count.clamp(min=1)[:, None]).round(decimals=4).tolist()
        result["positions"][key] = count.long().tolist()
    return result


def load_head_only(folder: str):
    """An exported head as a float32 `DraftHead` on CPU, without its base (the profile needs no base model)."""
    from eagle.models.checkpoint import detect_eagle3, read_checkpoint
    from eagle.models.draft_head import DraftConfig, DraftHead

    config, state = read_checkpoint(folder)
    head = DraftHead(DraftConfig.from_dict(config, detect_eagle3(config, state, None)), own_embedding=False)
    head.load_state_dict({k: v.float() for k, v in state.items() if k != "embed_tokens.weight"}, strict=True)
    return head.eval()


def main(argv: list[str] | None = None) -> None:
    from .data import CachedData

    p = argparse.ArgumentParser(prog="python -m eagle.train.acceptance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--head", required=True, help="exported head folder (config.json + weights)")
    p.add_argument("--data", required=True, help="prepared cache (name or path) of held-out conversations")
    p.add_argument("--samples", type=int, default=None, help="the last N samples of the cache (default: all)")
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--out", default=None, help="JSON file (default: HEAD/acceptance.json)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    head = load_head_only(args.head)
    data = CachedData(args.data)
    n = len(data) if args.samples is None else min(args.samples, len(data))
    temperatures = tuple(float(t) for t in args.temperatures.split(","))
    result = acceptance_profile(head, data, list(range(len(data) - n, len(data))), args.depth, args.top_k,
                                temperatures)  # fmt: skip
    result["data"] = str(data.root.name)
    out = Path(args.out or Path(args.head) / "acceptance.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    for key, rows in result["accept"].items():
        print(f"T={key}: " + "  ".join(f"d{d}: " + " ".join(f"{x:.2f}" for x in row[:4]) for d, row in enumerate(rows)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
