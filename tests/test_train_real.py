"""The real pipeline on SmolLM2-135M-Instruct and ShareGPT (slow: converts/downloads them on first use)."""

import json
import os

import pytest
import torch

from eagle.train.__main__ import main as cli
from eagle.train.data import CachedData


@pytest.mark.slow
def test_smollm2_sharegpt_pipeline(tmp_path):
    from eagle.default_model import default_base_model_path
    from eagle.model.ea_model import EaModel

    base = default_base_model_path()
    plain, regen, run = str(tmp_path / "plain"), str(tmp_path / "regen"), tmp_path / "run"
    cli(["prepare", "--base-model-path", base, "--out", plain, "--limit", "6", "--max-len", "256"])
    batched = str(tmp_path / "regen-batched")
    cli(["prepare", "--base-model-path", base, "--out", regen, "--limit", "2", "--skip", "6", "--max-len", "256",
         "--regenerate", "--regen-max-new-tokens", "24"])  # fmt: skip
    cli(["prepare", "--base-model-path", base, "--out", batched, "--limit", "4", "--skip", "8", "--max-len", "256",
         "--regenerate", "--regen-max-new-tokens", "24", "--regen-batch-size", "4"])  # fmt: skip
    for name in (regen, batched):
        data = CachedData(name)
        assert len(data) >= 1 and data.meta["complete"]
        item = data[0]
        mask = item["loss_mask"]
        # Self-distilled replies are the base's greedy tokens: at every reply position but the first of a turn
        # (which follows the template's header) the stored greedy token is the next one.
        follows = mask[1:] & mask[:-1]
        assert (item["argmax"][:-1][follows] == item["input_ids"][1:][follows]).float().mean() > 0.95

    cli(["fit", "--data", regen, "--data", plain, "--out", str(run), "--steps", "3", "--batch-tokens", "512",
         "--draft-vocab-size", "2048", "--eval-samples", "1", "--eval-every", "3", "--base-model-path", base,
         "--eval-generate", "1", "--eval-max-new-tokens", "16", "--export-dir", str(tmp_path / "head")])  # fmt: skip
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["draft_vocab_size"] == 2048 and config["hidden_size"] == 576
    assert os.path.getsize(tmp_path / "head" / "model.safetensors") < 25e6
    model = EaModel.from_pretrained(base, str(tmp_path / "head"), dtype=torch.float32)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,
                                              return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
    assert torch.equal(model.eagenerate(ids, max_new_tokens=16), model.naivegenerate(ids, max_new_tokens=16))
