"""Fast batched generation from a Llama-architecture base, for self-distillation data (regen.py's `generate`
calls, hundreds of rows at a time).

The forward is a minimal Llama written here over the HF model's own weights (q/k/v and gate/up fused into one
matmul each: the only copies), so that one decode step is a fixed sequence of kernels over static buffers, which
CUDA graphs replay (gpt-fast's `decode_one_token`):
- prefill: one eager forward over the left-padded prompts [B, P], writing cache columns [0, P);
- decode step s: every row's last token is written at column P + s and attends over the columns [0, L), L the
  smallest multiple of `bucket` above P + s (one captured graph per L: the attention never reads the dead end of
  the cache), then the next token is picked, recorded and checked against the stop ids, all on the device.

Invariants:
- a row's left pads are never attended (except each pad by itself in prefill, so no attention row is empty) and
  do not count as positions: the token at column c of a row with `pad` pads has position c - pad, as it would
  alone, unpadded (rotary cos/sin computed as transformers' default-type LlamaRotaryEmbedding does);
- a step reads only device buffers (`tokens`, `col`, `n`, `pads`) and advances them itself, so one graph serves
  every step of its bucket and the host never waits for a step: it reads the device only every CHECK_EVERY steps
  (are all rows done?) and once at the end;
- sampling is the Gumbel-max race argmax(logits / T + Gumbel noise), the noise drawn outside the graphs from the
  call's generator: the same seed gives the same tokens, captured or not.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

BUCKET = 128  # cache columns a decode step's attention reads: a multiple of this
CHECK_EVERY = 16  # decode steps between two host reads of "all rows done"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _fused(*linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """nn.Linear modules sharing an input -> one (weight [sum of outs, in], bias or None)."""
    weight = torch.cat([m.weight for m in linears])
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    zeros = [m.weight.new_zeros(m.out_features) for m in linears]
    return weight, torch.cat([b if b is not None else z for b, z in zip(biases, zeros)])


def rope_theta(cfg) -> float:
    """The base of a default-type rotary embedding; ValueError for any other rope type."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"batch_generate supports the default rotary embedding only, not rope type {kind!r}")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


