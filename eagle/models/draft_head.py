"""The EAGLE draft head: one decoder layer that predicts the base model's next feature.

Two formats share this module (both load the reference project's checkpoints unmodified):

- EAGLE-1/2 (`eagle3=False`): h = fc([embed(x_{t+1}); f_t]) with f_t the base's post-norm last hidden state; one
  Llama layer without an input norm (`layers.0.*`); logits come from the *base* lm_head applied to the output.
- EAGLE-3 (`eagle3=True`): f_t is the concat of three base hidden states (low, mid, high; 3H), projected by
  fc (3H -> H, no bias) the first time; afterwards the head's own output is fed back. The layer (`midlayer.*`)
  attends over [input_layernorm(embed); hidden_norm(h)] (2H); logits are `lm_head(norm(out))` over a reduced draft
  vocabulary mapped to target ids by `d2t` (target = draft + d2t[draft]).

Other producers' EAGLE-3 heads (SpecForge, speculators/vLLM, ModelOpt, AngelSlim) are this layer with switches
(norms before fc, the residual, the fed-back state; DraftConfig's variant fields), set by eagle/models/head_formats.py.

Position t consumes (feature f_t, token x_{t+1}) and predicts f_{t+1}, hence token x_{t+2}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from eagle.kernels import quant_panels, row_attention

from .kv_cache import TreeKVCache

VARIANT_DEFAULTS = {
    "norm_before_fc": False, "fc_norm": False, "norm_before_residual": False, "hidden_input_norm": False,
    "feed_back_normed": False, "norm_before_lm_head": True, "qk_norm": False, "o_bias": False,
}  # fmt: skip


@dataclass
class DraftConfig:
    """The fields of a draft `config.json` that the head uses."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    eagle3: bool
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    fc_bias: bool = True  # the reference reads `"bias"`; absent means True
    qkv_bias: bool = False
    target_hidden_size: int | None = None  # EAGLE-3: fc input is n_features * this when set
    max_position_embeddings: int = 2048
    rope: dict = field(default_factory=dict)  # rope_theta / rope_scaling as found in the file
    raw: dict = field(default_factory=dict)
    explicit_head_dim: int | None = None  # set from the weights by head_formats.normalize
    # EAGLE-3 variants of other producers (eagle/models/head_formats.py); the defaults are the reference's layer.
    feature_layers: tuple[int, ...] | None = None  # indices into the base's hidden_states; None = (2, L//2, L-3)
    norm_before_fc: bool = False  # input_norm over the concatenated features before fc (speculators)
    fc_norm: bool = False  # one RMSNorm per feature block before fc (SpecForge's EAGLE-3.1, speculators)
    norm_before_residual: bool = False  # the residual around attention is hidden_norm(h), not h (speculators)
    hidden_input_norm: bool = False  # hidden_norm(input_layernorm(h)) (ModelOpt's stock first layer)
    feed_back_normed: bool = False  # the next step gets norm(out), not out (speculators' norm_output)
    norm_before_lm_head: bool = True  # False: lm_head(out) (SpecForge's norm_output=false)
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE (Qwen3-style draft layers)
    o_bias: bool = False

    @classmethod
    def from_dict(cls, d: dict, eagle3: bool) -> "DraftConfig":
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"draft config.json lacks {missing}: it is not an EAGLE draft config")
        rope = {k: d[k] for k in ("rope_theta", "rope_scaling") if d.get(k) is not None}
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            vocab_size=d["vocab_size"],
            eagle3=eagle3,
            draft_vocab_size=d.get("draft_vocab_size", d["vocab_size"]) if eagle3 else d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            hidden_act=d.get("hidden_act", "silu"),
            fc_bias=bool(d.get("bias", True)) and not eagle3,
            qkv_bias=bool(d.get("qkv_bias", False)),
            target_hidden_size=d.get("target_hidden_size") if eagle3 else None,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rope=rope,
            raw=dict(d),
            explicit_head_dim=d.get("head_dim_from_weights"),
            feature_layers=tuple(d["feature_layers"]) if eagle3 and d.get("feature_layers") else None,
            **{k: bool(d.get(k, default)) for k, default in VARIANT_DEFAULTS.items()},
        )

    @property
    def head_dim(self) -> int:
        # The reference computes H / heads and ignores a `head_dim` key; loaded heads say it through their weights.
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def num_features(self) -> int:
        return len(self.feature_layers) if self.feature_layers else 3

    @property
    def feature_size(self) -> int:
        """Width of the base features the head consumes: H (EAGLE-1/2) or n_features * H_target (EAGLE-3)."""
        if not self.eagle3:
            return self.hidden_size
        return self.num_features * (self.target_hidden_size or self.hidden_size)

    def base_feature_layers(self, num_layers: int) -> tuple[int, ...] | None:
        """The base hidden_states this head fuses (EAGLE-3), None for EAGLE-1/2 (the post-norm last state)."""
        if not self.eagle3:
            return None
        layers = self.feature_layers or (2, num_layers // 2, num_layers - 3)
        if not all(0 <= i < num_layers for i in layers):
            raise ValueError(
                f"the draft fuses base hidden states {list(layers)} but the base has {num_layers} layers (valid: "
                f"0..{num_layers - 1}): this head was trained for another base model"
            )
        return tuple(layers)

    def rope_config(self) -> LlamaConfig:
        # No rope_theta means base 10000 (the EAGLE-3 LLaMA-3.1 checkpoint relies on this).
        scaling = self.rope.get("rope_scaling")
        max_pos = self.max_position_embeddings
        if scaling and scaling.get("original_max_position_embeddings"):
            max_pos = max(max_pos, scaling["original_max_position_embeddings"] + 1)
        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            head_dim=self.head_dim,
            max_position_embeddings=max_pos,
            rope_theta=self.rope.get("rope_theta", 10000.0),
            rope_scaling=scaling,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        in_size = 2 * cfg.hidden_size if cfg.eagle3 else cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_size, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(in_size, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(in_size, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: TreeKVCache, write_at: int | torch.Tensor) -> torch.Tensor:
        # x: [1, q, in]; mask: additive float [1, 1, q, write_at + q], or [1, 1, q, span] where write_at is the
        # positions [q] to write (a static step: attention over the cache's first `span` positions)
        b, q, _ = x.shape
        qs = self.q_proj(x).view(b, q, self.heads, self.head_dim)
        ks = self.k_proj(x).view(b, q, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            qs, ks = self.q_norm(qs), self.k_norm(ks)
        qs, ks = qs.transpose(1, 2), ks.transpose(1, 2)
        vs = self.v_proj(x).view(b, q, self.kv_heads, self.head_dim).transpose(1, 2)
        qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
        span = None if mask is None else mask.shape[-1]  # the keys read where write_at holds positions
        k_all, v_all = cache.layers[0].write(ks, vs, write_at, span)  # [1, KV, keys, D] each
        if mask is not None and row_attention.applies(qs, k_all, v_all, mask):
            # the kernel library's attention (row_attention.py): a few rows over a long cache in a fraction of the
            # time of ATen's flash attention, which is blocked for many rows (None is causal to the operator, not
            # to SDPA: a mask of its own)
            out = torch.ops.eagle.row_attention(qs, k_all, v_all, mask, self.head_dim**-0.5)  # [1, q, H, D]
            return self.o_proj(out.reshape(b, q, -1))
        out = F.scaled_dot_product_attention(
            qs, k_all, v_all, attn_mask=mask, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """EAGLE-1/2 layer 0 (no input norm) or the EAGLE-3 midlayer (normed embedding and hidden, 2H attention)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.eagle3 = cfg.eagle3
        self.norm_before_residual, self.hidden_input_norm = cfg.norm_before_residual, cfg.hidden_input_norm
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.eagle3:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, emb, cos, sin, mask, cache, write_at) -> torch.Tensor:
        residual = x = h
        if self.eagle3:
            normed = self.hidden_norm(self.input_layernorm(h) if self.hidden_input_norm else h)
            x = torch.cat([self.input_layernorm(emb), normed], -1)  # [.., 2H]
            residual = normed if self.norm_before_residual else h
        h = residual + self.self_attn(x, cos, sin, mask, cache, write_at)
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftHead(nn.Module):
    """State-dict keys follow the reference checkpoints exactly (see eagle/models/checkpoint.py)."""

    def __init__(self, cfg: DraftConfig, own_embedding: bool = True):
        """own_embedding=False: the head uses the base model's embedding (`share_embedding`), which stays out of
        its state dict and is never moved or cast with it (EAGLE-3 checkpoints do not store it)."""
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H) if own_embedding else None
        if own_embedding:
            self.embed_tokens.weight.requires_grad_(False)
        self._shared_embedding: tuple[nn.Embedding, ...] = ()
        if cfg.eagle3:
            block = cfg.feature_size // cfg.num_features
            if cfg.norm_before_fc:
                self.input_norm = RMSNorm(cfg.feature_size, cfg.rms_norm_eps)
            if cfg.fc_norm:
                self.fc_norm = nn.ModuleList(RMSNorm(block, cfg.rms_norm_eps) for _ in range(cfg.num_features))
            self.fc = nn.Linear(cfg.feature_size, H, bias=False)
            self.midlayer = DraftLayer(cfg)
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
            # d2t: draft id -> target id offset; t2d: which target ids the draft vocabulary covers.
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        else:
            self.fc = nn.Linear(2 * H, H, bias=cfg.fc_bias)
            self.layers = nn.ModuleList([DraftLayer(cfg)])
        self.rotary_emb = LlamaRotaryEmbedding(cfg.rope_config())

    def _apply(self, fn, recurse=True):
        """`.to(dtype)`, `.half()`... cast every floating buffer; the rotary frequencies stay float32 whatever the
        head's dtype, as the reference computes them (bf16 rounds a frequency by up to 2^-9 of itself: an angle
        error that grows with the position, ~2.7 rad at position 2000 for SmolLM2's second frequency)."""
        rope = self.rotary_emb
        kept = {name: b for name, b in rope.named_buffers(recurse=False) if b.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, b in kept.items():
            moved = getattr(rope, name)
            if not b.is_meta and not moved.is_meta:
                setattr(rope, name, b.to(moved.device))
        return self

    @property
    def eagle3(self) -> bool:
        return self.config.eagle3

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as options and logs write it: "float32", "bfloat16", or the GGUF block type its linears
        read ("q4_1", few_rows.quantize)."""
        kinds = {quant_panels.NAMES[m.gguf[0]] for m in self.modules() if getattr(m, "gguf", None) is not None}
        return "/".join(sorted(kinds)) or str(self.fc.weight.dtype).removeprefix("torch.")

    @property
    def layer(self) -> DraftLayer:
        return self.midlayer if self.eagle3 else self.layers[0]

    def new_cache(self, capacity: int, zeroed: bool = False) -> TreeKVCache:
        """The head's KV cache (one layer), allocated: positions [0, length) are committed tokens; tree nodes are
        written after them and forgotten when the round ends (the next round overwrites them)."""
        p = self.fc.weight
        cache = TreeKVCache(1, capacity, zeroed=zeroed)
        return cache.allocate(self.config.num_key_value_heads, self.config.head_dim, p.dtype, p.device)

    def share_embedding(self, embedding: nn.Embedding) -> None:
        self._shared_embedding = (embedding,)  # a tuple, so nn.Module does not register (and move) it

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding[0]
        emb = table(input_ids.to(table.weight.device))
        return emb.to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [1, q, feature_size] base features, or [1, q, H] the head's own outputs (EAGLE-3)
        input_ids: torch.Tensor,  # [1, q] the tokens one step ahead of the features
        position_ids: torch.Tensor,  # [1, q]
        mask: torch.Tensor,  # additive float [1, 1, q, write_at + q] (or a span: DraftAttention)
        cache: TreeKVCache,
        write_at: int | torch.Tensor,
    ) -> torch.Tensor:  # [1, q, H] predicted next features (EAGLE-3: pre-norm unless feed_back_normed)
        emb = self.embed(input_ids)
        hidden = hidden.to(self.fc.weight.dtype)
        if self.eagle3:
            h = self.fuse(hidden) if hidden.shape[-1] != self.config.hidden_size else hidden
        else:
            h = self.fc(torch.cat([emb, hidden], -1))
        cos, sin = self.rotary_emb(h, position_ids)
        out = self.layer(h, emb, cos, sin, mask, cache, write_at)
        return self.norm(out) if self.config.feed_back_normed else out

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: [.., n_features * T] base features -> [.., H], with the producer's optional norms first."""
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        if self.config.fc_norm:
            blocks = features.chunk(self.config.num_features, dim=-1)
            features = torch.cat([norm(x) for norm, x in zip(self.fc_norm, blocks)], -1)
        return self.fc(features)

    def logits(self, out: torch.Tensor, base_lm_head: nn.Module) -> torch.Tensor:
        """[..., H] -> [..., draft vocab]: the base lm_head for EAGLE-1/2, the head's own for EAGLE-3."""
        if self.eagle3:
            normed = self.config.feed_back_normed or not self.config.norm_before_lm_head
            return self.lm_head(out if normed else self.norm(out))
        return base_lm_head(out.to(base_lm_head.weight.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.eagle3 and self.config.draft_vocab_size != self.config.vocab_size:
            return draft_ids + self.d2t[draft_ids]
        return draft_ids
