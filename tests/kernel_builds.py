"""The panel kernel's library built with extra compiler flags: the code for other CPUs (AVX2 without AVX-512, without
VNNI) built and checked on this one. A build takes most of a minute on one core while the tests use one thread, so
the builds the session's tests will ask for start at its beginning, at the lowest priority, on the idle core."""

from __future__ import annotations

import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

AVX2 = ("-mno-avx512f",)  # the AVX2 code on an AVX-512 machine
VARIANTS = {  # a test id: the flags after -march=native
    "avx2": AVX2,
    "avx2-no-vnni": (*AVX2, "-mno-avxvnni"),  # a Zen 3: integer dot products by vpmaddubsw and vpmaddwd
    "native-no-avx512-vnni": ("-mno-avx512vnni",),  # a Skylake-X: AVX-512 without its VNNI
}


def can_build() -> bool:
    from eagle.kernels import panel_kernel

    return platform.machine() in ("x86_64", "AMD64") and panel_kernel._compiler() is not None


class KernelBuilds:
    """Called with `flags`: the path of the library built with them (waiting for its build); each set of flags built
    once, one build at a time."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="eagle-kernel-variants-"))
        self.pool = ThreadPoolExecutor(1)
        self.builds: dict[tuple[str, ...], Future] = {}

    def start(self, flags: tuple[str, ...]) -> Future:
        if flags not in self.builds:
            self.builds[flags] = self.pool.submit(self._build, flags)
        return self.builds[flags]

    def __call__(self, flags: tuple[str, ...]) -> Path:
        return self.start(tuple(flags)).result()

    def _build(self, flags: tuple[str, ...]) -> Path:
        from eagle.kernels import panel_kernel

        library = self.folder / f"panel_linear{''.join(flags)}.so"
        nice = ["nice", "-n", "19"] if shutil.which("nice") else []
        subprocess.run([*nice, *panel_kernel.build_command(panel_kernel._compiler(), library, flags)], check=True)
        return library

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.folder, ignore_errors=True)
