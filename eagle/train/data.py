"""`prepare`: run the base once per conversation and cache what training needs; `CachedData` reads it back.

A cache is a folder (``$EAGLE_CACHE/train/<name>``, default ``~/.cache/eagle/train/<name>``) holding

    meta.json                    how it was made (base model, template, recipe, max_len, ...), the base's text config
                                 and model type (its logit processing, eagle/models/logits.py, derives from them)
    base.safetensors             embed [V, H], lm_head [V, H] (absent when tied), norm [H]: the frozen base weights
    shard_00000.safetensors ...  samples concatenated along the token axis (offsets [n + 1] delimit them):
        input_ids [N] int32       the conversation tokens x_t
        loss_mask [N] uint8       1 where x_t belongs to an assistant reply (or is its end-of-turn token)
        hidden    [N, H] bf16     the base's post-final-norm last hidden state h_t (its logits: lm_head(h_t));
                                  also the EAGLE-1/2 feature f_t
        argmax    [N] int32       argmax of the base's logits (lm_head(h_t), then its logit processing) over the
                                  full vocabulary: the base's greedy next token
        taps      [N, 3H] bf16    EAGLE-3 only: hidden_states[2], [L//2], [L-3] concatenated (low, mid, high)

Shards are written atomically and skipped when present, so an interrupted `prepare` resumes where it stopped,
and `--part i/n` splits the work over n processes (e.g. one per GPU).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle.models.base import eagle3_feature_layers
from eagle.models.logits import logit_transform

from .cpu import keep_freed_memory
from .export import write_safetensors
from .masks import TemplateError, encode_conversation, make_template
from .regen import regenerate_first_turns, regenerate_replies

FORMAT_VERSION = 1
STORE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
COMPUTE_DTYPES = {**STORE_DTYPES, "fp32": torch.float32, "float32": torch.float32}


def cache_root() -> Path:
    from eagle.fetch import cache_dir

    return cache_dir() / "train"


def data_dir(name: str | os.PathLike) -> Path:
    """A cache name (under `cache_root()`) or an explicit path (anything with a path separator)."""
    name = str(name)
    if os.sep in name or name.startswith("."):
        return Path(name).expanduser()
    return cache_root() / name


# ---------------------------------------------------------------------------------------------------------
# Conversations
def load_conversations(path: str | None = None, limit: int | None = None, skip: int = 0) -> list[list[dict]]:
    """Conversations as message lists. `path`: None = ShareGPT (the pinned PyPI wheel), or a .json / .jsonl
    file of ShareGPT records ({"conversations": [{"from", "value"}...]}) or {"messages": [{"role", "content"}...]}.
    Conversations that hold an MT-bench or repetitive-set prompt are dropped (benchmark_guard.py)."""
    from .benchmark_guard import drop_benchmark_conversations
    from .sharegpt import load_sharegpt, to_messages

    if path is None:
        records = load_sharegpt(limit=None if limit is None else skip + limit)
    else:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()] if path.endswith(".jsonl") else json.load(f)
    convs = []
    for r in records:
        msgs = r.get("messages") if isinstance(r, dict) else r
        if isinstance(r, dict) and msgs is None:
            msgs = to_messages(r.get("conversations"))
        if msgs:
            convs.append(list(msgs))
    convs = convs[skip:]
    convs = convs if limit is None else convs[:limit]
    return drop_benchmark_conversations(convs)  # after skip/limit: the same windows, less any benchmark prompt


def encode_sample(tokenizer, template, messages: list[dict], max_len: int, truncated: bool = False):
    """-> input_ids [T], loss_mask [T] of a conversation; `truncated`: its last reply was cut by a length budget,
    so the end-of-turn token the template adds after it is dropped (the base never wrote it)."""
    ids, mask = encode_conversation(tokenizer, template, messages, max_len)
    if truncated and mask.any():
        end = int(mask.nonzero()[-1])
        ids, mask = ids[:end], mask[:end]
    return ids, mask


# ---------------------------------------------------------------------------------------------------------
# Base model side
class FeatureExtractor:
    """Runs the base once over a whole sequence and returns what the cache stores."""

    def __init__(self, model, eagle3: bool, logits_chunk: int = 256):
        self.model = model
        cfg = model.config.get_text_config()
        self.taps = eagle3_feature_layers(cfg.num_hidden_layers) if eagle3 else None
        self.lm_head = model.get_output_embeddings()
        self.transform = logit_transform(model.config)  # the base's processing after lm_head; None = none
        self.chunk = logits_chunk

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] post-final-norm hidden states -> [n] the base's greedy next tokens (argmax of its own logits)."""
        logits = self.lm_head(hidden)  # [n, V]
        return (logits if self.transform is None else self.transform(logits)).argmax(-1)

    def __call__(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """ids [T] -> hidden [T, H], argmax [T], taps [T, 3H] (EAGLE-3), on the CPU."""
        return self.many([ids], batch_tokens=0)[0]

    @torch.inference_mode()
    def many(self, seqs: list[torch.Tensor], batch_tokens: int) -> list[dict[str, torch.Tensor]]:
        """`__call__` for each of `seqs`, several per forward: sequences of similar length are right-padded into
        batches of at most `batch_tokens` padded tokens (0 = one per forward). Causal attention keeps a row's
        real tokens blind to the padding after them, so no attention mask is needed."""
        device = self.lm_head.weight.device
        kwargs = {"output_hidden_states": list(self.taps)} if self.taps else {}
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        results: list[dict | None] = [None] * len(seqs)
        while order:
            rows = [order.pop()]  # longest first: the batch width
            while order and (len(rows) + 1) * len(seqs[rows[0]]) <= batch_tokens:
                rows.append(order.pop())
            width = len(seqs[rows[0]])
            ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T] right-padded
            for r, i in enumerate(rows):
                ids[r, : len(seqs[i])] = seqs[i]
            out = self.model.get_decoder()(input_ids=ids.to(device), use_cache=False, **kwargs)
            hidden = out.last_hidden_state  # [B, T, H] post final norm
            flat = hidden.flatten(0, 1)
            argmax = torch.cat([self.greedy(h) for h in flat.split(self.chunk)]).view(len(rows), width)
            taps = torch.cat([out.hidden_states[i] for i in self.taps], dim=-1) if self.taps else None  # [B, T, 3H]
            for r, i in enumerate(rows):
                n = len(seqs[i])
                results[i] = {"hidden": hidden[r, :n].cpu(), "argmax": argmax[r, :n].cpu()}
                if taps is not None:
                    results[i]["taps"] = taps[r, :n].cpu()
        return results