class LlamaWeights:
    """A Llama-architecture `*ForCausalLM`'s weights, as the forward here uses them (the HF tensors themselves,
    except the fused q/k/v and gate/up matrices)."""

    @torch.no_grad()
    def __init__(self, model):
        cfg = model.config.get_text_config()
        if cfg.hidden_act != "silu":
            raise ValueError(f"batch_generate supports SiLU MLPs only, not {cfg.hidden_act!r}")
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        decoder = model.get_decoder()
        self.embed = model.get_input_embeddings().weight  # [V, H]
        self.norm = decoder.norm.weight  # [H]
        self.lm_head = model.get_output_embeddings()  # weight [V, H] (tied: the embedding's own tensor)
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if hasattr(attn, "q_norm"):
                raise ValueError("batch_generate does not support q/k norms (Qwen3-style attention)")
            self.layers.append({
                "ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
                "qkv": _fused(attn.q_proj, attn.k_proj, attn.v_proj), "o": (attn.o_proj.weight, attn.o_proj.bias),
                "gate_up": _fused(mlp.gate_proj, mlp.up_proj), "down": (mlp.down_proj.weight, mlp.down_proj.bias),
            })  # fmt: skip
        dim = self.head_dim  # transformers' compute_default_rope_parameters, on the CPU in float32
        inv_freq = 1.0 / (rope_theta(cfg) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.inv_freq = inv_freq.to(self.embed.device)  # [D / 2]
        self.vocab = self.lm_head.weight.shape[0]
        self.device, self.dtype = self.embed.device, self.embed.dtype


class BatchDecoder:
    """Static state for generating from up to `rows` prompts at once within `capacity` cache columns (prompt
    width + new tokens): KV cache, step buffers and the captured graphs, reused by every `generate` call (the
    graphs of a bucket are captured on its first step, then replayed by later batches too).

    capture: CUDA graphs (None = on CUDA); False runs the very same steps eagerly on the same buffers."""

    def __init__(self, model, rows: int, capacity: int, bucket: int = BUCKET, capture: bool | None = None):
        self.w = w = LlamaWeights(model)
        device, dtype = w.device, w.dtype
        self.capture = device.type == "cuda" if capture is None else capture
        self.rows, self.bucket = rows, bucket
        self.capacity = _round_up(capacity, bucket)
        shape = (len(w.layers), rows, w.kv_heads, self.capacity, w.head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)  # [layers, B, KVH, C, D]
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)  # [layers, B, KVH, C, D]
        self.columns = torch.arange(self.capacity, device=device)  # [C]
        self.pads = torch.zeros(rows, dtype=torch.long, device=device)  # [B] left pads of each row
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # [B] last token: the next step's input
        self.col = torch.zeros(1, dtype=torch.long, device=device)  # [1] the column the next step writes
        self.n = torch.zeros(1, dtype=torch.long, device=device)  # [1] tokens generated so far per row
        self.out = torch.zeros(rows, self.capacity, dtype=torch.long, device=device)  # [B, C] generated ids
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)  # [B] has emitted a stop id
        self.is_stop = torch.zeros(w.vocab, dtype=torch.bool, device=device)  # [V]
        self.inv_temp = torch.ones((), device=device)  # 1 / temperature (float32)
        self.noise: torch.Tensor | None = None  # [B, V] float32 uniform [0, 1), drawn before each sampled step
        self.graphs: dict[tuple[int, bool], object] = {}  # (width, sampled) -> CUDAGraph (None when eager)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    # --- the forward ---------------------------------------------------------------------------------------------

    def _rotary(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, signed sin [B, T, 1, D] (sin's first half negated: x * cos + x.roll(D/2) *
        signed sin is transformers' x * cos + rotate_half(x) * sin, bit for bit)."""
        freqs = positions[..., None].float() * self.w.inv_freq  # [B, T, D/2]
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)  # [B, T, D/2]
        return torch.cat([cos, cos], -1)[:, :, None], torch.cat([-sin, sin], -1)[:, :, None]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, NH, T, D], keys/values [B, KVH, L, D], additive mask [B, 1, T, L] -> [B, T, NH * D]."""
        b, nh, t, d = q.shape
        kvh = keys.shape[1]
        if t == 1:  # decode: a KV head's query heads as its query rows (transformers' pack_gqa): no KV copies
            out = F.scaled_dot_product_attention(q.reshape(b, kvh, nh // kvh, d), keys, values, attn_mask=mask)
            return out.reshape(b, 1, nh * d)  # [B, KVH, G, D]: head h = kv * G + g, as repeat_kv orders them
        # prefill: KV heads copied to their query heads (repeat_kv), since SDPA's GQA with a mask falls back to its
        # math kernel on CUDA (memory O(B * NH * P^2))
        keys, values = keys.repeat_interleave(nh // kvh, 1), values.repeat_interleave(nh // kvh, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, NH, T, D]
        return out.transpose(1, 2).reshape(b, t, nh * d)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor, mask: torch.Tensor,
                width: int) -> torch.Tensor:  # fmt: skip
        """ids, positions [B, T] written at cache columns `cols` [T], attending over columns [0, width) through
        the additive `mask` [B, 1, T, width] -> the last position's logits [B, V]."""
        w = self.w
        b, t = ids.shape
        nh, kvh, d = w.heads, w.kv_heads, w.head_dim
        x = F.embedding(ids, w.embed)  # [B, T, H]
        cos, sin = self._rotary(positions, x.dtype)  # [B, T, 1, D]
        for i, layer in enumerate(w.layers):
            h = F.rms_norm(x, x.shape[-1:], layer["ln1"], w.eps)
            qkv = F.linear(h, *layer["qkv"]).view(b, t, nh + 2 * kvh, d)  # [B, T, NH + 2 KVH, D]
            qk = qkv[:, :, : nh + kvh]
            qk = qk * cos + qk.roll(d // 2, -1) * sin  # [B, T, NH + KVH, D]
            q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2)  # [B, NH, T, D], [B, KVH, T, D]
            v = qkv[:, :, nh + kvh :].transpose(1, 2)  # [B, KVH, T, D]
            self.k_cache[i].index_copy_(2, cols, k)
            self.v_cache[i].index_copy_(2, cols, v)
            attn = self._attend(q, self.k_cache[i, :, :, :width], self.v_cache[i, :, :, :width], mask)
            x = x + F.linear(attn, *layer["o"])
            h = F.rms_norm(x, x.shape[-1:], layer["ln2"], w.eps)
            gate, up = F.linear(h, *layer["gate_up"]).chunk(2, -1)  # [B, T, I] each
            x = x + F.linear(F.silu(gate) * up, *layer["down"])
        h = F.rms_norm(x[:, -1], x.shape[-1:], w.norm, w.eps)  # [B, H]
        return F.linear(h, w.lm_head.weight, w.lm_head.bias)  # [B, V]

    def _pick(self, logits: torch.Tensor, sampled: bool) -> torch.Tensor:
        """logits [B, V] -> next ids [B]: argmax, or the Gumbel-max race on self.noise (u = 0 gives noise -inf:
        never picked; u < 1, so the noise is finite)."""
        if not sampled:
            return logits.argmax(-1)
        return (logits.float() * self.inv_temp - torch.log(-torch.log(self.noise))).argmax(-1)

    def _record(self, nxt: torch.Tensor) -> None:
        """Append nxt [B] to every row; it is the next step's input."""
        self.out.index_copy_(1, self.n, nxt[:, None])
        self.done |= self.is_stop[nxt]
        self.tokens.copy_(nxt)
        self.n += 1

    def decode_step(self, width: int, sampled: bool) -> None:
        """One token for every row: self.tokens [B] are written at column self.col (position col - pad) and attend
        over the columns [0, width) that are live (the row's real prompt and its tokens so far, this one
        included); the next token is recorded and self.col advanced. Static shapes and device state only: the
        function a bucket's graph captures. Needs self.col < width."""
        cols = self.columns[:width]  # [L]
        live = (cols >= self.pads[:, None]) & (cols <= self.col)  # [B, L]
        mask = torch.zeros(live.shape, dtype=self.w.dtype, device=live.device).masked_fill_(~live, float("-inf"))
        positions = (self.col - self.pads)[:, None]  # [B, 1]
        logits = self.forward(self.tokens[:, None], positions, self.col, mask[:, None, None], width)  # [B, V]
        self._record(self._pick(logits, sampled))
        self.col += 1

    def _prefill(self, ids: torch.Tensor, sampled: bool) -> None:
        """ids [B, P] left-padded (self.pads set): cache columns [0, P) and the first generated token."""
        p = ids.shape[1]
        cols = self.columns[:p]  # [P]
        positions = (cols - self.pads[:, None]).clamp(min=0)  # [B, P] (pads: 0, unused)
        real = cols >= self.pads[:, None]  # [B, P]
        causal = cols[:, None] >= cols[None, :]  # [P query, P key]
        live = causal & (real[:, None, :] | torch.eye(p, dtype=torch.bool, device=ids.device))  # [B, P, P]
        mask = torch.zeros(live.shape, dtype=self.w.dtype, device=ids.device).masked_fill_(~live, float("-inf"))
        logits = self.forward(ids, positions, cols, mask[:, None], p)  # [B, V]
        self.n.zero_()
        self.done.zero_()
        self._record(self._pick(logits, sampled))
        self.col.fill_(p)

    # --- the host loop -------------------------------------------------------------------------------------------

    def _step(self, width: int, sampled: bool) -> None:
        key = (width, sampled)
        if not self.capture:
            self.graphs[key] = None
            self.decode_step(width, sampled)
            return
        if key not in self.graphs:
            self.graphs[key] = self._capture(width, sampled)
        self.graphs[key].replay()

    def _capture(self, width: int, sampled: bool):
        """decode_step(width, sampled) as a CUDA graph. Its warm-up run (lazy cuBLAS/SDPA set-up, off the
        capturing stream) is undone: the state it advanced is restored, and the K/V and output column it wrote
        are written again, identically, by the replay that follows."""
        state = (self.tokens, self.col, self.n, self.done)
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.decode_step(width, sampled)
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(state, saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.decode_step(width, sampled)
        return graph

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int], temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> list[list[int]]:  # fmt: skip
        """Per prompt, its generated ids up to and including the first stop id, or max_new_tokens ids.

        Rows are left-padded to the longest prompt P (P + max_new_tokens <= capacity); fewer prompts than rows are
        filled with copies of the first (done from the start, never returned). temperature 0 = greedy; else
        sampled from softmax(logits / temperature) with `generator` (on the model's device)."""
        n, b = len(prompts), self.rows
        if not 0 < n <= b or not all(prompts):
            raise ValueError(f"need 1 to {b} non-empty prompts, got {n}")
        p = max(len(x) for x in prompts)
        if p + max_new_tokens > self.capacity:
            raise ValueError(f"prompt width {p} + {max_new_tokens} new tokens exceeds capacity {self.capacity}")
        if any(not 0 <= s < self.w.vocab for s in stop_ids):
            raise ValueError(f"stop ids {sorted(stop_ids)} outside the vocabulary [0, {self.w.vocab})")
        device = self.w.device
        rows = prompts + [prompts[0]] * (b - n)
        ids = torch.zeros(b, p, dtype=torch.long)  # [B, P] left-padded (pad id 0: never attended)
        for r, x in enumerate(rows):
            ids[r, p - len(x) :] = torch.tensor(x)
        self.pads.copy_(torch.tensor([p - len(x) for x in rows]))
        self.is_stop.zero_()
        self.is_stop[sorted(stop_ids)] = True
        sampled = temperature > 0
        if sampled:
            self.inv_temp.fill_(1.0 / temperature)
            if self.noise is None:
                self.noise = torch.empty(b, self.w.vocab, device=device)
            if generator is None:
                generator = torch.Generator(device).manual_seed(0)
            self.noise.uniform_(generator=generator)
        self._prefill(ids.to(device), sampled)
        self.done[n:] = True
        for s in range(max_new_tokens - 1):
            if stop_ids and s % CHECK_EVERY == 0 and bool(self.done.all()):
                break  # every row holds a stop id in the columns written so far: nothing later is read
            if sampled:
                self.noise.uniform_(generator=generator)
            self._step(min(_round_up(p + s + 1, self.bucket), self.capacity), sampled)
        generated = self.out[:n, :max_new_tokens].tolist()
        return [_up_to_stop(row, stop_ids) for row in generated]


