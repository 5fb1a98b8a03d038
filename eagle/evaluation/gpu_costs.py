"""What a GPU round costs: steps, verify passes, EAGLE rounds, launches and host syncs per round, attention by
context, and HF `generate` beside them, on bases built from a configuration with random weights.

    python -m eagle.evaluation.gpu_costs --bases smollm2-135m,llama-3.2-1b,llama-3.1-8b --out out/gpu

Speed does not depend on the weights' values, so nothing is downloaded: each base is built from its published
configuration (random weights), its head is a random EAGLE-3 head of the published heads' shape (the embedded
default's own head for `smollm2-135m`). Acceptance on random weights is meaningless, so a round's cost is measured
at a fixed tree and the speedup is *projected*: tau x vanilla step / round, at the tau named per base (measured
on the CPU for the embedded default's head, published for the others). Every generation runs a fixed number of
tokens (no stop ids). The graphed path is the app's on CUDA (cuda_graphs.py); `--device cpu` runs the same code
with capture off, as the tests do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from eagle.runtime.cuda_graphs import CAPACITY  # positions of the graphs' caches: a timed context + its rows fit
from eagle.shipped import ASSETS



def llama3_rope(factor: float) -> dict:
    """Llama 3.x's rotary scaling (rope_type llama3), `factor` the base's own."""
    return dict(rope_type="llama3", rope_theta=500000.0, factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)


# transformers LlamaConfig fields of each base, the tau its projection uses and where that tau comes from
BASES = {
    "smollm2-135m": dict(
        config=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                    rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5),
        head=ASSETS / "smollm2-eagle3", dtype="float16",
        tau=2.92, tau_source="the shipped head, 80 MT-bench first turns at 60/7/10 (docs/benchmarks.md)"),
    "llama-3.2-1b": dict(
        config=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                    rope_parameters=llama3_rope(32.0),
                    max_position_embeddings=131072, rms_norm_eps=1e-5),
        head=dict(intermediate_size=8192, draft_vocab_size=32000), dtype="bfloat16",
        tau=6.0, tau_source="the published EAGLE-3 heads' order of magnitude (about 6 at 60/7/10)"),
    "llama-3.1-8b": dict(
        config=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                    rope_parameters=llama3_rope(8.0),
                    max_position_embeddings=131072, rms_norm_eps=1e-5),
        head=dict(intermediate_size=14336, draft_vocab_size=32000), dtype="bfloat16",
        tau=6.13, tau_source="EAGLE-3 paper, LLaMA-3.1-8B, MT-bench, T=0"),
}  # fmt: skip
TREE = (60, 7, 10)  # total_token, depth, top_k: EAGLE-2's GPU default
# trees whose graphed round is timed (`round_trees`), with the tau the head's acceptance profile predicts for each
ROUND_TREES = ((60, 7, 10), (32, 6, 8), (24, 5, 6), (16, 4, 4), (10, 3, 3))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, repeats: int = 20, warmup: int = 3, calls: int = 1) -> float:
    """Median ms of `fn` over `repeats` timings of `calls` calls each between syncs (per call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - t0) / calls)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------------------