# ---------------------------------------------------------------------------------------------------------
@dataclass
class PrepareConfig:
    base_model_path: str
    out: str
    recipe: str = "eagle3"  # "eagle3" stores the 3H taps; "eagle1" (EAGLE-1/2) only the last hidden state
    data_path: str | None = None  # None = ShareGPT
    limit: int | None = None
    skip: int = 0
    max_len: int = 2048
    template: str | None = None  # None = the tokenizer's chat template; "fastchat:<name>"; or a Jinja file
    regenerate: bool = False
    regen_max_new_tokens: int = 512
    regen_temperature: float = 0.0
    regen_batch_size: int = 1  # > 1: regenerate only the first reply, this many conversations per generate call
    dtype: str = "bf16"  # storage dtype of the features
    compute_dtype: str = "auto"  # base weights: auto = bf16 on CPU (fast on CPUs with bf16 units), else the file's
    shard_size: int = 32
    part: str = "0/1"
    device: str | None = None
    extract_batch_tokens: int = -1  # padded tokens per feature forward; -1 = 32768 on a GPU, one sample on CPU
    seed: int = 0

    @property
    def regen_first_turns(self) -> bool:
        """Batched self-distillation: only each conversation's first reply is regenerated."""
        return self.regenerate and self.regen_batch_size > 1


def _meta_key(cfg: PrepareConfig) -> dict:
    keep = ("base_model_path", "recipe", "data_path", "skip", "max_len", "template", "regenerate",
            "regen_max_new_tokens", "regen_temperature", "dtype", "shard_size", "seed")  # fmt: skip
    key = {k: getattr(cfg, k) for k in keep}
    if cfg.regen_first_turns:  # absent: every turn regenerated (or none)
        key["regen_first_turns"] = True
    return key


