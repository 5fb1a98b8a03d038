import os
import subprocess
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


@pytest.fixture(scope="session", autouse=True)
def _saved_graphs_in_a_session_folder(tmp_path_factory):
    """Graphs saved whole (aot_store.py) go to a folder of this test session, never the user's cache: a test that
    counts traced graphs must not find them loaded from a file an earlier run left."""
    folder = tmp_path_factory.mktemp("aot")
    previous = os.environ.get("EAGLE_AOT_DIR")
    os.environ["EAGLE_AOT_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("EAGLE_AOT_DIR", None)
    else:
        os.environ["EAGLE_AOT_DIR"] = previous


@pytest.fixture(scope="session")
def kernel_variant(tmp_path_factory):
    """`build(flags)`: the panel kernel's library compiled with extra compiler flags (the AVX2 code on an AVX-512
    machine: -mno-avx512f), once a session for each set of flags: a build takes half a minute, and three test
    files check the same AVX2 build."""
    from eagle.model import panel_kernel

    built = {}

    def build(flags: tuple[str, ...]):
        if flags not in built:
            library = tmp_path_factory.mktemp("kernel-variant") / "panel_linear_variant.so"
            subprocess.run(panel_kernel.build_command(panel_kernel._compiler(), library, flags), check=True)
            built[flags] = library
        return built[flags]

    return build


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
