"""Bad input gets an error that names the problem; never a silent wrong answer."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import random_draft, save_base, tiny_base

from eagle.model.ea_model import EaModel
from eagle.models.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    base = tiny_base("llama")
    save_base(base, str(root / "base"))
    return root, base


def edit_draft(folder, config_edit=None, state_edit=None):
    cfg_path, st_path = os.path.join(folder, "config.json"), os.path.join(folder, "model.safetensors")
    if config_edit:
        cfg = json.load(open(cfg_path))
        config_edit(cfg)
        json.dump(cfg, open(cfg_path, "w"))
    if state_edit:
        state = load_file(st_path)
        state_edit(state)
        save_file(state, st_path)
    return folder


def load(root, draft, **kw):
    return EaModel.from_pretrained(str(root / "base"), draft, **kw)


def test_hidden_size_mismatch_is_named(setup, tmp_path):
    root, base = setup
    other = tiny_base("llama", hidden_size=48)
    with pytest.raises(CheckpointError, match="hidden size 48.*base model has 32"):
        load(root, random_draft(other, str(tmp_path / "d")))


def test_vocab_mismatch_is_named(setup, tmp_path):
    root, base = setup
    other = tiny_base("llama", vocab=20)
    with pytest.raises(CheckpointError, match="vocab_size=20.*16 rows"):
        load(root, random_draft(other, str(tmp_path / "d"), eagle3=True))


def test_missing_key_is_named(setup, tmp_path):
    root, base = setup
    draft = edit_draft(random_draft(base, str(tmp_path / "d")), state_edit=lambda s: s.pop("layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing \['layers.0.mlp.up_proj.weight'\]"):
        load(root, draft)


def test_unexpected_key_is_named(setup, tmp_path):
    root, base = setup
    draft = edit_draft(random_draft(base, str(tmp_path / "d")), state_edit=lambda s: s.update(extra=torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected \['extra'\]"):
        load(root, draft)


def test_bias_flag_contradicting_the_weights_points_at_the_config_key(setup, tmp_path):
    root, base = setup
    draft = edit_draft(random_draft(base, str(tmp_path / "d")), config_edit=lambda c: c.update(bias=False))
    with pytest.raises(CheckpointError, match='unexpected \\[\'fc.bias\'\\].*"bias" in config.json'):
        load(root, draft)


def test_forcing_the_wrong_format_fails_loudly(setup, tmp_path):
    root, base = setup
    with pytest.raises(CheckpointError, match="use_eagle3=True but the checkpoint is EAGLE-1/2"):
        load(root, random_draft(base, str(tmp_path / "d")), use_eagle3=True)


def test_pickled_checkpoints_load_weights_only(setup, tmp_path):
    root, base = setup
    folder = random_draft(base, str(tmp_path / "d"), fmt="bin")
    state = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True)
    state["payload"] = os.getcwd  # an arbitrary callable: refused by weights_only unpickling
    torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    with pytest.raises(Exception, match="Weights only load failed|weights_only"):
        load(root, folder)


def test_unreachable_hub_id_says_how_to_point_at_a_folder(setup):
    root, _ = setup
    with pytest.raises(CheckpointError, match="not a local folder.*ea_model_path"):
        load(root, "nobody/no-such-eagle-head")


@pytest.fixture(scope="module")
def model(setup, tmp_path_factory):
    root, base = setup
    return load(root, random_draft(base, str(tmp_path_factory.mktemp("d"))))


def test_prompt_longer_than_max_length_is_refused(model):
    with pytest.raises(ValueError, match="prompt has 20 tokens, max_length is 16"):
        model.eagenerate(torch.randint(2, 16, (1, 20)), max_length=16)


def test_nonpositive_max_new_tokens_is_refused(model):
    for n in (0, -3):
        with pytest.raises(ValueError, match="max_new_tokens must be > 0"):
            model.eagenerate(torch.tensor([[3, 4]]), max_new_tokens=n)


def test_negative_temperature_is_refused(model):
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.eagenerate(torch.tensor([[3, 4]]), temperature=-0.5)
    with pytest.raises(ValueError, match="top_p must be in"):
        model.naivegenerate(torch.tensor([[3, 4]]), temperature=1.0, top_p=1.5)


def test_batch_size_other_than_one_is_refused(model):
    with pytest.raises(ValueError, match="batch size must be 1"):
        model.eagenerate(torch.tensor([[3, 4], [5, 6]]))
    with pytest.raises(ValueError, match="batch size must be 1"):
        list(model.ea_generate(torch.zeros(2, 1, 3, dtype=torch.long)))


def test_token_ids_outside_the_vocabulary_are_refused(model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.eagenerate(torch.tensor([[3, 99]]))