def build_base(name: str, dtype: torch.dtype, device: torch.device, scale: int = 1):
    """The base from its configuration, random weights, on `device`. scale > 1: a tiny base of the vocabulary / scale (tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(BASES[name]["config"])
    if scale > 1:
        fields.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=fields["vocab_size"] // scale)
    config = LlamaConfig(**fields, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in its dtype: an 8B base made in float32 first would need 32 GB more
    try:
        with torch.device(device):
            base = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return base.eval()


def random_head_state(base, fields: dict) -> tuple[dict, dict]:
    """(config, state) of a random EAGLE-3 head for `base` in the reference layout (d2t/t2d for its vocabulary)."""
    from eagle.models.draft_head import DraftConfig, DraftHead

    c = base.config
    draft_vocab = min(fields["draft_vocab_size"], c.vocab_size)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": min(fields["intermediate_size"], c.intermediate_size), "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
              "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": 8192,
              "rope_theta": 500000.0, "vocab_size": c.vocab_size, "draft_vocab_size": draft_vocab}  # fmt: skip
    head = DraftHead(DraftConfig.from_dict(config, True), own_embedding=False)  # on CPU, as a checkpoint loads
    state = dict(head.state_dict())
    used = torch.arange(draft_vocab) * (c.vocab_size // draft_vocab)  # [draft vocab]
    state["d2t"] = used - torch.arange(draft_vocab)
    state["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, used, True)
    return config, state


def build_model(name: str, dtype: torch.dtype, device: torch.device, scale: int = 1):
    """EaModel of the random base and its head (the shipped one for the embedded default), tree 60/7/10."""
    from eagle.model.ea_model import EaModel, load_head
    from eagle.models.checkpoint import read_checkpoint

    spec = BASES[name]
    base = build_base(name, dtype, device, scale)
    head_spec = spec["head"]
    if isinstance(head_spec, Path) and scale == 1:
        config, state = read_checkpoint(str(head_spec))
    else:
        config, state = random_head_state(base, head_spec if isinstance(head_spec, dict) else
                                          {"intermediate_size": 1536, "draft_vocab_size": 8192})  # fmt: skip
    head = load_head(base, config, state, True, dtype)
    total, depth, top_k = TREE
    return EaModel(base, head, None, total, depth, top_k)


def graph(model, capture: bool, direct: bool = False) -> dict:
    """The graphed rounds in use: on CUDA the app's route (compiling.compile_rounds with --compile on: CUDA graphs of
    the base's passes and the head's steps, timed against eager once), then the greedy round's own graphs for the
    tree (cuda_round.py: draft, verify, keep); with capture off the same runners built directly (what the tests
    do). Returns what it said and the seconds it took."""
    from eagle.decoding.draft import HeadStep
    from eagle.model.compiling import compile_rounds
    from eagle.runtime.cuda_graphs import BUCKETS, DRAFT_BUCKETS, GraphedDecode, GraphedDraft

    t0, lines = time.perf_counter(), []
    if capture and not direct:
        model.runtime = replace(model.runtime, compile="on")
        in_use = compile_rounds(model, lines.append)
    else:
        model.base.compiled = GraphedDecode(model.base, BUCKETS, CAPACITY, capture)
        model.compiled_draft = GraphedDraft(HeadStep(model.ea_layer, model.base.lm_head), DRAFT_BUCKETS, CAPACITY,
                                            capture)  # fmt: skip
        model.base.compiled.warm(lines.append)
        model.compiled_draft.warm(lines.append)
        in_use = True
    if in_use:
        model.try_compile_round(lines.append)
    return {"in_use": in_use, "seconds": time.perf_counter() - t0, "log": lines}


@contextlib.contextmanager
def forward_graphs_only(model):
    """EAGLE rounds on the forwards' graphs alone (a graph per base pass and per draft level, the tree's selection
    eager between them: the path before the round's own graphs), for comparison in the same run; the rounds' graphs
    in use before are back after it."""
    saved = dict(model.compiled_rounds)
    model.compiled_rounds.clear()
    try:
        yield
    finally:
        model.compiled_rounds.clear()
        model.compiled_rounds.update(saved)


def on_forward_graphs(model, measure):
    """`measure` as a stage run inside `forward_graphs_only`."""

    def stage():
        with forward_graphs_only(model):
            return measure()

    return stage


def inductor_round(model, tree: tuple = TREE, new: int = 100, prompt: int = 64) -> dict:
    """The vanilla step and the `tree` round as CUDA graphs of inductor's kernels (each graph compiled, then captured),
    beside the same graphs of eager kernels (the ones in use), in one span of keys (prompt + new within the first):
    tokens/s, ms per forward, the round in vanilla steps, and whether EAGLE's tokens equal vanilla's."""
    from eagle.decoding.generate import TreeSpec

    ids = prompt_ids(model.base.vocab_size, prompt)
    before = model.base.compiled, model.tree
    out = {}
    try:
        with forward_graphs_only(model):  # the rounds' graphs in use come back after it
            model.tree = TreeSpec(*tree)
            for kernels in ("eager", "inductor"):
                out[kernels] = graphed_round(model, ids, new, inductor=kernels == "inductor")
                log(f"{kernels} kernels: {json.dumps(out[kernels])}")  # in the log if a later compile runs out of time
    finally:
        model.base.compiled, model.tree = before
    return out


def graphed_round(model, ids: torch.Tensor, new: int, inductor: bool) -> dict:
    """Vanilla and EAGLE on freshly built graphs of the 1-row step and of the round for the tree in use (inductor's
    kernels or eager ones), and whether their tokens agree."""
    from eagle.decoding.draft import HeadStep
    from eagle.runtime.cuda_graphs import GraphedDecode
    from eagle.runtime.cuda_round import CudaRound

    shape = model.shape_of(model.tree)
    model.base.compiled = GraphedDecode(model.base, (1,), CAPACITY, inductor=inductor)
    model.compiled_rounds[shape] = CudaRound(model.base, HeadStep(model.ea_layer, model.base.lm_head), shape)
    t0 = time.perf_counter()
    vanilla = engine_tokens_per_s(model, ids, new, eagle=False)
    eagle = engine_tokens_per_s(model, ids, new, eagle=True)
    same = (model.eagenerate(ids, max_new_tokens=new, stop_token_ids=[]).tolist()
            == model.naivegenerate(ids, max_new_tokens=new, stop_token_ids=[]).tolist())  # fmt: skip
    return {"vanilla": vanilla, "eagle": eagle, "seconds": time.perf_counter() - t0,
            "round_in_steps": eagle["ms_per_forward"] / vanilla["ms_per_forward"], "eagle_equals_vanilla": same}


def round_trees(model, ids: torch.Tensor, new: int, step_ms: float, tau: float, head) -> dict:
    """Per tree of ROUND_TREES: the graphed round's ms (random weights: about one token a round, so ms per
    forward is a round's cost; the keep step, which runs only when drafts are accepted, is left out), in vanilla
    steps, the tau the head's acceptance profile predicts (the measured tau for TREE where it has none) and the
    projected speedup tau x step / round."""
    from eagle.decoding.generate import TreeSpec
    from eagle.models.checkpoint import read_acceptance_profile
    from eagle.tuning.tuner import expected_tau

    profile = read_acceptance_profile(str(head)) if isinstance(head, Path) else None
    accept = profile["accept"]["0"] if profile else None
    before, out = model.tree, {}
    try:
        for total, depth, top_k in ROUND_TREES:
            model.tree = TreeSpec(total, depth, top_k)
            t0 = time.perf_counter()
            model.compile_round()
            capture_s = time.perf_counter() - t0
            ms = engine_tokens_per_s(model, ids, new, eagle=True)["ms_per_forward"]
            if accept:
                t = expected_tau(accept, total, depth, top_k)
            else:
                t = tau if (total, depth, top_k) == TREE else None
            out[f"{total}/{depth}/{top_k}"] = {
                "round_ms": ms, "round_in_steps": ms / step_ms, "tau": t, "capture_s": capture_s,
                "projected_speedup_vs_vanilla": t * step_ms / ms if t else None}  # fmt: skip
    finally:
        model.tree = before
    return out


# ---------------------------------------------------------------------------------------------------------
def copy_bandwidth(device: torch.device, mib: int = 1024) -> float:
    """Device-to-device copy, bytes read + written per second (the floor's bandwidth)."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats=10)
    return 2 * src.numel() / (ms / 1e3)


def prompt_ids(vocab: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=g)  # [1, length] on CPU, as the engine takes it


def hf_tokens_per_s(base, ids: torch.Tensor, new: int, **kw) -> float:
    ids = ids.to(base.device)

    def run(n):
        base.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                      pad_token_id=0, **kw)  # fmt: skip

    run(new if kw else 8)  # a static cache is sized by the length: warm (compile) at the timed one
    sync(base.device)
    t0 = time.perf_counter()
    run(new)
    sync(base.device)
    return new / (time.perf_counter() - t0)


