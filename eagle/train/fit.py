"""`fit`: train a draft head from prepared caches (no base model needed), on CPU or GPUs through accelerate.

    python -m eagle.train fit --data NAME [--data NAME2] --out DIR --recipe eagle3 --steps 20000 --lr 3e-4
    accelerate launch -m eagle.train fit ...            # several GPUs: data parallel, one process per GPU

DIR receives `checkpoints/step_*.pt` (head + optimizer + scheduler + step; `--resume` continues from the latest),
`log.jsonl` (train and held-out metrics), `best/` (the export with the best held-out greedy chain length `tau`)
and `final/`.
`--export-dir` gets a copy of every new best export (config.json + model.safetensors).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle.models.draft_head import DraftConfig, DraftHead
from eagle.models.logits import logit_transform

from .cpu import keep_freed_memory
from .data import CachedData
from .export import draft_config, export_head, head_state
from .losses import DraftTrainer, summarize
from .vocab import coverage, draft_vocab, token_counts


@dataclass
class FitConfig:
    data: list[str]
    out: str
    recipe: str = "eagle3"  # or "eagle1" (EAGLE-1/2)
    steps: int | None = None  # optimizer steps; None = `epochs` passes over the training split
    epochs: float = 1.0
    lr: float = 1e-4
    warmup: int | None = None  # None = 3% of the steps
    min_lr_ratio: float = 0.1  # cosine decay to lr * this
    batch_tokens: int = 4096  # padded tokens per micro-batch (per process)
    grad_accum: int = 1
    max_len: int | None = None  # truncate samples (None = as prepared)
    clip: float = 0.5  # gradient-norm clip
    ttt_steps: int = 7  # EAGLE-3 unrolled steps (also the eval depth of EAGLE-1/2 chains)
    decay: float = 0.8  # EAGLE-3 step weight decay
    p_weight: float = 0.1  # EAGLE-1/2 weight of the token loss
    objective: str = "ce"  # EAGLE-3: "ce" (soft cross-entropy) or "accept" (losses.py: -log acceptance)
    accept_temperature: float = 0.0  # the decoding temperature "accept" aims at
    noise: float | None = None  # EAGLE-1/2 feature noise width; None = 0.2 for eagle1, 0 for eagle3
    draft_vocab_size: int = 32000  # EAGLE-3 (capped at the base vocabulary)
    intermediate_size: int | None = None  # None = the base's
    bias: bool = True  # EAGLE-1/2 fc bias
    include_embedding: bool = True  # EAGLE-1/2: ship embed_tokens.weight, as the reference does
    init_from: str | None = None  # start from an exported head folder or a checkpoints/step_*.pt
    revocab: bool = False  # EAGLE-3 with init_from: re-derive the draft vocabulary from this data (`revocab`)
    lm_head_init: str = "base"  # EAGLE-3: "base" = base lm_head rows (+ 0.1 x its final norm); "random" = reference
    eval_samples: int = 64  # held out from the end of each dataset (at most 10% of it)
    eval_every: int = 200
    save_every: int = 500
    keep_checkpoints: int = 2
    log_every: int = 10
    resume: bool = False
    max_minutes: float | None = None  # stop (checkpoint, evaluate, export) after this much training time
    export_dir: str | None = None
    export_dtype: str = "fp16"
    base_model_path: str | None = None  # enables `eval_generate`
    eval_generate: int = 0  # prompts for a real eagenerate acceptance measurement at each eval
    eval_max_new_tokens: int = 64
    mixed_precision: str = "auto"  # auto = bf16 (GPU with bf16, or CPU), else no
    seed: int = 0
    threads: int | None = None
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------
# Data
def make_batches(lengths: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """Shuffle, then group samples of similar length so that batch_size * longest <= batch_tokens."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    for c in range(0, len(order), 512):
        chunk = sorted(order[c : c + 512], key=lambda i: -lengths[i])
        cur, longest = [], 0
        for i in chunk:
            if cur and max(longest, lengths[i]) * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, lengths[i])
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, rank: int, world: int, n: int) -> list[list[int]]:
    """This process's n batches of one epoch. Every epoch has the same n (steps map to epochs by division):
    an epoch whose shuffle groups into fewer batches repeats its first ones, one that groups into more drops
    its last ones."""
    local = make_batches(lengths, batch_tokens, seed)[rank::world]
    if not local:
        raise ValueError(f"an epoch grouped into fewer batches than the {world} processes: lower --batch-tokens")
    while len(local) < n:
        local += local[: n - len(local)]
    return local[:n]


