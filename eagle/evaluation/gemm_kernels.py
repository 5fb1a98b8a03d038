"""How fast inductor's GEMMs and the project's panel kernel run a decode-sized matmul on this CPU.

    python -m eagle.evaluation.gemm_kernels --threads 2                 # 8 rows through 20 [1536 x 576] weights
    python -m eagle.evaluation.gemm_kernels --threads 2 --rows 16 --variants '{}' panel
    python -m eagle.evaluation.gemm_kernels --rows 1 --dtype bfloat16 \\
        --variants '{}' '{"max_autotune_gemm_backends": "ATEN"}'

A stack of `--layers` bias-free linears of [N, K] (one graph, weights frozen as in eagle/runtime/compiled.py) is
compiled once per variant (a JSON object of inductor options over compiled.py's, e.g. `cpp.gemm_cache_blocking`,
`cpp.gemm_thread_factors`, `max_autotune_gemm_backends`; or `panel`: the panel kernel, eagle/kernels/panel_kernel.py,
called eagerly as the few-row layers call it) and the variants are timed interleaved in one process,
so the machine's drift hits them alike. Reported: median ms, the weights' bytes per second (a GEMV's limit is the
machine's bandwidth) and GFLOP/s (a GEMM's limit is its FMA peak). The compiled verify pass's cost per row count
(pass_cost.py) follows from these two limits.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
from torch import nn

from eagle.kernels import few_rows, panel_kernel
from eagle.runtime.compiled import OPTIONS, freeze_without_mkl_packing
from eagle.tuning.cost_cache import cpu_description


class Stack(nn.Module):
    """`layers` linears of [n, k], each applied to the same rows (a decode step's matmuls, without what is between)."""

    def __init__(self, n: int, k: int, layers: int):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(k, n, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [linear(x) for linear in self.linears]


def panel_stack(stack: Stack):
    """The stack's linears on the panel kernel, as the few-row layers run them (eager calls of the operator)."""
    if not panel_kernel.available():
        sys.exit(f"the panel variant needs the panel kernel, unavailable here: {panel_kernel._state.get('why')}")
    fast = copy.deepcopy(stack)
    few_rows.install(fast, few_rows.uniform_plan("panel"))

    def run(x):
        with few_rows.few_row_kernels():
            return fast(x)

    return run


def measure(n: int, k: int, layers: int, rows: int, dtype: torch.dtype, variants: list[dict], repeats: int = 40):
    """One row per variant: {options, ms, gb_s, gflop_s, error} (error: max |compiled - eager|)."""
    torch.manual_seed(0)
    freeze_without_mkl_packing()  # frozen as compiled.py freezes (and a later graph of this process can be cached)
    stack = Stack(n, k, layers).eval().to(dtype)
    x = torch.randn(rows, k, dtype=dtype)
    torch._dynamo.mark_static(x, 0)
    graphs = []
    with torch.inference_mode():
        for options in variants:
            if options == "panel":
                graph, inductor = panel_stack(stack), {}
            else:
                graph, inductor = torch.compile(copy.deepcopy(stack), dynamic=False), options
            with torch._inductor.config.patch({**OPTIONS, "fx_graph_cache": False, **inductor}):
                out = graph(x)  # compiles under the variant's options
            error = max(float((a.float() - lin(x).float()).abs().max()) for a, lin in zip(out, stack.linears))
            graphs.append((graph, error))
        times = [[] for _ in graphs]
        for _ in range(repeats):
            for i, (graph, _) in enumerate(graphs):
                t0 = time.perf_counter()
                graph(x)
                times[i].append(time.perf_counter() - t0)
    weight_bytes = layers * n * k * x.element_size()
    result = []
    for options, (_, error), t in zip(variants, graphs, times):
        s = sorted(t)[len(t) // 2]
        result.append({"options": options, "ms": 1e3 * s, "gb_s": weight_bytes / s / 1e9,
                       "gflop_s": 2 * rows * layers * n * k / s / 1e9, "error": error})  # fmt: skip
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle.evaluation.gemm_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1536, help="output features (default 1536, SmolLM2's MLP)")
    p.add_argument("--k", type=int, default=576, help="input features (default 576)")
    p.add_argument("--layers", type=int, default=20, help="stacked weights, enough to leave the caches (default 20)")
    p.add_argument("--rows", type=int, default=8, help="rows of the activation (tree nodes; default 8)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--variants", nargs="+", default=["{}", '{"cpp.gemm_cache_blocking": "1,1,576"}',
                                                      '{"max_autotune_gemm_backends": "ATEN"}'],
                   help="JSON objects of inductor options, one per variant, or panel (the panel kernel); default: "
                   "as compiled.py, the whole K per cache block, MKL")  # fmt: skip
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        variants = [v if v == "panel" else json.loads(v) for v in args.variants]
    except json.JSONDecodeError as e:
        sys.exit(f"--variants: each must be a JSON object of inductor options or panel ({e})")
    result = measure(args.n, args.k, args.layers, args.rows, getattr(torch, args.dtype), variants, args.repeats)
    cpu = cpu_description()
    flags = " ".join(cpu["flags"])
    print(f"CPU: {cpu['model']} ({cpu['cpus']} CPUs; {flags}), torch threads {torch.get_num_threads()}")
    print(f"{args.rows} rows through {args.layers} x [{args.n} x {args.k}] {args.dtype} weights, compiled (frozen)")
    print("| options | ms | GB/s of weights | GFLOP/s | max error |\n|:---|---:|---:|---:|---:|")
    for r in result:
        options = "panel kernel" if r["options"] == "panel" else f"`{json.dumps(r['options'])}`"
        print(f"| {options} | {r['ms']:.3f} | {r['gb_s']:.1f} | {r['gflop_s']:.0f} | {r['error']:.1e} |")
    return result


if __name__ == "__main__":
    main()