def _up_to_stop(ids: list[int], stop_ids: set[int]) -> list[int]:
    end = next((i + 1 for i, t in enumerate(ids) if t in stop_ids), len(ids))
    return ids[:end]


def _generator(model, seed: int) -> torch.Generator:
    return torch.Generator(model.get_input_embeddings().weight.device).manual_seed(seed)


def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int], temperature: float = 0.0,
                   seed: int = 0, capture: bool | None = None, bucket: int = BUCKET) -> list[list[int]]:  # fmt: skip
    """Generated ids per prompt (up to and including the first stop id, or max_new_tokens ids), all prompts in
    one batch: greedy at temperature 0, else sampled with `seed`. capture: CUDA graphs (None = on CUDA)."""
    width = max(len(x) for x in prompts)
    decoder = BatchDecoder(model, len(prompts), width + max_new_tokens, bucket, capture)
    return decoder.generate(prompts, max_new_tokens, stop_ids, temperature, _generator(model, seed))


def batches_by_length(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices into `prompts`, longest first, cut into batches of `batch_size`: prompts of a batch have close
    lengths (little padding); the indices give each result its original place."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def generate_all(model, prompts: list[list[int]], batch_size: int, max_new_tokens: int, stop_ids: set[int],
                 temperature: float = 0.0, seed: int = 0, capture: bool | None = None,
                 bucket: int = BUCKET) -> list[list[int]]:  # fmt: skip
    """`generate_batch` over any number of prompts, `batch_size` at a time (batches_by_length), through one
    decoder (one cache, graphs captured once); results in the order of `prompts`."""
    batches = batches_by_length(prompts, batch_size)
    width = max(len(x) for x in prompts)
    decoder = BatchDecoder(model, len(batches[0]), width + max_new_tokens, bucket, capture)
    generator = _generator(model, seed)
    results: list[list[int]] = [[] for _ in prompts]
    for rows in batches:
        outs = decoder.generate([prompts[i] for i in rows], max_new_tokens, stop_ids, temperature, generator)
        for i, ids in zip(rows, outs):
            results[i] = ids
    return results