def collate(items: list[dict], eagle3: bool, device, max_len: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad samples into a batch. -> input_ids, loss_mask, argmax [B, T]; lengths [B]; hidden [B, T, H];
    features [B, T, F] (EAGLE-3: the taps; EAGLE-1/2: the hidden state), floats in fp32."""
    lengths = [min(len(it["input_ids"]), max_len or 1 << 30) for it in items]
    B, T = len(items), max(lengths)
    H = items[0]["hidden"].shape[-1]
    batch = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "loss_mask": torch.zeros(B, T, dtype=torch.bool),
        "argmax": torch.zeros(B, T, dtype=torch.long),
        "hidden": torch.zeros(B, T, H),
        "lengths": torch.tensor(lengths),
    }
    if eagle3:
        batch["features"] = torch.zeros(B, T, items[0]["taps"].shape[-1])
    for b, (it, n) in enumerate(zip(items, lengths)):
        for key in ("input_ids", "loss_mask", "argmax", "hidden"):
            batch[key][b, :n] = it[key][:n]
        if eagle3:
            batch["features"][b, :n] = it["taps"][:n]
    if not eagle3:
        batch["features"] = batch["hidden"]
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class Items:
    """The samples of several caches as one list of (dataset, index), split into train and held-out parts."""

    def __init__(self, names: list[str], eval_samples: int, max_len: int | None):
        self.sets = [CachedData(n) for n in names]
        base = self.sets[0].meta
        for d in self.sets[1:]:
            if (d.meta["hidden_size"], d.meta["vocab_size"]) != (base["hidden_size"], base["vocab_size"]):
                raise ValueError(f"{d.root} was prepared from another base model than {self.sets[0].root}")
        self.train, self.eval = [], []
        for s, d in enumerate(self.sets):
            n_eval = min(eval_samples, len(d) // 10)
            self.train += [(s, i) for i in range(len(d) - n_eval)]
            self.eval += [(s, i) for i in range(len(d) - n_eval, len(d))]
        self.max_len = max_len

    def length(self, item) -> int:
        n = self.sets[item[0]].length(item[1])
        return min(n, self.max_len) if self.max_len else n

    def __getitem__(self, item) -> dict:
        return self.sets[item[0]][item[1]]

    def ids_and_masks(self, items):
        for s, i in items:
            yield self.sets[s].ids_and_mask(i)


# ---------------------------------------------------------------------------------------------------------
def build_head(cfg: FitConfig, items: Items, config: dict, log) -> DraftHead:
    """A fresh head (EAGLE-3: vocabulary from the training replies, lm_head/norm from the base's), or the head in
    `cfg.init_from` (an exported folder or a training checkpoint; its draft vocabulary is kept, or re-derived with
    `cfg.revocab`, at `cfg.draft_vocab_size` ids where that differs from the head's)."""
    eagle3 = cfg.recipe == "eagle3"
    head = DraftHead(DraftConfig.from_dict(config, eagle3), own_embedding=False)
    # reply-token frequencies of the training split (one pass over the data): the vocabulary and its coverage
    counts = token_counts(items.ids_and_masks(items.train), config["vocab_size"]) if eagle3 else None
    if cfg.init_from:
        from eagle.models.checkpoint import read_checkpoint

        if cfg.init_from.endswith(".pt"):  # a training checkpoint (checkpoints/step_*.pt)
            state = torch.load(cfg.init_from, map_location="cpu", weights_only=False)["head"]
        else:
            _, state = read_checkpoint(cfg.init_from)
        state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}
        own = head.state_dict()
        old = None  # (lm_head rows [N0, H], their target ids [N0]) of a head whose vocabulary is resized
        if eagle3 and state["lm_head.weight"].shape[0] != own["lm_head.weight"].shape[0]:
            n0, n = state["lm_head.weight"].shape[0], own["lm_head.weight"].shape[0]
            if not cfg.revocab:
                raise ValueError(f"{cfg.init_from}: its draft vocabulary has {n0} ids, --draft-vocab-size {n}: add "
                                 f"--revocab to re-derive it at the new size, or ask for {n0}")  # fmt: skip
            rows, d2t = state.pop("lm_head.weight"), state.pop("d2t")
            state.pop("t2d")
            old = (rows.float(), torch.arange(n0) + d2t)
            state |= {k: own[k] for k in ("lm_head.weight", "d2t", "t2d")}  # replaced by revocab below
        head.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=True)
        log(f"initialised from {cfg.init_from}")
        if eagle3 and cfg.revocab:
            revocab(head, counts, items.sets[0].base_weights()["lm_head"], log, old)
    elif eagle3:
        base = items.sets[0].base_weights()
        d2t, t2d = draft_vocab(counts, config["draft_vocab_size"])
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        if cfg.lm_head_init == "base":  # start from the base's own output layer, restricted to the draft vocabulary
            with torch.no_grad():
                head.lm_head.weight.copy_(base["lm_head"][head.to_target_ids(torch.arange(d2t.numel()))].float())
                # A tenth of the base's final-norm weight: the same output geometry, but soft initial predictions
                # (the full weight starts confidently wrong: ~15 nats of cross-entropy, and learns slower).
                head.norm.weight.copy_(base["norm"].float() * 0.1)
    if eagle3:
        log(f"draft vocabulary: {config['draft_vocab_size']} of {config['vocab_size']} ids, covering "
            f"{coverage(counts, head.t2d):.2%} of the {int(counts.sum())} training reply tokens")  # fmt: skip
    return head


@torch.no_grad()
def revocab(head: DraftHead, counts: torch.Tensor, base_lm_head: torch.Tensor, log,
            old: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:  # fmt: skip
    """Re-derive a trained EAGLE-3 head's draft vocabulary from `counts` [V], at the head's size N. An id kept keeps
    its trained lm_head row; a new id starts from the base's output row [H], scaled to the trained rows' median norm.
    old: the trained (rows [N0, H], target ids [N0]) where the head was built at another size (default: its own)."""
    size = head.d2t.numel()
    if old is None:
        old = (head.lm_head.weight.detach().clone(), head.to_target_ids(torch.arange(size)))
    old_rows, old_ids = old  # [N0, H], [N0]
    before = counts[old_ids].sum().item() / max(counts.sum().item(), 1)
    d2t, t2d = draft_vocab(counts, size)
    new_ids = torch.arange(size) + d2t  # [N]
    row_of = torch.full((counts.numel(),), -1, dtype=torch.long)
    row_of[old_ids] = torch.arange(len(old_ids))
    kept = row_of[new_ids]  # [N] old row of each new draft id, -1 = new id
    base_rows = base_lm_head[new_ids].float()  # [N, H]
    shared = kept >= 0
    scale = old_rows[kept[shared]].norm(dim=1).median() / base_rows[shared].norm(dim=1).median()
    rows = torch.where(shared[:, None], old_rows[kept.clamp(min=0)], base_rows * scale)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    head.lm_head.weight.copy_(rows.to(head.lm_head.weight.dtype))
    log(f"draft vocabulary re-derived: {len(old_ids)} -> {size} ids, {int(shared.sum())} kept, coverage of the "
        f"training replies {before:.2%} -> {coverage(counts, t2d):.2%}")


def lr_lambda(warmup: int, total: int, min_ratio: float, time_spent=lambda: 0.0):
    """Linear warmup, then cosine decay to `min_ratio`, as far along as the steps or `time_spent()` (the share of a
    time budget used, 0..1) say, whichever is further: a run stopped by its time budget ends at the low rate."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, max((step - warmup) / max(1, total - warmup), time_spent()))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def latest_checkpoint(out: Path) -> Path | None:
    found = sorted((out / "checkpoints").glob("step_*.pt"))
    return found[-1] if found else None


class GenerateEval:
    """Mean accepted tokens per base forward from real `eagenerate` calls with the current head."""

    def __init__(self, base_path: str, prompts: list[torch.Tensor], max_new_tokens: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(base_path)
        self.base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
        self.prompts, self.max_new_tokens = prompts, max_new_tokens

    def __call__(self, head: DraftHead, config: dict) -> float:
        from eagle.model.ea_model import EaModel, load_head

        draft = load_head(self.base, config, head_state(head, torch.float32))
        model = EaModel(self.base, draft, self.tokenizer)
        new = forwards = 0
        for p in self.prompts:
            _, n, rounds = model.eagenerate(p[None], max_new_tokens=self.max_new_tokens, log=True)
            new, forwards = new + n, forwards + rounds + 1
        return new / max(forwards, 1)


# ---------------------------------------------------------------------------------------------------------
def fit(cfg: FitConfig, log=print) -> Path:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from tqdm.auto import tqdm

    if cfg.recipe not in ("eagle3", "eagle1"):
        raise ValueError(f"recipe must be eagle3 or eagle1 (EAGLE-1/2), got {cfg.recipe!r}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    eagle3 = cfg.recipe == "eagle3"
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else "no"
    # A second fit in the same process (tests, notebooks) may change these process-wide settings.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    # cpu=True without CUDA: lets `torchrun` run data-parallel CPU processes (gloo)
    acc = Accelerator(mixed_precision=mp, gradient_accumulation_steps=cfg.grad_accum,
                      cpu=not torch.cuda.is_available())  # fmt: skip
    if acc.device.type == "cpu":
        keep_freed_memory()
    main = acc.is_main_process
    say = log if main else (lambda *a, **k: None)
    torch.manual_seed(cfg.seed + acc.process_index)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    items = Items(cfg.data, cfg.eval_samples, cfg.max_len)
    if eagle3 and not all(d.has_taps for d in items.sets):
        raise ValueError("EAGLE-3 needs caches prepared with --recipe eagle3 (they store the 3 feature taps)")
    meta = items.sets[0].meta
    n_tokens = sum(items.length(i) for i in items.train)
    say(f"data: {len(items.train)} training samples ({n_tokens} tokens), {len(items.eval)} held out")

    ckpt_path = latest_checkpoint(out) if cfg.resume else None
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False) if ckpt_path else None
    if ckpt is not None:
        config = ckpt["config"]
        head = DraftHead(DraftConfig.from_dict(config, eagle3), own_embedding=False)
        head.load_state_dict(ckpt["head"])
        say(f"resuming from {ckpt_path} (step {ckpt['step']})")
    else:
        config = draft_config(meta["base_config"] | {"vocab_size": meta["vocab_size"]}, cfg.recipe,
                              cfg.draft_vocab_size, cfg.intermediate_size, cfg.bias)  # fmt: skip
        head = build_head(cfg, items, config, say)
    base = items.sets[0].base_weights()
    noise = cfg.noise if cfg.noise is not None else (0.0 if eagle3 else 0.2)
    transform = logit_transform(meta["base_config"], meta.get("base_model_type"))  # soft targets: the base's logits
    trainer = DraftTrainer(head, base["embed"], base["lm_head"], cfg.ttt_steps, cfg.decay, cfg.p_weight, noise,
                           transform, cfg.objective, cfg.accept_temperature)  # fmt: skip
    embedding = base["embed"] if (not eagle3 and cfg.include_embedding) else None
    del base
    n_params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    say(f"head: {cfg.recipe}, {n_params / 1e6:.2f}M trainable parameters; mixed precision {mp}; "
        f"{acc.num_processes} process(es) on {acc.device}")  # fmt: skip

    lengths = [items.length(i) for i in items.train]
    per_epoch = len(make_batches(lengths, cfg.batch_tokens, cfg.seed)) // acc.num_processes // cfg.grad_accum
    if per_epoch == 0:
        raise ValueError("not enough training data for one optimizer step: lower --batch-tokens or --grad-accum")
    total = cfg.steps or max(1, math.ceil(cfg.epochs * per_epoch))
    warmup = cfg.warmup if cfg.warmup is not None else max(1, int(0.03 * total))
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    started: list[float] = []  # when training began (set below), for the time-bounded decay

    def time_spent() -> float:
        return (time.time() - started[0]) / (60 * cfg.max_minutes) if started and cfg.max_minutes else 0.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup, total, cfg.min_lr_ratio, time_spent))
    trainer, optimizer = acc.prepare(trainer, optimizer)  # the scheduler steps once per optimizer step, by hand
    step, best = 0, -1.0
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        step, best = ckpt["step"], ckpt["best"]
    del ckpt
    raw = acc.unwrap_model(trainer)

    generate_eval = None
    if cfg.eval_generate and cfg.base_model_path and main:
        prompts = []
        for it in items.eval[: cfg.eval_generate]:
            ids, mask = items.sets[it[0]].ids_and_mask(it[1])
            first = int(mask.nonzero()[0]) if mask.any() else len(ids)
            prompts.append(ids[: max(1, min(first, 512))])
        generate_eval = GenerateEval(cfg.base_model_path, prompts, cfg.eval_max_new_tokens)

    def evaluate() -> dict:
        raw.eval()
        sums: dict[str, torch.Tensor] = {}
        eval_batches = make_batches([items.length(i) for i in items.eval], cfg.batch_tokens, 0)
        with torch.no_grad(), acc.autocast():
            for b in eval_batches[acc.process_index :: acc.num_processes]:
                batch = collate([items[items.eval[i]] for i in b], eagle3, acc.device, cfg.max_len)
                _, stats = raw(batch, steps=cfg.ttt_steps)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0) + v.float()
        keys = sorted(summarize_keys(raw, cfg))
        vec = torch.stack([torch.as_tensor(sums.get(k, 0.0), device=acc.device).float() for k in keys])
        vec = acc.reduce(vec, reduction="sum")
        result = summarize(dict(zip(keys, vec.tolist())))
        if generate_eval is not None:
            result["tokens_per_forward"] = generate_eval(raw.head, config)
        raw.train()
        return result

    def export(folder: Path) -> None:
        export_head(raw.head, config, folder, cfg.export_dtype, embedding)

    def save_checkpoint() -> None:
        if not main:
            return
        state = {"head": raw.head.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "step": step, "best": best, "config": config,
                 "fit": asdict(cfg)}  # fmt: skip
        folder = out / "checkpoints"
        folder.mkdir(exist_ok=True)
        tmp = folder / f"step_{step:08d}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, folder / f"step_{step:08d}.pt")
        for old in sorted(folder.glob("step_*.pt"))[: -cfg.keep_checkpoints]:
            old.unlink()

    def record(kind: str, metrics: dict) -> None:
        if main:
            with open(out / "log.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "kind": kind, "time": time.time(), **metrics}) + "\n")

    def eval_and_export() -> dict:
        nonlocal best
        metrics = evaluate()
        record("eval", metrics)
        score = metrics["tau"]  # over every held-out reply position; tokens_per_forward (few prompts) is noisier
        if main:
            say(f"step {step}: held-out " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
            if score > best:
                best = score
                export(out / "best")
                (out / "best" / "eval.json").write_text(json.dumps({"step": step, **metrics}, indent=1))
                if cfg.export_dir:
                    export(Path(cfg.export_dir))
                say(f"step {step}: new best {score:.4f}, exported to {out / 'best'}"
                    + (f" and {cfg.export_dir}" if cfg.export_dir else ""))  # fmt: skip
        return metrics

    if step == 0 and items.eval:
        eval_and_export()
    bar = tqdm(total=total, initial=step, disable=not main, desc=f"fit {cfg.recipe}", dynamic_ncols=True)
    window: dict[str, float] = {}
    t0, tokens_seen = time.time(), 0
    started.append(t0)

    def out_of_time() -> bool:
        return cfg.max_minutes is not None and time.time() - t0 > 60 * cfg.max_minutes

    trainer.train()
    while step < total:
        epoch, done = divmod(step, per_epoch)
        local = epoch_batches(lengths, cfg.batch_tokens, cfg.seed + epoch, acc.process_index, acc.num_processes,
                              per_epoch * cfg.grad_accum)  # fmt: skip
        for b in local[done * cfg.grad_accum :]:
            batch = collate([items[items.train[i]] for i in b], eagle3, acc.device, cfg.max_len)
            tokens_seen += int(batch["lengths"].sum())
            with acc.accumulate(trainer):
                loss, stats = trainer(batch)
                acc.backward(loss)
                if acc.sync_gradients and cfg.clip:
                    acc.clip_grad_norm_(params, cfg.clip)
                optimizer.step()
                optimizer.zero_grad()
            for k, v in stats.items():
                window[k] = window.get(k, 0.0) + float(v)
            if not acc.sync_gradients:
                continue
            scheduler.step()
            step += 1
            bar.update(1)
            if step % cfg.log_every == 0 or step == total:
                m = summarize(window)
                rate = tokens_seen / (time.time() - t0)
                bar.set_postfix(loss=f"{m.get('loss_0', 0):.3f}", acc0=f"{m.get('acc_0', 0):.3f}",
                                tau=f"{m.get('tau', 0):.2f}", lr=f"{scheduler.get_last_lr()[0]:.1e}",
                                tok_s=f"{rate:.0f}", refresh=False)  # fmt: skip
                record("train", {**m, "lr": scheduler.get_last_lr()[0], "tokens_per_s": rate})
                window = {}
            if step % cfg.save_every == 0:
                save_checkpoint()
            if step % cfg.eval_every == 0 and items.eval:
                eval_and_export()
            if step >= total or out_of_time():
                break
        if out_of_time():
            say(f"stopping at step {step} of {total}: --max-minutes {cfg.max_minutes} reached")
            break
    bar.close()
    if step % cfg.save_every:
        save_checkpoint()
    if step % cfg.eval_every and items.eval:
        eval_and_export()
    if main:
        export(out / "final")
        if best < 0 and cfg.export_dir:  # nothing held out: ship the last head
            export(Path(cfg.export_dir))
    acc.wait_for_everyone()
    say(f"done: {step} steps; best held-out {best:.4f}; exports in {out}")
    return out


def summarize_keys(trainer: DraftTrainer, cfg: FitConfig) -> list[str]:
    """The metric names `DraftTrainer` returns for an eval pass (so every process reduces the same vector)."""
    keys = ["chain_accepted", "chain_starts"]
    for k in range(cfg.ttt_steps):
        keys += [f"correct_{k}", f"live_{k}"]
        if trainer.eagle3:
            keys += [f"loss_{k}", f"kept_{k}"]
    if not trainer.eagle3:
        keys += ["loss_0", "vloss", "ploss"]
    return keys
