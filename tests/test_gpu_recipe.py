"""The GPU recipe at tiny scale on CPU: bundles round-trip and name a damaged or missing part; generation resumes
after an interruption without duplicating or losing conversations; `run` goes from an input bundle to a results
bundle whose head loads and decodes losslessly."""

import gzip
import json
import os

import pytest
import torch
from tiny import save_base, tiny_base

from eagle.model.ea_model import EaModel
from eagle.train.bundle import BundleError, pack, unpack
from eagle.train.gpu_recipe import build_parser, generate, main, read_openings

VOCAB = 64
TEMPLATE = ("{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}<s> {% endif %}")


def test_bundle_round_trips_across_folders_and_names_bad_parts(tmp_path):
    files = {}
    for name, size in [("a.bin", 5000), ("sub/b.bin", 12345), ("empty", 0)]:
        path = tmp_path / "src" / name.replace("/", "_")
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(size))
        files[name] = path
    manifest = pack(files, tmp_path / "bundle", max_part_bytes=4096)
    assert len(manifest["parts"]) >= 5 and all(p["size"] <= 4096 for p in manifest["parts"])
    # the parts travel in two folders (two transfers)
    second = tmp_path / "second"
    second.mkdir()
    for p in manifest["parts"][::2]:
        os.replace(tmp_path / "bundle" / p["name"], second / p["name"])
    out = unpack([tmp_path / "bundle", second], tmp_path / "dest")
    assert {n: out[n].read_bytes() for n in files} == {n: p.read_bytes() for n, p in files.items()}

    damaged = second / manifest["parts"][0]["name"]
    data = bytearray(damaged.read_bytes())
    data[10] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="part-000 is damaged"):
        unpack([tmp_path / "bundle", second], tmp_path / "dest2")
    damaged.unlink()
    with pytest.raises(BundleError, match="part-000 is missing"):
        unpack([tmp_path / "bundle", second], tmp_path / "dest3")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny base with a chat template, 24 openings and 2 MT-bench-style questions, bundled like `pack` does."""
    root = tmp_path_factory.mktemp("recipe")
    base = tiny_base("llama", vocab=VOCAB, layers=4)
    folder = save_base(base, str(root / "base"), eos=1)
    config = json.loads((root / "base" / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (root / "base" / "tokenizer_config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    with gzip.open(root / "openings.jsonl.gz", "wt") as f:
        for i in range(24):
            words = " ".join(f"w{int(t)}" for t in torch.randint(2, VOCAB, (3 + i % 5,), generator=g))
            f.write(json.dumps({"messages": [{"role": "user", "content": words}]}) + "\n")
    files = {f"base/{n}": os.path.join(folder, n) for n in os.listdir(folder)}
    files["openings.jsonl.gz"] = root / "openings.jsonl.gz"
    pack(files, root / "in", max_part_bytes=64 << 10)
    return root


def _gen_args(*extra):
    return build_parser().parse_args(["run", "--inputs", "x", "--work", "x", "--results", "x", "--gen-chunk", "8",
                                      "--gen-batch", "4", "--max-len", "48", "--max-new-tokens", "12",
                                      "--sample-every", "3", *extra])  # fmt: skip


def _records(folder):
    return [line for p in sorted(folder.glob("chunk_*.jsonl")) for line in p.read_text().splitlines()]


def test_generation_resumes_without_duplicates_or_losses(inputs, tmp_path):
    openings = read_openings(inputs / "openings.jsonl.gz")
    unpacked = unpack(inputs / "in", tmp_path / "in")
    base = str(unpacked["base/config.json"].parent)
    args = _gen_args()
    args.device = "cpu"
    generate(base, openings, tmp_path / "whole", args)
    args.gen_minutes = 0  # each run makes one chunk, then stops: three interrupted runs
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "chunk_00001.tmp").write_text("half a chunk\n")  # left by a killed run
    for _ in range(3):
        generate(base, openings, tmp_path / "parts", args)
    whole, parts = _records(tmp_path / "whole"), _records(tmp_path / "parts")
    assert len(whole) == 24 and parts == whole
    temperatures = [json.loads(x)["temperature"] for x in whole]
    assert temperatures == [0.0] * 16 + [0.7] * 8  # every third chunk sampled


def test_run_turns_an_input_bundle_into_a_results_bundle_with_a_lossless_head(inputs, tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    main(["run", "--inputs", str(inputs / "in"), "--work", str(work), "--results", str(results), "--device", "cpu",
          "--gen-chunk", "8", "--gen-batch", "8", "--max-len", "48", "--max-new-tokens", "24", "--epochs", "2",
          "--batch-tokens", "256", "--ttt-steps", "3", "--init-from", "", "--eval-samples", "4", "--eval-every", "10",
          "--bench-per-category", "0"])  # fmt: skip
    assert all(p.stat().st_size <= 16 << 20 for p in results.iterdir())
    out = unpack(results, tmp_path / "back")
    assert {"head-config.json", "head-model.safetensors", "head-acceptance.json", "run-log.jsonl",
            "generated.jsonl.gz"} <= set(out)
    profile = json.loads(out["head-acceptance.json"].read_text())
    assert len(profile["accept"]["0"]) == 7 and all(0 <= sum(row) <= 1 + 1e-6 for row in profile["accept"]["0"])
    head = tmp_path / "head"
    head.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.replace(out[f"head-{name}"], head / name)
    base = str(work / "inputs" / "base")
    model = EaModel.from_pretrained(base, str(head), dtype=torch.float32, total_token=8, depth=3, top_k=3)
    ids = torch.tensor([[0, 5, 9, 13]])
    ref = model.base_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                                    min_new_tokens=20)  # fmt: skip
    assert model.eagenerate(ids, max_new_tokens=20, stop_token_ids=[]).tolist() == ref.tolist()


def test_run_trains_on_a_previous_runs_conversations_and_rederives_the_vocabulary(inputs, tmp_path):
    """An earlier run's generated.jsonl.gz travels as previous.jsonl.gz: its conversations come after this run's
    (so its held-out end stays held out), and --revocab re-derives the started-from head's draft vocabulary."""
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--device", "cpu", "--gen-chunk", "8", "--gen-batch", "8", "--max-len", "48", "--max-new-tokens", "16",
              "--epochs", "1", "--batch-tokens", "256", "--ttt-steps", "2", "--eval-samples", "4",
              "--eval-every", "10", "--bench-per-category", "0"]  # fmt: skip
    main(["run", "--inputs", str(inputs / "in"), "--work", str(first), "--results", str(first / "results"),
          "--init-from", "", "--openings", "16", *common])  # fmt: skip
    files = {n: p for n, p in unpack(inputs / "in", tmp_path / "files").items()}
    files["previous.jsonl.gz"] = first / "generated.jsonl.gz"
    pack(files, tmp_path / "in2", max_part_bytes=64 << 10)
    main(["run", "--inputs", str(tmp_path / "in2"), "--work", str(second), "--results", str(second / "results"),
          "--init-from", str(first / "head"), "--revocab", *common])  # fmt: skip
    log = (second / "run" / "log.jsonl").read_text()
    assert (second / "cache-3-1").is_dir()  # 24 openings in 3 new chunks + the previous run's 16 conversations
    from eagle.train.data import CachedData

    data = CachedData(second / "cache-3-1")
    previous = [json.loads(x) for x in gzip.open(first / "generated.jsonl.gz", "rt")]
    assert len(data) == 24 + len(previous) and len(previous) == 16
    assert torch.equal(data.ids_and_mask(len(data) - 1)[0], CachedData(first / "cache-2-0").ids_and_mask(15)[0])
    assert log  # trained


