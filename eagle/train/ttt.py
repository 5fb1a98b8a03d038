"""The draft head unrolled over whole sequences, as at inference but without a cache ("training-time test").

Alignment (both recipes): the chain that starts at position j has the real context up to feature f_j. Step k of
that chain (k = 0, 1, ...) sits at position j + k, is fed token x_{j+k+1} and a hidden state (step 0: the base
feature f_j; step k > 0: the head's own step k-1 output at j), and predicts x_{j+k+2}.

Attention at step k for query position j sees
- the step-0 keys of positions <= j (the real context; causal), and
- the keys of steps 1..k at the same position j (its own ancestors in the chain: the "diagonal" terms),
all in one softmax. This is what the engine does when it expands a draft chain on top of committed positions.
RoPE puts step k at position j + k, as the engine does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagle.models.draft_head import DraftHead


def shift(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """Shift left by n along dim 1: out[:, j] = x[:, j + n], `fill` past the end. x: [B, T, ...]"""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)[:, : x.shape[1]]


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, kv_heads, T, d] -> [B, kv_heads * groups, T, d]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def chain_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [B, h, T, d]; keys/values: one [B, kv, T, d] per step so far (the last one is q's own step).
    Returns [B, h, T, d]: softmax over (causal step-0 keys) + (same-position keys of steps 1..k)."""
    groups = q.shape[1] // keys[0].shape[1]
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, _repeat_kv(keys[0], groups), _repeat_kv(values[0], groups),
                                              is_causal=True)  # fmt: skip
    T, scale = q.shape[2], q.shape[-1] ** -0.5
    acc = torch.promote_types(q.dtype, torch.float32)  # scores and softmax in fp32 at least
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (q @ _repeat_kv(keys[0], groups).transpose(-1, -2)).to(acc) * scale  # [B, h, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = torch.cat([(q * _repeat_kv(k, groups)).sum(-1, keepdim=True).to(acc) * scale for k in keys[1:]],
                     dim=-1)  # [B, h, T, steps - 1]  # fmt: skip
    lse = torch.logsumexp(torch.cat([torch.logsumexp(s0, -1, keepdim=True), diag], -1), -1, keepdim=True)
    p0 = torch.exp(s0 - lse).to(q.dtype)  # [B, h, T, T]
    pd = torch.exp(diag - lse).to(q.dtype)  # [B, h, T, steps - 1]
    out = p0 @ _repeat_kv(values[0], groups)
    for m, v in enumerate(values[1:]):
        out = out + pd[..., m : m + 1] * _repeat_kv(v, groups)
    return out


def unrolled_forward(
    head: DraftHead,
    embed: torch.nn.Module,  # the frozen base embedding
    features: torch.Tensor,  # [B, T, F] base features f_t (3H for EAGLE-3, H for EAGLE-1/2)
    input_ids: torch.Tensor,  # [B, T] x_t, 0 past each sequence's end
    steps: int,
) -> list[torch.Tensor]:  # `steps` tensors [B, T, H]: the head's output at each step (EAGLE-3: pre-norm)
    B, T = input_ids.shape
    layer, attn, cfg = head.layer, head.layer.self_attn, head.config
    positions = torch.arange(T, device=input_ids.device)[None].expand(B, T)
    keys, values, outs = [], [], []
    for k in range(steps):
        emb = embed(shift(input_ids, k + 1)).to(features.dtype)  # [B, T, H] token x_{j+k+1}
        if cfg.eagle3:
            h = head.fuse(features) if k == 0 else outs[-1]
            x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h)], dim=-1)  # [B, T, 2H]
        else:
            h = head.fc(torch.cat([emb, features if k == 0 else outs[-1]], dim=-1))
            x = h
        q = attn.q_proj(x).view(B, T, attn.heads, attn.head_dim).transpose(1, 2)  # [B, h, T, d]
        kk = attn.k_proj(x).view(B, T, attn.kv_heads, attn.head_dim).transpose(1, 2)  # [B, kv, T, d]
        vv = attn.v_proj(x).view(B, T, attn.kv_heads, attn.head_dim).transpose(1, 2)
        cos, sin = head.rotary_emb(h, positions + k)
        q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
        keys.append(kk)
        values.append(vv)
        a = chain_attention(q, keys, values).transpose(1, 2).reshape(B, T, -1)  # [B, T, h * d]
        h = h + attn.o_proj(a)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(h)
    return outs


def live_positions(loss_mask: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] bool: step k at position j is trained/scored iff its target x_{j+k+2} exists and is a reply token."""
    T = loss_mask.shape[1]
    j = torch.arange(T, device=loss_mask.device)[None]
    return shift(loss_mask, k + 2, False) & (j + k + 2 < lengths[:, None])


def chain_length(correct: list[torch.Tensor], continues: list[torch.Tensor], start: torch.Tensor) -> torch.Tensor:
    """Accepted draft tokens per chain start for a greedy top-1 chain.

    correct[k] [B, T]: step k's top-1 equals the base's greedy token; continues[k] [B, T]: that token is also
    the one the data feeds to step k + 1 (always true on self-distilled greedy data); start [B, T]: chains to
    count. Returns [B, T] long (0 where not `start`)."""
    alive = start.clone()
    accepted = torch.zeros_like(start, dtype=torch.long)
    for ok, cont in zip(correct, continues):
        alive = alive & ok
        accepted += alive.long()
        alive = alive & cont
    return accepted * start