def _write_shard(path: Path, samples: list[dict], store: torch.dtype) -> None:
    lengths = [s["input_ids"].numel() for s in samples]
    tensors = {
        "offsets": torch.tensor([0] + lengths).cumsum(0),
        "input_ids": torch.cat([s["input_ids"] for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).to(torch.uint8),
        "argmax": torch.cat([s["argmax"] for s in samples]).to(torch.int32),
        "hidden": torch.cat([s["hidden"] for s in samples]).to(store),
    }
    if "taps" in samples[0]:
        tensors["taps"] = torch.cat([s["taps"] for s in samples]).to(store)
    write_safetensors(tensors, path)


def _write_empty_shard(path: Path) -> None:
    write_safetensors({"offsets": torch.zeros(1, dtype=torch.long)}, path)


def prepare(cfg: PrepareConfig, conversations: list | None = None, log=print) -> Path:
    """Format, optionally regenerate, run the base and write the cache. Returns the cache folder.

    `conversations`: message lists, or already tokenized (input_ids [T], loss_mask [T]) tuples; None = load
    them from `cfg.data_path` (ShareGPT by default)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.recipe not in ("eagle3", "eagle1"):
        raise ValueError(f"recipe must be eagle3 or eagle1 (EAGLE-1/2), got {cfg.recipe!r}")
    out = data_dir(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    meta_file = out / "meta.json"
    if meta_file.exists():
        old = json.loads(meta_file.read_text())
        if old.get("prepare") != _meta_key(cfg):
            raise ValueError(f"{out} holds a cache made with other settings ({old.get('prepare')}); use another --out")
    part, parts = (int(x) for x in cfg.part.split("/"))
    torch.manual_seed(cfg.seed)
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        keep_freed_memory()
    dtype = cfg.compute_dtype
    if dtype == "auto":
        dtype = "bf16" if device == "cpu" else "auto"
    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model_path)
    model = AutoModelForCausalLM.from_pretrained(
        cfg.base_model_path, dtype=COMPUTE_DTYPES.get(dtype, "auto")
    ).to(device).eval()  # fmt: skip
    needs_template = conversations is None or any(not isinstance(c, tuple) for c in conversations)
    template = make_template(tokenizer, cfg.template) if needs_template else None
    on_gpu = torch.device(device).type != "cpu"
    extractor = FeatureExtractor(model, eagle3=cfg.recipe == "eagle3", logits_chunk=4096 if on_gpu else 256)
    batch_tokens = cfg.extract_batch_tokens if cfg.extract_batch_tokens >= 0 else (32768 if on_gpu else 0)
    if conversations is None:
        conversations = load_conversations(cfg.data_path, cfg.limit, cfg.skip)
    elif cfg.limit is not None:
        conversations = conversations[: cfg.limit]

    text_cfg = model.config.get_text_config()
    meta = {
        "format": FORMAT_VERSION, "prepare": _meta_key(cfg), "recipe": cfg.recipe, "has_taps": cfg.recipe == "eagle3",
        "feature_layers": list(extractor.taps) if extractor.taps else None, "base_config": text_cfg.to_dict(),
        "base_model_type": model.config.model_type,
        "hidden_size": text_cfg.hidden_size, "vocab_size": extractor.lm_head.weight.shape[0],
        "num_conversations": len(conversations), "complete": False,
    }  # fmt: skip
    if part == 0:
        _save_base_weights(model, out / "base.safetensors")
        meta_file.write_text(json.dumps(meta, indent=1, default=str))
    store = STORE_DTYPES[cfg.dtype]
    n_shards = math.ceil(len(conversations) / cfg.shard_size)
    from tqdm.auto import tqdm

    done_tokens, skipped, t0 = 0, 0, time.time()
    mine = [s for s in range(n_shards) if s % parts == part]
    bar = tqdm(total=sum(min(cfg.shard_size, len(conversations) - s * cfg.shard_size) for s in mine),
               desc=f"prepare {out.name}", unit="conv", dynamic_ncols=True)  # fmt: skip
    for s in mine:
        path = out / f"shard_{s:05d}.safetensors"
        chunk = conversations[s * cfg.shard_size : (s + 1) * cfg.shard_size]
        if path.exists():
            bar.update(len(chunk))
            continue
        if cfg.regen_first_turns:
            convs = [[] if isinstance(m, tuple) else m for m in chunk]  # tokenized samples are kept as they are
            regenerated = regenerate_first_turns(model, tokenizer, template, convs, cfg.max_len,
                                                 cfg.regen_max_new_tokens, cfg.regen_temperature,
                                                 cfg.regen_batch_size)  # fmt: skip
        samples = []
        for c, messages in enumerate(chunk):
            bar.update(1)
            truncated = False
            try:
                if isinstance(messages, tuple):  # already tokenized: (input_ids [T], loss_mask [T])
                    ids, mask = messages[0][: cfg.max_len], messages[1][: cfg.max_len]
                else:
                    if cfg.regen_first_turns:
                        messages, truncated = regenerated[c] or ([], False)
                    elif cfg.regenerate:
                        messages, truncated = regenerate_replies(
                            model, tokenizer, template, messages, cfg.max_len, cfg.regen_max_new_tokens,
                            cfg.regen_temperature,
                        )  # fmt: skip
                    if not messages:
                        skipped += 1
                        continue
                    ids, mask = encode_sample(tokenizer, template, messages, cfg.max_len, truncated)
            except TemplateError:
                skipped += 1
                continue
            if ids.numel() < 4 or mask[2:].sum() == 0:
                skipped += 1
                continue
            samples.append({"input_ids": ids, "loss_mask": mask})
        for sample, features in zip(samples, extractor.many([s["input_ids"] for s in samples], batch_tokens)):
            sample.update(features)
            done_tokens += sample["input_ids"].numel()
        bar.set_postfix(tok_s=f"{done_tokens / (time.time() - t0):.0f}", skipped=skipped, refresh=False)
        if samples:
            _write_shard(path, samples, store)
        else:
            _write_empty_shard(path)
    bar.close()
    if part == 0 and all((out / f"shard_{s:05d}.safetensors").exists() for s in range(n_shards)):
        data = CachedData(out)
        meta.update(complete=True, num_samples=len(data), num_tokens=data.num_tokens())
        meta_file.write_text(json.dumps(meta, indent=1, default=str))
    log(f"prepared {out}: {done_tokens} tokens this run, {skipped} conversations skipped, "
        f"{time.time() - t0:.0f}s")  # fmt: skip
    return out


def _save_base_weights(model, path: Path) -> None:
    """The frozen weights training needs: embedding, lm_head, final norm (as loaded, in the model dtype)."""
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    tensors = {"embed": embed, "norm": model.get_decoder().norm.weight}
    if lm_head.data_ptr() != embed.data_ptr():  # tied embeddings are stored once
        tensors["lm_head"] = lm_head
    write_safetensors({k: v.detach().cpu().clone() for k, v in tensors.items()}, path)


# ---------------------------------------------------------------------------------------------------------
class CachedData:
    """Random access to the samples of a prepared cache (memory-mapped safetensors shards)."""

    def __init__(self, name: str | os.PathLike):
        from safetensors import safe_open

        self.root = data_dir(name)
        meta_file = self.root / "meta.json"
        if not meta_file.exists():
            raise FileNotFoundError(f"no prepared data at {self.root} (run `python -m eagle.train prepare` first)")
        self.meta = json.loads(meta_file.read_text())
        self._files, self._index = [], []  # index: (file number, start, end)
        for path in sorted(self.root.glob("shard_*.safetensors")):
            f = safe_open(str(path), framework="pt")
            offsets = f.get_tensor("offsets").tolist()
            if len(offsets) < 2:
                continue
            n = len(self._files)
            self._files.append(f)
            self._index += [(n, a, b) for a, b in zip(offsets[:-1], offsets[1:])]

    def __len__(self) -> int:
        return len(self._index)

    @property
    def has_taps(self) -> bool:
        return bool(self.meta.get("has_taps"))

    def length(self, i: int) -> int:
        _, a, b = self._index[i]
        return b - a

    def num_tokens(self) -> int:
        return sum(b - a for _, a, b in self._index)

    def ids_and_mask(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, a, b = self._index[i]
        f = self._files[n]
        return f.get_slice("input_ids")[a:b].long(), f.get_slice("loss_mask")[a:b].bool()

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """-> input_ids [T] long, loss_mask [T] bool, argmax [T] long, hidden [T, H], taps [T, 3H] (if stored)."""
        n, a, b = self._index[i]
        f = self._files[n]
        item = {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
            "argmax": f.get_slice("argmax")[a:b].long(),
            "hidden": f.get_slice("hidden")[a:b],
        }
        if self.has_taps:
            item["taps"] = f.get_slice("taps")[a:b]
        return item

    def base_weights(self) -> dict[str, torch.Tensor]:
        """embed [V, H], lm_head [V, H] (the embedding when tied), norm [H]."""
        from safetensors.torch import load_file

        weights = load_file(str(self.root / "base.safetensors"))
        weights.setdefault("lm_head", weights["embed"])
        return weights