def test_revocab_keeps_trained_rows_and_covers_the_new_replies():
    from eagle.models.draft_head import DraftConfig, DraftHead
    from eagle.train.fit import revocab
    from eagle.train.vocab import draft_vocab

    base = tiny_base("llama", vocab=VOCAB, layers=4)
    cfg = {**base.config.to_dict(), "draft_vocab_size": 8}
    head = DraftHead(DraftConfig.from_dict(cfg, True), own_embedding=False)
    old_counts = torch.zeros(VOCAB, dtype=torch.long)
    old_counts[:8] = 10  # old vocabulary: ids 0..7
    d2t, t2d = draft_vocab(old_counts, 8)
    head.d2t.copy_(d2t), head.t2d.copy_(t2d)
    trained = head.lm_head.weight.detach().clone()
    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[4:12] = 5  # new replies use ids 4..11
    lm_head = torch.randn(VOCAB, cfg["hidden_size"])
    revocab(head, counts, lm_head, log=lambda _: None)
    assert head.to_target_ids(torch.arange(8)).tolist() == list(range(4, 12))
    assert head.t2d.nonzero().flatten().tolist() == list(range(4, 12))
    w = head.lm_head.weight.detach()
    assert torch.equal(w[:4], trained[4:8])  # ids 4..7 keep their trained rows
    scale = trained[4:8].norm(dim=1).median() / lm_head[4:8].norm(dim=1).median()
    assert torch.allclose(w[4:], lm_head[8:12] * scale)  # new ids 8..11: the base's rows, scaled

    # the same trained head re-derived at 12 ids (a vocabulary A/B from one head): ids 4..7 still keep their rows
    big = DraftHead(DraftConfig.from_dict({**cfg, "draft_vocab_size": 12}, True), own_embedding=False)
    counts[2:4] = 1  # the 12 most frequent: 2..13 (ties by id)
    revocab(big, counts, lm_head, lambda _: None, old=(trained, torch.arange(8)))
    ids = big.to_target_ids(torch.arange(12)).tolist()
    assert ids == list(range(12)) and big.lm_head.weight.shape == (12, cfg["hidden_size"])
    assert torch.equal(big.lm_head.weight.detach()[:8], trained)  # ids 0..7 were all trained