def throughput(model, batch_size: int, prompt_len: int, new_tokens: int, temperature: float = 0.0,
               bucket: int = BUCKET, capture: bool | None = None) -> float:  # fmt: skip
    """New tokens per second of `batch_size` random prompts of `prompt_len` ids, `new_tokens` each, no stop ids.
    A first batch captures every bucket's graph; the second, timed, replays them."""
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = torch.randint(vocab, (batch_size, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    decoder = BatchDecoder(model, batch_size, prompt_len + new_tokens, bucket, capture)
    generator = _generator(model, 0)
    cuda = decoder.w.device.type == "cuda"
    decoder.generate(prompts, new_tokens, set(), temperature, generator)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    decoder.generate(prompts, new_tokens, set(), temperature, generator)  # ends on the host: synchronized
    if cuda:
        torch.cuda.synchronize()
    return batch_size * new_tokens / (time.perf_counter() - start)


SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, hidden_act="silu",
)  # fmt: skip
CONFIGS = {"smollm2": SMOLLM2_135M}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Tokens/s of batched generation from a random-weight base.")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="smollm2")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--bucket", type=int, default=BUCKET)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-capture", action="store_true", help="run the decode steps eagerly")
    args = parser.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**CONFIGS[args.config])).to(getattr(torch, args.dtype)).eval()
    rate = throughput(model, args.batch, args.prompt_len, args.new_tokens, args.temperature, args.bucket,
                      False if args.no_capture else None)  # fmt: skip
    print(f"{args.config} {args.dtype} on {args.device}: batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens: {rate:,.0f} new tokens/s")  # fmt: skip


if __name__ == "__main__":
    main()