def engine_tokens_per_s(model, ids: torch.Tensor, new: int, eagle: bool) -> dict:
    gen = model.eagenerate if eagle else model.naivegenerate
    gen(ids, max_new_tokens=8, stop_token_ids=[])
    device = model.base.lm_head.weight.device
    sync(device)
    t0 = time.perf_counter()
    _, tokens, rounds = gen(ids, max_new_tokens=new, stop_token_ids=[], log=True)
    sync(device)
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": tokens / seconds, "ms_per_forward": 1e3 * seconds / (rounds + 1),
            "tokens_per_forward": tokens / (rounds + 1)}  # fmt: skip


@contextlib.contextmanager
def graphed_pass(model, rows: int, context: int):
    """Yields a function running one graphed base pass over `rows` rows after `context` cached positions (as a
    verify pass runs it; the cache cropped back after each), the prefill done before."""
    from eagle.models.masks import additive_mask

    base, graphs = model.base, model.base.compiled
    device = base.input_device
    cache = graphs.lease(context + rows)
    try:
        with torch.inference_mode():
            ids = prompt_ids(base.vocab_size, context + rows).to(device)
            base.forward(ids[:, :context], torch.arange(context, device=device)[None], cache, last_logits_only=True)
            allowed = torch.ones(rows, context + rows, dtype=torch.bool, device=device).tril(context)
            mask = additive_mask(allowed, base.dtype)  # [1, 1, rows, context + rows]
            positions = torch.arange(context, context + rows, device=device)[None]

            def one():
                graphs.run(ids[:, context:], positions, mask, cache, rows > 1)
                cache.crop_to(context)

            yield one
    finally:
        graphs.release(cache)


