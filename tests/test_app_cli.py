"""launch.py: arguments, model types, and clear messages (not tracebacks) when a model is missing; one real launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from app_fixtures import ROOT, tiny_model

from app.cli import main, parse_auth, parser
from eagle.chat.model_types import (
    MODEL_TYPES, ModelLoadError, check_head_folder, model_type, pick_draft_dtype, pick_dtype, resolve,
)  # fmt: skip


def test_model_types_and_reference_spellings():
    assert model_type("llama-3-instruct") is MODEL_TYPES["llama3"]
    assert model_type("LLaMA-2-chat") is MODEL_TYPES["llama2"]
    t = model_type("llama3")
    assert (t.base, t.head) == ("meta-llama/Meta-Llama-3-8B-Instruct", "yuhuili/EAGLE-LLaMA3-Instruct-8B")
    t = model_type("llama3.1")
    assert (t.base, t.head) == ("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")
    assert model_type("vicuna").template == "vicuna" and model_type("llama2").template == "llama-2"
    assert model_type("mixtral").head == "yuhuili/EAGLE-mixtral-instruct-8x7B"
    assert model_type("qwen2").base == "Qwen/Qwen2-7B-Instruct"
    assert model_type("smollm2").base is None  # the embedded default
    with pytest.raises(ModelLoadError, match="known: smollm2, llama3"):
        model_type("gpt5")


def test_draft_dtype_auto_is_timed_only_under_float32_on_cpu():
    import torch

    assert pick_draft_dtype("auto", torch.float32, cuda=False) == "auto"  # EaModel times both on this machine
    assert pick_draft_dtype("auto", torch.bfloat16, cuda=False) is None
    assert pick_draft_dtype("auto", torch.float32, cuda=True) is None
    assert pick_draft_dtype("float32", torch.float32, cuda=False) is torch.float32
    with pytest.raises(ModelLoadError, match="unknown draft dtype 'fp8'; choose one of auto, float32"):
        pick_draft_dtype("fp8", torch.float32, cuda=False)


def test_dtypes_and_defaults():
    import torch

    assert pick_dtype("auto", model_type("qwen2"), cuda=True) is torch.bfloat16
    assert pick_dtype("auto", model_type("vicuna"), cuda=True) is torch.float16
    assert pick_dtype("auto", model_type("vicuna"), cuda=False) is torch.float32
    args = parser().parse_args([])
    assert args.draft_dtype == "auto"
    assert args.model_type == "smollm2" and (args.total_token, args.depth, args.top_k) == (None, None, None)
    # no tree option: the model type's tree for the device (the reference's on GPU, a small one on CPU)
    assert model_type("smollm2").default_tree(cuda=True) == (60, 7, 10)
    assert model_type("smollm2").default_tree(cuda=False) == (4, 3, 3)
    assert args.host == "127.0.0.1" and not args.share
    assert parse_auth("me:pa:ss") == ("me", "pa:ss") and parse_auth(None) is None
    with pytest.raises(SystemExit, match="USER:PASSWORD"):
        parse_auth("nopassword")


def test_missing_models_give_clear_messages(tmp_path):
    with pytest.raises(ModelLoadError, match=r"default EAGLE-3 head for SmolLM2-135M-Instruct is missing.*config.json and model.safetensors"):
        check_head_folder(str(tmp_path), is_default=True)
    with pytest.raises(ModelLoadError, match="does not exist. Pass --base-model-path"):
        resolve(str(tmp_path / "nope" / "base"), "base model", "--base-model-path", False)
    # a hub id with the hub unreachable (tests run with HF_HUB_OFFLINE=1)
    with pytest.raises(ModelLoadError, match=r"(?s)cannot get the EAGLE head 'someone/no-such-eagle'.*--ea-model-path"):
        resolve("someone/no-such-eagle", "EAGLE head", "--ea-model-path", True, log=lambda *_: None)


def test_launch_prints_a_message_not_a_traceback(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--base-model-path", str(tmp_path / "missing"), "--ea-model-path", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Cannot start:" in err and "--ea-model-path" in err and "Traceback" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="says what a GPU-less machine lacks")
def test_a_big_model_type_without_a_gpu_says_it_wants_one(capsys):
    with pytest.raises(SystemExit) as e:  # the hub is unreachable in tests (HF_HUB_OFFLINE=1): the download fails
        main(["--model-type", "llama3"])
    assert e.value.code == 2
    out = capsys.readouterr()
    assert "wants a GPU" in out.out and "wants a GPU, and this machine shows none" in out.err


def test_help_gives_the_tree_defaults_the_app_uses(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tuned on this machine" in text and "60 on GPU, 4 on CPU" in text


def test_launch_py_serves_a_tiny_model(tmp_path):
    """What a new user does: start launch.py, wait for the URL, chat through it, stop the server."""
    from gradio_client import Client

    tiny_model(str(tmp_path))  # writes tmp_path/base and tmp_path/draft
    cmd = [sys.executable, os.path.join(ROOT, "launch.py"), "--base-model-path", str(tmp_path / "base"),
           "--ea-model-path", str(tmp_path / "draft"), "--max-new-tokens", "8"]  # fmt: skip
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        lines, url, deadline = [], None, time.time() + 120
        while url is None and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"EAGLE chat ready: (http://\S+)", line)
            url = m and m.group(1)
        assert url, "".join(lines)
        log = "".join(lines)
        assert "[1/3]" in log and "[2/3]" in log and "[3/3]" in log  # loading progress
        html, text, figures = Client(url, verbose=False).predict("w7 w8", api_name="/chat")
        assert text and figures["new_tokens"] >= 1
        # the OpenAI-compatible API on the same port (app/openai_api.py)
        assert re.search(r"OpenAI-compatible API: http://\S+/v1 \(model 'smollm2'\)", proc.stdout.readline())
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 4}
        reply = httpx.post(url + "v1/chat/completions", json=body, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == reply["timings"]["predicted_n"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
