"""prepare -> fit -> export -> EaModel on a tiny random base: the trained draft is accepted far more often than an
untrained one, loads through `EaModel.from_pretrained`, and decoding stays lossless."""

import json
import os

import pytest
import torch
from tiny import random_draft, save_base, tiny_base

from eagle.model.ea_model import EaModel
from eagle.train.__main__ import main as cli
from eagle.train.data import CachedData, PrepareConfig, prepare
from eagle.train.fit import FitConfig, fit

VOCAB = 128
PROMPT, NEW = 10, 48


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny base, greedy continuations of random prompts as 'conversations', and a private EAGLE_CACHE."""
    root = tmp_path_factory.mktemp("train")
    old = os.environ.get("EAGLE_CACHE")
    os.environ["EAGLE_CACHE"] = str(root / "cache")
    base = tiny_base("llama", vocab=VOCAB, layers=6)
    with torch.no_grad():
        base.get_output_embeddings().weight.mul_(2.0)  # a more decided base: greedy paths worth learning
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, VOCAB, (160, PROMPT), generator=g)
    with torch.no_grad():
        seqs = base.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    samples = []
    for s in seqs:
        mask = torch.zeros(len(s), dtype=torch.bool)
        mask[PROMPT:] = True  # the "reply": what the base wrote
        samples.append((s, mask))
    save_base(base, str(root / "base"))
    yield {"root": root, "base": base, "samples": samples}
    if old is None:
        os.environ.pop("EAGLE_CACHE", None)
    else:
        os.environ["EAGLE_CACHE"] = old


def _prepare(env, recipe: str) -> str:
    name = f"tiny-{recipe}"
    cfg = PrepareConfig(base_model_path=str(env["root"] / "base"), out=name, recipe=recipe, compute_dtype="fp32",
                        dtype="fp16", shard_size=64)  # fmt: skip
    prepare(cfg, conversations=env["samples"])
    return name


def _fit(env, name: str, recipe: str, out: str, steps: int, **over) -> FitConfig:
    cfg = FitConfig(
        data=[name], out=str(env["root"] / out), recipe=recipe, steps=steps, lr=3e-3, batch_tokens=512,
        draft_vocab_size=64, intermediate_size=64, ttt_steps=5, eval_samples=16, eval_every=steps // 2,
        save_every=steps // 2, mixed_precision="no", base_model_path=str(env["root"] / "base"), eval_generate=4,
        eval_max_new_tokens=32, log_every=20, **over,
    )  # fmt: skip
    fit(cfg)
    return cfg


def _tokens_per_forward(env, head_folder: str, prompts) -> tuple[float, list]:
    model = EaModel.from_pretrained(str(env["root"] / "base"), head_folder, dtype=torch.float32, total_token=16,
                                    depth=5, top_k=4)  # fmt: skip
    new = forwards = 0
    outputs = []
    for p in prompts:
        ids, n, rounds = model.eagenerate(p[None], max_new_tokens=40, log=True)
        new, forwards = new + n, forwards + rounds + 1
        outputs.append(ids)
    return new / forwards, outputs


def _evals(cfg: FitConfig) -> list[dict]:
    lines = [json.loads(x) for x in open(os.path.join(cfg.out, "log.jsonl"))]
    return [x for x in lines if x["kind"] == "eval"]


def test_cache_layout(env):
    name = _prepare(env, "eagle3")
    data = CachedData(name)
    assert len(data) == 160 and data.meta["complete"] and data.meta["feature_layers"] == [2, 3, 3]
    item = data[0]
    assert item["input_ids"].tolist() == env["samples"][0][0].tolist()
    assert item["loss_mask"].tolist() == env["samples"][0][1].tolist()
    assert item["taps"].shape == (PROMPT + NEW, 96) and item["hidden"].dtype == torch.float16
    with torch.no_grad():  # the stored argmax is the base's greedy next token
        logits = env["base"](env["samples"][0][0][None]).logits[0]
    assert (logits.argmax(-1) == item["argmax"]).float().mean() > 0.95


def test_eagle3_end_to_end(env):
    name = _prepare(env, "eagle3")
    cfg = _fit(env, name, "eagle3", "run3", steps=300)
    evals = _evals(cfg)
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == 300
    assert last["acc_0"] > first["acc_0"] + 0.2 and last["tau"] > first["tau"] + 0.5
    assert last["tokens_per_forward"] > first["tokens_per_forward"] + 0.3

    prompts = [env["samples"][i][0][:PROMPT] for i in range(150, 156)]  # held-out samples
    trained, outputs = _tokens_per_forward(env, os.path.join(cfg.out, "best"), prompts)
    random_folder = random_draft(env["base"], str(env["root"] / "random3"), eagle3=True, draft_vocab=64)
    untrained, _ = _tokens_per_forward(env, random_folder, prompts)
    assert trained > 1.5 and trained > untrained + 0.4, (trained, untrained)
    for p, ids in zip(prompts, outputs):  # lossless: identical to transformers' greedy decoding
        ref = env["base"].generate(p[None], max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(ids, ref)
    size = os.path.getsize(os.path.join(cfg.out, "best", "model.safetensors"))
    assert size < 200_000  # fp16, no embedding


def test_resume_continues_from_latest_checkpoint(env):
    name = _prepare(env, "eagle3")
    out = str(env["root"] / "resume")
    common = ["fit", "--data", name, "--out", out, "--batch-tokens", "512", "--draft-vocab-size", "64",
              "--intermediate-size", "64", "--ttt-steps", "2", "--eval-samples", "8", "--eval-every", "1000",
              "--save-every", "10", "--mixed-precision", "no", "--lr", "1e-3"]  # fmt: skip
    cli(common + ["--steps", "20"])
    state = torch.load(os.path.join(out, "checkpoints", "step_00000020.pt"), weights_only=False)
    assert state["step"] == 20 and "optimizer" in state and "scheduler" in state
    cli(common + ["--steps", "30", "--resume"])
    ckpts = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert ckpts == ["step_00000020.pt", "step_00000030.pt"]  # keeps the last two
    state = torch.load(os.path.join(out, "checkpoints", ckpts[-1]), weights_only=False)
    assert state["step"] == 30 and state["scheduler"]["last_epoch"] == 30
    train = [json.loads(x) for x in open(os.path.join(out, "log.jsonl")) if '"train"' in x]
    assert [x["step"] for x in train] == [10, 20, 30]


def test_eagle1_end_to_end(env):
    name = _prepare(env, "eagle1")
    cfg = _fit(env, name, "eagle1", "run1", steps=200, include_embedding=True)
    evals = _evals(cfg)
    assert evals[-1]["acc_0"] > evals[0]["acc_0"] + 0.2
    assert evals[-1]["tokens_per_forward"] > evals[0]["tokens_per_forward"] + 0.3
    prompts = [env["samples"][i][0][:PROMPT] for i in range(150, 156)]
    trained, outputs = _tokens_per_forward(env, os.path.join(cfg.out, "best"), prompts)
    untrained, _ = _tokens_per_forward(env, random_draft(env["base"], str(env["root"] / "random1")), prompts)
    assert trained > 1.5 and trained > untrained + 0.4, (trained, untrained)
    for p, ids in zip(prompts, outputs):
        ref = env["base"].generate(p[None], max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(ids, ref)


def test_init_from_checkpoint_or_export_starts_from_those_weights(env):
    name = _prepare(env, "eagle3")
    out = env["root"] / "init-src"
    common = ["--data", name, "--batch-tokens", "512", "--draft-vocab-size", "64", "--intermediate-size", "64",
              "--ttt-steps", "2", "--eval-samples", "8", "--eval-every", "1000", "--mixed-precision", "no",
              "--export-dtype", "fp32"]  # fmt: skip
    cli(["fit", "--out", str(out), "--steps", "10", "--save-every", "10", "--lr", "1e-2"] + common)
    ckpt = out / "checkpoints" / "step_00000010.pt"
    trained = torch.load(ckpt, weights_only=False)["head"]
    for source in (str(ckpt), str(out / "final")):
        dst = env["root"] / f"init-{os.path.basename(source)}"
        cli(["fit", "--out", str(dst), "--steps", "1", "--save-every", "1", "--lr", "0", "--init-from", source]
            + common)  # fmt: skip
        started = torch.load(dst / "checkpoints" / "step_00000001.pt", weights_only=False)["head"]
        assert started.keys() == trained.keys()
        for k in trained:  # lr 0: the one step leaves the initial weights as they were
            assert torch.equal(started[k], trained[k]), k