def pass_ms(model, rows: int, context: int) -> float:
    """Median ms of one graphed base pass over `rows` rows after `context` cached positions."""
    with graphed_pass(model, rows, context) as one:
        return median_ms(one, model.base.input_device)


def replay_kernels(model, rows: int, context: int = 256, passes: int = 20, top: int = 12) -> dict:
    """The kernels inside one graphed base pass (`passes` of them profiled, nothing else): device ms per pass by
    kernel name (top `top`), their count, and the device's total per pass against the wall time of a pass."""
    from torch.profiler import ProfilerActivity, profile

    device = model.base.input_device
    with graphed_pass(model, rows, context) as one:
        wall = median_ms(one, device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(passes):
                one()
            sync(device)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / 1e3 / passes
    kernels = sorted(events, key=lambda e: -e.self_device_time_total)[:top]
    return {"wall_ms": wall, "device_ms": total, "kernels_per_pass": sum(e.count for e in events) / passes,
            "top": {e.key[:80]: round(e.self_device_time_total / 1e3 / passes, 4) for e in kernels}}


def runtime_calls_per_round(model, ids: torch.Tensor, rounds: int = 20) -> dict:
    """Host-side CUDA runtime calls per EAGLE round (graph launches, kernel launches, copies, syncs), from
    torch.profiler's CPU events over `rounds` rounds after the first."""
    from torch.profiler import ProfilerActivity, profile

    stream = model.stream(ids, max_new_tokens=10 * rounds, stop_token_ids=())
    next(stream)
    next(stream)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        done = sum(1 for _, _ in zip(range(rounds), stream))
    stream.close()
    counts: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key
        for label, needle in (("graph_launches", "cudaGraphLaunch"), ("kernel_launches", "cudaLaunchKernel"),
                              ("memcpy", "cudaMemcpy"), ("syncs", "Synchronize"),
                              ("item_reads", "aten::_local_scalar_dense"), ("aten_ops", "aten::")):  # fmt: skip
            if needle in name:
                counts[label] = counts.get(label, 0) + event.count / done
    return counts


def phase_profile(model, ids: torch.Tensor, rounds: int = 40) -> dict:
    """profile.py's phase clock (a sync at every phase boundary) over `rounds` EAGLE rounds, and vanilla steps."""
    from .profile import profile

    args = SimpleNamespace(static=False, general=False, rounds=rounds, max_new_tokens=rounds + 8, temperature=0.0,
                           vanilla=True)  # fmt: skip
    return profile(model, [SimpleNamespace(ids=ids[0].tolist())], args)


def attention_ms(config, dtype, device, context: int, rows: int, capacity: int) -> dict:
    """One layer's attention, ms: as the graphs run it (keys over the whole capacity, KV heads repeated, a float
    mask) against the live prefix only with grouped-query attention (and, for one row, no mask at all)."""
    import torch.nn.functional as F

    H, KV, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.randn(1, H, rows, D, dtype=dtype, device=device)
    k = torch.randn(1, KV, capacity, D, dtype=dtype, device=device)
    v = torch.randn_like(k)
    live = context + rows
    allowed = torch.ones(rows, live, dtype=torch.bool, device=device).tril(context)
    wide = torch.full((1, 1, rows, capacity), torch.finfo(dtype).min, dtype=dtype, device=device)
    wide[0, 0, :, :live].masked_fill_(allowed, 0)
    out = {
        "capacity_repeat_kv": median_ms(lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1), attn_mask=wide), device, calls=50),
        "live_gqa_mask": median_ms(lambda: F.scaled_dot_product_attention(
            q, k[:, :, :live], v[:, :, :live], attn_mask=allowed, enable_gqa=True), device, calls=50),
    }  # fmt: skip
    if rows == 1:
        out["live_gqa_nomask"] = median_ms(lambda: F.scaled_dot_product_attention(
            q, k[:, :, :live], v[:, :, :live], enable_gqa=True), device, calls=50)  # fmt: skip
    return out


