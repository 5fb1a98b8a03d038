"""Bundles: files moved as parts of a bounded size, each part and each file checked by sha256 on the way back.

A bundle is a folder holding ``manifest.json`` and ``part-000``, ``part-001``, ...: the concatenation of the parts
is an uncompressed tar of the bundled files. The manifest records the parts (name, size, sha256) and the files
(name, size, sha256), so `unpack` names the part that is missing or damaged before it writes anything.

Used where a channel limits file sizes (the GPU recipe's inputs and results, see ``gpu_recipe.py``). Parts may
arrive in different folders (several transfers): `unpack` takes every folder that holds some of them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

MANIFEST = "manifest.json"
_CHUNK = 1 << 20


class BundleError(RuntimeError):
    """A bundle part or file is missing or does not match its checksum."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class _PartWriter(io.RawIOBase):
    """A write-only stream that cuts what it receives into files of at most `max_bytes` each."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.parts: list[dict] = []
        self._file = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = memoryview(data)
        written = 0
        while written < len(data):
            if self._file is None or self.parts[-1]["size"] == self.max_bytes:
                self._next()
            room = self.max_bytes - self.parts[-1]["size"]
            piece = data[written : written + room]
            self._file.write(piece)
            self._hash.update(piece)
            self.parts[-1]["size"] += len(piece)
            written += len(piece)
        return written

    def _next(self) -> None:
        self._finish()
        name = f"part-{len(self.parts):03d}"
        self.parts.append({"name": name, "size": 0})
        self._file, self._hash = open(self.folder / name, "wb"), hashlib.sha256()

    def _finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self.parts[-1]["sha256"] = self._hash.hexdigest()
            self._file = None

    def close(self) -> None:
        self._finish()
        super().close()


def pack(files: dict[str, str | os.PathLike], folder: str | os.PathLike, max_part_bytes: int) -> dict:
    """Write `files` ({name in the bundle: path}) as a bundle in `folder` (created; must hold no bundle yet).
    Returns the manifest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / MANIFEST).exists():
        raise BundleError(f"{folder} already holds a bundle ({MANIFEST}); pack into an empty folder")
    entries = [{"name": name, "size": os.path.getsize(path), "sha256": sha256_file(path)}
               for name, path in files.items()]  # fmt: skip
    writer = _PartWriter(folder, max_part_bytes)
    with tarfile.open(fileobj=writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name, path in files.items():
            tar.add(str(path), arcname=name, recursive=False)
    writer.close()
    manifest = {"format": 1, "max_part_bytes": max_part_bytes, "parts": writer.parts, "files": entries}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _find_parts(folders: list[Path], manifest: dict) -> list[Path]:
    found = []
    for part in manifest["parts"]:
        where = [f / part["name"] for f in folders if (f / part["name"]).is_file()]
        if not where:
            raise BundleError(f"bundle part {part['name']} is missing (looked in {', '.join(map(str, folders))})")
        path = where[0]
        if os.path.getsize(path) != part["size"] or sha256_file(path) != part["sha256"]:
            raise BundleError(f"bundle part {path} is damaged (size or sha256 differs from {MANIFEST}); copy it again")
        found.append(path)
    return found


class _Joined(io.RawIOBase):
    """The parts read one after the other as one stream."""

    def __init__(self, paths: list[Path]):
        self._paths, self._file = list(paths), None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self._file is None:
                if not self._paths:
                    return 0
                self._file = open(self._paths.pop(0), "rb")
            n = self._file.readinto(buffer)
            if n:
                return n
            self._file.close()
            self._file = None


def unpack(folders: str | os.PathLike | list, dest: str | os.PathLike) -> dict[str, Path]:
    """Check every part named by the manifest (found in any of `folders`), extract the files into `dest` and
    check them too. Returns {name: path}. Files already in `dest` with the right checksum are kept."""
    folders = [Path(f) for f in (folders if isinstance(folders, list) else [folders])]
    manifests = [f / MANIFEST for f in folders if (f / MANIFEST).is_file()]
    if not manifests:
        raise BundleError(f"no {MANIFEST} in {', '.join(map(str, folders))}")
    manifest = json.loads(manifests[0].read_text())
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {e["name"]: e for e in manifest["files"]}
    if all((dest / n).is_file() and sha256_file(dest / n) == e["sha256"] for n, e in wanted.items()):
        return {n: dest / n for n in wanted}
    parts = _find_parts(folders, manifest)
    with tarfile.open(fileobj=io.BufferedReader(_Joined(parts), _CHUNK), mode="r|") as tar:
        for member in tar:
            if member.name not in wanted or not member.isfile():
                raise BundleError(f"unexpected member {member.name!r} in the bundle")
            tar.extract(member, dest, filter="data")
    for name, entry in wanted.items():
        if sha256_file(dest / name) != entry["sha256"]:
            raise BundleError(f"{dest / name} does not match its sha256 in {MANIFEST}")
    return {n: dest / n for n in wanted}
