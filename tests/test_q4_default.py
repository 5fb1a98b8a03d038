"""The embedded default at its GGUF's precision: `--weights q4_1` resolves to a folder that names the GGUF (the
converted files linked, never the hub's checkpoint), and `auto` picks it where the default came from the GGUF."""

import json

import pytest
import torch

from eagle import default_model
from eagle.chat import model_types
from eagle.default_model import MARKER, default_base_model_path
from eagle.kernels import quant_gguf


def converted_folder(cache):
    folder = cache / "models" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / MARKER).write_text('{"source": "SmolLM2-135M-Instruct.Q4_1.gguf"}')
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_q4_1_weights_are_the_converted_folder_naming_its_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    folder = converted_folder(tmp_path)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(default_model, "_try_hub", lambda: pytest.fail("the hub's checkpoint is not the GGUF's"))
    monkeypatch.setattr(default_model, "fetch_wheel_member", lambda *a, **k: gguf)
    path = default_base_model_path(weights="q4_1")
    assert path == str(folder.with_name("SmolLM2-135M-Instruct-q4_1"))
    config = json.loads((folder.with_name("SmolLM2-135M-Instruct-q4_1") / "config.json").read_text())
    assert config == {"model_type": "llama", quant_gguf.CONFIG_KEY: str(gguf.resolve())}
    linked = folder.with_name("SmolLM2-135M-Instruct-q4_1") / "model.safetensors"
    assert linked.is_symlink() and linked.read_bytes() == b"weights"
    assert default_base_model_path(weights="fp32") == str(folder)  # the float32 folder stays as it was
    with pytest.raises(ValueError, match="choose one of fp32, q4_1"):
        default_base_model_path(weights="q2_k")


def test_the_config_key_is_the_one_the_kernels_read():
    assert default_model.GGUF_CONFIG_KEY == quant_gguf.CONFIG_KEY


def test_auto_weights_are_q4_1_only_for_a_gguf_converted_default_on_a_cpu_in_float32(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    folder = converted_folder(tmp_path)
    hub = tmp_path / "hub"
    hub.mkdir()
    assert model_types.pick_weights("auto", str(folder), torch.float32, cuda=False) == "q4_1"
    assert model_types.pick_weights("auto", str(hub), torch.float32, cuda=False) == "fp32"  # the hub's original
    assert model_types.pick_weights("auto", str(folder), torch.float32, cuda=True) == "fp32"
    assert model_types.pick_weights("auto", str(folder), torch.bfloat16, cuda=False) == "fp32"
    assert model_types.pick_weights("fp32", str(folder), torch.float32, cuda=False) == "fp32"


def test_the_app_takes_weights_and_the_model_panel_says_which():
    from types import SimpleNamespace

    from app.cli import parser
    from app.ui import model_info_md

    assert parser().parse_args([]).weights == "auto"  # q4_1 for the GGUF-converted default (pick_weights)
    assert parser().parse_args(["--weights", "q4_1"]).weights == "q4_1"
    engine = SimpleNamespace(
        info={"weights": "q4_1 (210 layers), q8_0 (lm_head)"}, reference=lambda: None, status="", jobs=[],
        child=None, reply_figures=lambda: None, path="eager", max_length=2048, template="chat-template",
        context_line=lambda: "2,048 tokens",
    )  # fmt: skip
    assert "- **weights**: `q4_1 (210 layers), q8_0 (lm_head)`" in model_info_md(engine)


def test_fp32_weights_of_a_gguf_folder_load_the_float32_folder_it_links(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    folder = converted_folder(tmp_path)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    quantized = default_model.gguf_weights_folder(folder, gguf)
    seen = []

    def loaded(base, head, **kwargs):
        seen.append(base)
        raise ValueError("stop here")

    monkeypatch.setattr("eagle.model.ea_model.EaModel.from_pretrained", loaded)
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    (head / "model.safetensors").write_bytes(b"")
    with pytest.raises(model_types.ModelLoadError, match="stop here"):
        model_types.load(model_types.MODEL_TYPES["smollm2"], str(quantized), str(head), weights="fp32", log=print)
    assert seen == [str(folder)]