def tuned_tree(model, head: Path) -> dict:
    """The tree the tuner picks on this device from the head's acceptance profile (measured pass and draft costs),
    with its predicted tau and tokens/s: the head's real acceptance on this device's costs."""
    from dataclasses import asdict

    from eagle.models.checkpoint import read_acceptance_profile

    model.acceptance = read_acceptance_profile(str(head))["accept"]["0"]
    lines: list[str] = []
    model.tune_tree(lines.append)
    return asdict(model.tree_choice) | {"log": lines[-6:]}


# ---------------------------------------------------------------------------------------------------------
def measure(name: str, device: torch.device, args, save=lambda r: None) -> dict:
    """Every measurement of one base, each in its own stage (a failure is recorded, the next runs); `save(r)`
    after each, so that a run stopped by its time limit keeps what it measured."""
    spec = BASES[name]
    dtype = getattr(torch, args.dtype or spec["dtype"])
    t0 = time.perf_counter()
    model = build_model(name, dtype, device, args.scale)
    base = model.base_model
    weight_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    r: dict = {"base": name, "dtype": str(dtype).removeprefix("torch."), "weight_bytes": weight_bytes,
               "tree": "%d/%d/%d" % TREE, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
               "tau": spec["tau"], "tau_source": spec["tau_source"]}  # fmt: skip
    if device.type == "cuda":
        r["floor_ms"] = 1e3 * weight_bytes / args.bandwidth
    log(f"{name}: built in {time.perf_counter() - t0:.1f} s, {weight_bytes / 1e9:.2f} GB of weights")
    ids = prompt_ids(base.config.vocab_size, args.prompt_tokens)
    contexts = sorted({min(c, CAPACITY - max(args.rows, default=64)) for c in args.contexts})  # within the graphs' cache

    def stage(key, fn):
        if args.stages and key not in args.stages:
            return
        t = time.perf_counter()
        try:
            r[key] = fn()
        except Exception as e:  # noqa: BLE001 - one failed measurement must not lose the others
            r[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"{name}: {key} ({time.perf_counter() - t:.1f} s): {json.dumps(r[key])[:400]}")
        project(r)
        save(r)

    stage("hf_generate", lambda: hf_tokens_per_s(base, ids, args.new_tokens))
    stage("graphs", lambda: graph(model, device.type == "cuda", args.direct))
    stage("vanilla", lambda: engine_tokens_per_s(model, ids, args.new_tokens, eagle=False))
    stage("eagle_random_acceptance", lambda: engine_tokens_per_s(model, ids, args.new_tokens, eagle=True))
    stage("eagle_forward_graphs", on_forward_graphs(model, lambda: engine_tokens_per_s(model, ids, args.new_tokens,
                                                                                      eagle=True)))  # fmt: skip
    stage("round_trees", lambda: round_trees(model, ids, args.new_tokens, r["vanilla"]["ms_per_forward"],
                                             spec["tau"], spec["head"] if args.scale == 1 else None))  # fmt: skip
    if "inductor_round" in args.stages:  # named only: a minute or more of compiling per graph on a small host
        stage("inductor_round", lambda: inductor_round(model, args.inductor_tree))
    stage("pass_ms", lambda: {c: {rows: pass_ms(model, rows, c) for rows in args.rows} for c in contexts})
    stage("replay_kernels", lambda: {rows: replay_kernels(model, rows) for rows in (1, max(args.rows))})
    rounds = {} if args.profile_rounds is None else {"rounds": args.profile_rounds}  # else each stage's own
    stage("phases", lambda: phase_profile(model, ids, **rounds))
    stage("runtime_calls_per_round", lambda: runtime_calls_per_round(model, ids, **rounds))
    stage("runtime_calls_per_round_forward_graphs",
          on_forward_graphs(model, lambda: runtime_calls_per_round(model, ids, **rounds)))  # fmt: skip
    stage("attention_ms", lambda: {c: {rows: attention_ms(base.config, dtype, device, c, rows, CAPACITY + 64)
                                       for rows in (1, 64)} for c in contexts})  # fmt: skip
    if isinstance(spec["head"], Path) and args.scale == 1:  # the tree the tuner picks here for the real head
        stage("tuned_tree", lambda: tuned_tree(model, spec["head"]))
    if name in args.hf_compile:  # last: its first call compiles for a minute or more
        stage("hf_generate_static_compiled", lambda: hf_tokens_per_s(base, ids, args.new_tokens,
                                                                      cache_implementation="static"))
    return r  # the model goes with this frame: the caller empties CUDA's cache before the next base