def test_chunks_take_their_sources_in_turn_and_resume(inputs, tmp_path):
    """--sources openings,turns,magpie: chunks alternate over the sources until each runs out; the base's written
    prompts (magpie.py) are answered too; an interrupted run resumes to the same records."""
    from eagle.train.benchmark_guard import BenchmarkGuard
    from eagle.train.gpu_recipe import chunk_plan

    assert chunk_plan(["openings", "turns", "magpie"], {"openings": 20, "turns": 8, "magpie": 16}, 8) == [
        ("openings", 0), ("turns", 0), ("magpie", 0), ("openings", 1), ("magpie", 1), ("openings", 2)]
    openings = read_openings(inputs / "openings.jsonl.gz")[:16]
    conversations = [o + [{"role": "assistant", "content": "w5 w6"}] + o + [{"role": "assistant", "content": "w7"}]
                     for o in openings[:8]]  # fmt: skip
    base = str(unpack(inputs / "in", tmp_path / "in")["base/config.json"].parent)
    args = _gen_args("--sources", "openings,turns,magpie", "--magpie", "8", "--magpie-tokens", "8", "--max-len", "96")
    args.device = "cpu"
    guard = BenchmarkGuard(["a benchmark prompt nobody writes here"])
    generate(base, openings, tmp_path / "whole", args, conversations, guard)
    args.gen_minutes = 0
    for _ in range(4):
        generate(base, openings, tmp_path / "parts", args, conversations, guard)
    whole = [json.loads(x) for x in _records(tmp_path / "whole")]
    assert [json.loads(x) for x in _records(tmp_path / "parts")] == whole
    sources = [r["source"] for r in whole]
    assert sources.index("openings") < sources.index("turns") < sources.index("magpie")
    assert set(sources) == {"openings", "turns", "magpie"}
    turns = [r["messages"] for r in whole if r["source"] == "turns"]
    assert all(m["content"] not in ("w5 w6", "w7") for c in turns for m in c if m["role"] == "assistant")
    users = [[m for m in c if m["role"] == "user"] for c in conversations]
    assert all([m for m in c if m["role"] == "user"] == users[i][: len(c) // 2] for i, c in enumerate(turns))
    # (a second reply, written after the first, is tested in test_regen_all_turns.py: here the tiny base's first
    # replies run to the budget, which ends a conversation)


def test_a_later_lease_continues_the_plan_from_the_handed_on_head(inputs, tmp_path):
    """recipe.json, the head and every conversation so far travel from one lease's results to the next (`pack
    --resume`): the next run makes only the chunks after the earlier ones, starts from that head, trains on both
    and hands all of it on; a run whose plan differs is refused with the keys that differ."""
    from eagle.train.gpu_recipe import chunks_done, resumed_files

    common = ["--device", "cpu", "--gen-chunk", "8", "--gen-batch", "8", "--max-len", "48", "--max-new-tokens", "16",
              "--epochs", "1", "--batch-tokens", "256", "--ttt-steps", "2", "--eval-samples", "4",
              "--eval-every", "10", "--bench-per-category", "0", "--gen-minutes", "0"]  # fmt: skip
    first, second = tmp_path / "first", tmp_path / "second"
    main(["run", "--inputs", str(inputs / "in"), "--work", str(first), "--results", str(first / "results"),
          "--init-from", "", *common])  # fmt: skip
    back = unpack(first / "results", tmp_path / "back1")
    recipe = json.loads(back["recipe.json"].read_text())
    assert recipe["chunks_done"] == 1 and recipe["leases"][0]["chunks"] == [0, 1]

    files = {n: p for n, p in unpack(inputs / "in", tmp_path / "files").items()}
    files.update(resumed_files(tmp_path / "back1"))
    pack(files, tmp_path / "in2", max_part_bytes=64 << 10)
    main(["run", "--inputs", str(tmp_path / "in2"), "--work", str(second), "--results", str(second / "results"),
          *common])  # fmt: skip
    assert [p.name for p in sorted((second / "gen").glob("chunk_*.jsonl"))] == ["chunk_00001.jsonl"]
    assert (second / "init-head" / "model.safetensors").read_bytes() == back["head-model.safetensors"].read_bytes()
    back2 = unpack(second / "results", tmp_path / "back2")
    recipe2 = json.loads(back2["recipe.json"].read_text())
    assert recipe2["chunks_done"] == 2 and [x["chunks"] for x in recipe2["leases"]] == [[0, 1], [1, 2]]
    lines = gzip.open(back2["generated.jsonl.gz"], "rt").read().splitlines()
    earlier = gzip.open(back["generated.jsonl.gz"], "rt").read().splitlines()
    assert len(earlier) == 8 and len(lines) == 16 and lines[8:] == earlier  # the earlier last: held out as before

    with pytest.raises(ValueError, match="gen_chunk 8 -> 16"):
        chunks_done(recipe2, {**recipe2["plan"], "gen_chunk": 16})
    with pytest.raises(SystemExit, match="no recipe.json, head-config.json"):
        resumed_files(tmp_path / "files")


def test_arms_train_several_heads_on_the_same_data_and_hand_on_the_best(inputs, tmp_path):
    """--arms: one head per objective and draft vocabulary from the same cache and start; each arm's head,
    profile and evaluation travel back, and the head handed on is the arm with the best held-out tau."""
    from eagle.train.gpu_recipe import parse_arms

    work, results = tmp_path / "work", tmp_path / "results"
    main(["run", "--inputs", str(inputs / "in"), "--work", str(work), "--results", str(results), "--device", "cpu",
          "--gen-chunk", "8", "--gen-batch", "8", "--max-len", "48", "--max-new-tokens", "16", "--epochs", "1",
          "--batch-tokens", "256", "--ttt-steps", "2", "--init-from", "", "--eval-samples", "4", "--eval-every", "10",
          "--bench-per-category", "0", "--arms", "ce:64,accept:48"])  # fmt: skip
    out = unpack(results, tmp_path / "back")
    for arm, vocab in (("ce-64", 64), ("accept-48", 48)):
        names = ("config.json", "model.safetensors", "acceptance.json", "eval.json")
        assert {f"arm-{arm}-{n}" for n in names} <= set(out)
        assert json.loads(out[f"arm-{arm}-config.json"].read_text())["draft_vocab_size"] == vocab
    taus = {arm: json.loads(out[f"arm-{arm}-eval.json"].read_text())["tau"] for arm in ("ce-64", "accept-48")}
    best = max(taus, key=taus.get)
    assert out["head-model.safetensors"].read_bytes() == out[f"arm-{best}-model.safetensors"].read_bytes()
    assert parse_arms("", "accept", 4096) == [("accept", 4096)]
    with pytest.raises(ValueError, match="OBJECTIVE:VOCAB"):
        parse_arms("ce:8k", "ce", 8192)
