import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the hub
torch.set_num_threads(1)  # tiny test models: threads only add overhead (and thrash on a busy machine)
# Every model a test builds compiles the same functions (BaseModel.decode, the round's steps) again: one entry each
# on their code objects, past dynamo's default limit of 8, after which it would run them eagerly without a word.
torch._dynamo.config.recompile_limit = 64


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