def project(r: dict) -> None:
    """Round in vanilla steps and the projected speedup (tau x step / round) from the unprofiled phase run, else
    from the EAGLE run's ms per forward (random weights: about one token a round)."""
    phases, vanilla, eagle = r.get("phases", {}), r.get("vanilla", {}), r.get("eagle_random_acceptance", {})
    round_ms = phases.get("round_ms_unprofiled") or eagle.get("ms_per_forward")
    if round_ms and "ms_per_forward" in vanilla:
        step = vanilla["ms_per_forward"]
        r["round_ms"] = round_ms
        r["round_in_steps"] = round_ms / step
        r["projected_speedup_vs_vanilla"] = r["tau"] / r["round_in_steps"]
        hf = r.get("hf_generate")
        if isinstance(hf, float):
            r["projected_speedup_vs_hf"] = r["projected_speedup_vs_vanilla"] * vanilla["tokens_per_s"] / hf


def table(results: list[dict]) -> str:
    def num(x, fmt="{:.1f}"):
        return fmt.format(x) if isinstance(x, (int, float)) else "–"

    lines = ["| base | hf tok/s | hf static+compile | vanilla tok/s | step ms | floor ms | widest pass (steps) | "
             "round ms (steps) | projected vs vanilla (tau) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        van = r.get("vanilla", {})
        passes = r.get("pass_ms", {})
        c = passes.get(min(passes, default=0), {}) if isinstance(passes, dict) and "error" not in passes else {}
        step = van.get("ms_per_forward")
        wide = c.get(max(c, default=0)) if c else None
        lines.append(
            f"| {r['base']} ({r['dtype']}) | {num(r.get('hf_generate'))} | "
            f"{num(r.get('hf_generate_static_compiled'))} | {num(van.get('tokens_per_s'))} | {num(step, '{:.2f}')} | "
            f"{num(r.get('floor_ms'), '{:.2f}')} | "
            f"{num(wide, '{:.2f}')} ({num(wide / c[1] if wide and c.get(1) else None, '{:.2f}')}) | "
            f"{num(r.get('round_ms'), '{:.2f}')} ({num(r.get('round_in_steps'), '{:.2f}')}) | "
            f"{num(r.get('projected_speedup_vs_vanilla'), '{:.2f}x')} ({r['tau']}) |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m eagle.evaluation.gpu_costs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--bases", default="smollm2-135m", help=f"comma-separated: {', '.join(BASES)}")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--dtype", default=None, help="default: each base's (float16 for the embedded default)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--rows", default="1,8,16,32,64", help="verify pass rows timed")
    p.add_argument("--contexts", default="256,1024,4096", help="cached positions for pass and attention timings")
    p.add_argument("--hf-compile", default="", help="bases to also time HF generate with a static cache + compile")
    p.add_argument("--stages", default="", help="only these stages (comma-separated; 'graphs' is needed by most; "
                   "inductor_round runs only when named)")  # fmt: skip
    p.add_argument("--inductor-tree", default="60/7/10", help="the tree of the inductor_round stage")
    p.add_argument("--direct", action="store_true", help="capture the graphs without the app's timing against eager")
    p.add_argument("--profile-rounds", type=int, default=None, help="EAGLE rounds under the phase clock and under "
                   "torch.profiler (default 40 and 20)")
    p.add_argument("--scale", type=int, default=1, help="divide widths (a quick check of the script on a CPU)")
    p.add_argument("--out", default="out/gpu_costs")
    args = p.parse_args(argv)
    args.rows = [int(x) for x in args.rows.split(",")]
    args.inductor_tree = tuple(int(x) for x in args.inductor_tree.split("/"))
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.hf_compile = set(filter(None, args.hf_compile.split(",")))
    args.stages = set(filter(None, args.stages.split(",")))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__}  # fmt: skip
    if device.type == "cuda":
        args.bandwidth = copy_bandwidth(device)
        env["copy_bandwidth_GBps"] = args.bandwidth / 1e9
    log(json.dumps(env))
    results = []

    def save(r):
        (out / "gpu_costs.json").write_text(json.dumps({"env": env, "results": results + [r]}, indent=1) + "\n")

    for name in args.bases.split(","):
        results.append(measure(name, device, args, save))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(table(results))
    return results


if __name__ == "__main__":
    main()
