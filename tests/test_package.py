"""The project installs as a package: a wheel that carries the shipped head, the kernels' sources and the two
console scripts, and runs from outside the repository."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
                         capture_output=True, text=True)  # fmt: skip
    if run.returncode and "No matching distribution found for setuptools" in run.stderr:
        pytest.skip("pip cannot fetch setuptools to build the wheel (no package registry)")
    assert run.returncode == 0, run.stderr
    (path,) = out.glob("eagle_speculative-*.whl")
    return path


def test_the_wheel_carries_the_head_the_kernel_sources_and_the_console_scripts(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("eagle/assets/smollm2-eagle3/model.safetensors", "eagle/assets/smollm2-eagle3/acceptance.json",
                   "eagle/assets/app.css", "eagle/kernels/panel_linear.cpp", "eagle/kernels/quant_linear.cpp",
                   "eagle/evaluation/data/repetitive.jsonl", "app/cli.py", "eagle/model/ea_model.py"):  # fmt: skip
        assert needed in names, f"{needed} missing from {wheel.name}"
    assert not any(n.startswith(("tests/", "assets/")) for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "eagle-chat = app.cli:main" in scripts and "eagle-bench = eagle.evaluation.bench:main" in scripts


def test_the_installed_package_finds_its_assets_and_answers_help_outside_the_repository(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(target))
    where = subprocess.run([sys.executable, "-c", "import eagle.shipped as s, eagle.chat.model_types as m; "
                            "print(s.ASSETS); print(m.DEFAULT_HEAD_DIR.is_dir())"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert where == [str(target / "eagle" / "assets"), "True"]
    for script, usage in (("eagle-chat", "--model-type"), ("eagle-bench", "--methods")):
        run = subprocess.run([str(target / "bin" / script), "--help"], cwd=tmp_path, env=env, capture_output=True,
                             text=True)  # fmt: skip
        assert run.returncode == 0 and usage in run.stdout, run.stderr[-2000:]
