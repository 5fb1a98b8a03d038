"""The panel kernel: a float32 linear for the 1 to 16 rows of a decode step or verify pass (`panel_linear.cpp`).

`torch.ops.eagle.panel_linear(x, panels, bias, out_features)` equals `F.linear(x, weight, bias)` up to float32
rounding, with the weight stored as column panels (`pack`): each panel one contiguous stream, each thread whole
panels, a tile's sums in vector registers while the panel streams past once. So 8 rows cost about what one row
does: the weight is read once either way, and the multiply-adds of 8 rows fit in the time it takes to read it.
It is a real operator (schema, fake tensor), so eager code and inductor graphs (compiled.py) call the same thing.
The same library holds `torch.ops.eagle.quant_panel_linear` (quant_linear.cpp), the kernel on weights kept in
their GGUF blocks (quant_panels.py).

The library is built at first use with the machine's compiler (`$CXX` or g++, `-march=native`, OpenMP through
torch's own runtime) in a few seconds, and cached under `cache_dir()/kernels`, keyed on its source, torch, the
compiler and the CPU (model and every flag: a build for one CPU is never loaded on another). Where it cannot be
built (no compiler, no torch headers) `available()` is False and says why once; the few-row plan then never
names it (few_rows.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("panel_linear.cpp")
# built into the same library: the kernel over weights kept in GGUF blocks (quant_panels.py), the batch-invariant
# attention of the bases that use it (row_attention.py) and the KV cache's compaction (kv_cache.py)
SOURCES = (SOURCE, *(Path(__file__).with_name(f) for f in ("quant_linear.cpp", "row_attention.cpp", "kv_rows.cpp")))
_lock = threading.Lock()
_state: dict = {}  # "ok": bool once tried; "why": the reason it is unavailable; "path": the library loaded


def _cpu_identity() -> str:
    """The CPU's model name and flags (all of them: -march=native depends on every one)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        import platform

        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "g++")


def build_command(cxx: str, out: Path, flags: tuple[str, ...] = ()) -> list[str]:
    """The compiler's command line for the library at `out`; `flags` go after -march=native (the tests build the
    AVX2 code on AVX-512 machines with -mno-avx512f)."""
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        cxx, "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *map(str, SOURCES),
        f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}", "-o", str(out),
    ]  # fmt: skip


def library_path(cxx: str) -> Path:
    from eagle.fetch import cache_dir

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha256(
        "\0".join([*(s.read_text() for s in SOURCES), torch.__version__, version, _cpu_identity(), sys.platform])
        .encode()
    ).hexdigest()[:16]
    return cache_dir() / "kernels" / f"panel_linear-{key}.so"


def _build_and_load() -> None:
    if sys.platform != "linux":
        raise RuntimeError(f"built for Linux only (this is {sys.platform})")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (install g++ or set $CXX)")
    path = library_path(cxx)
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run(build_command(cxx, tmp), capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit status {done.returncode}"]
            first_error = next((line for line in lines if "error" in line), lines[-1])
            raise RuntimeError(f"{cxx} failed on {' '.join(map(str, SOURCES))}: {first_error.strip()}")
        tmp.replace(path)
    torch.ops.load_library(str(path))
    torch.library.register_fake("eagle::panel_linear")(_panel_linear_shape)  # shapes for tracing (compiled.py)
    torch.library.register_fake("eagle::quant_panel_linear")(_quant_panel_linear_shape)
    torch.library.register_fake("eagle::row_attention")(_row_attention_shape)
    _state["path"] = path


def available(log=None) -> bool:
    """Whether `torch.ops.eagle.panel_linear` can run here: built (or found in the cache) and loaded on first call.
    A failure is said once, with its reason, in `log` (default: a line on stderr)."""
    with _lock:
        if "ok" not in _state:
            try:
                _build_and_load()
                _state["ok"] = True
            except Exception as e:  # noqa: BLE001 - any build or load failure means: use the other kernels
                _state.update(ok=False, why=f"{type(e).__name__}: {' '.join(str(e).split())}")
                (log or _stderr)(f"panel kernel unavailable ({_state['why']}); decode-sized linears use the other "
                                 "kernels")  # fmt: skip
        return _state["ok"]


def loaded() -> bool:
    """Whether the library is loaded already (`available` said yes); never builds it."""
    return _state.get("ok", False)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def width() -> int:
    """Columns per panel (NB) of the build loaded here: 48 with AVX-512, 16 with AVX2."""
    return torch.ops.eagle.panel_width()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] -> its panels [ceil(N / NB), K, NB], zero columns past N (a new tensor)."""
    nb = width()
    n, k = weight.shape
    padded = torch.zeros(-(-n // nb) * nb, k, dtype=torch.float32)  # [P * NB, K]
    padded[:n] = weight.detach().float()
    return padded.view(-1, nb, k).transpose(1, 2).contiguous()  # [P, K, NB]


def _panel_linear_shape(x, panels, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def _quant_panel_linear_shape(x, panels, bias, out_features, qtype, input_bits=8, streamed=False):
    return x.new_empty(*x.shape[:-1], out_features)


def _row_attention_shape(q, k, v, mask, scale):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
