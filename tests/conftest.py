import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny.py
from kernel_builds import AVX2, KernelBuilds, can_build  # noqa: E402
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


_kernel_builds = KernelBuilds()


def pytest_collection_finish(session):
    """Start the kernel builds the selected tests will ask for (kernel_builds.py), on the idle core."""
    wanted = [item for item in session.items if "kernel_variant" in getattr(item, "fixturenames", ())]
    if wanted and can_build():
        for item in wanted:
            callspec = getattr(item, "callspec", None)
            _kernel_builds.start(tuple(callspec.params.get("flags", AVX2)) if callspec else AVX2)


def pytest_sessionfinish(session):
    _kernel_builds.close()


@pytest.fixture(scope="session")
def kernel_variant():
    """`build(flags)`: the panel kernel's library compiled with extra compiler flags, once a session for each set
    (kernel_builds.py)."""
    return _kernel_builds


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
