"""What a base forward over n new tokens costs: the verify pass of an n-node tree, in one-token decode steps.

    python -m eagle.evaluation.pass_cost --threads 2                    # the embedded default model
    python -m eagle.evaluation.pass_cost --rows 1,2,4,8,16,32,60 --model-type llama3.1 --dtype float16

For each n: the median wall time of the engine's base forward over n tokens after a --context prefix
(features included, as in a verify pass), with the kernel plan measured on this machine, and on CPU in float32
the same with each few-row kernel (eagle/kernels/few_rows.py: F.linear, W @ x^T, MKL-packed, panel: on GGUF blocks
with `--weights q4_1`) for every row count, eagerly (with --compile, the engine column times the compiled graphs
where a bucket holds the rows).
The ratio to the 1-row time is what verifying an n-node tree costs in decode steps:
with a head that accepts tau tokens per forward, a tree pays off when tau exceeds it (plus the draft's share).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from eagle.kernels import few_rows
from eagle.tuning.cost_cache import cpu_description

from .floor import floor, read_bytes_per_token
from .models import add_model_args, device_name, exit_on_bad_options, load_from_args, log


def measure(model, rows: list[int], context: int, repeats: int) -> dict:
    """Median ms per row count: with the engine as loaded (its kernel plan), and (float32 CPU layers) with each
    few-row kernel for every row count."""

    def ms():
        return {n: 1e3 * s for n, s in model.base.pass_seconds(rows, context, repeats).items()}

    base, compiled = model.base_model, model.base.compiled
    plan = few_rows.plan_of(base)  # None: the plan measured all-F.linear here, or not float32 on CPU, or compiled
    in_graphs = [n for n in rows if compiled is not None and compiled.bucket(n) is not None]
    result = {"rows": rows, "engine_ms": ms(), "plan": plan, "kernel_ms": {}, "compiled_rows": in_graphs}
    if plan is not None or few_rows.install(base):
        model.base.compiled = None  # the kernels' columns time eager forwards (a graph would take bucketed rows)
        try:
            for k in few_rows.usable_kernels():
                few_rows.set_plan(base, few_rows.uniform_plan(k))
                result["kernel_ms"][k] = ms()
        finally:
            few_rows.set_plan(base, plan) if plan is not None else few_rows.uninstall(base)
            model.base.compiled = compiled
    return result


def table(result: dict) -> str:
    engine, kernels = result["engine_ms"], result["kernel_ms"]
    step = engine[1] if 1 in engine else None
    fl = (result.get("floor") or {}).get("ms_per_token")
    plan, compiled = result.get("plan") or {}, result.get("compiled_rows", [])
    head = "| rows | engine ms | kernel | in 1-row steps | in floor steps |" + "".join(f" {k} ms |" for k in kernels)
    lines = [head, "|---:|---:|:---|---:|---:|" + "---:|" * len(kernels)]
    for n in result["rows"]:
        line = f"| {n} | {engine[n]:.1f} | {'compiled' if n in compiled else plan.get(n, 'linear')} |"
        line += f" {engine[n] / step:.2f} |" if step else " – |"
        line += f" {engine[n] / fl:.2f} |" if fl else " – |"
        line += "".join(f" {kernels[k][n]:.1f} |" for k in kernels)
        lines.append(line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle.evaluation.pass_cost", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    g = p.add_argument_group("pass cost")
    g.add_argument("--rows", default="1,2,3,4,6,8,16", help="comma list of new-token counts (default 1,2,3,4,6,8,16)")
    g.add_argument("--context", type=int, default=256, help="tokens already in the cache (default 256)")
    g.add_argument("--repeats", type=int, default=15, help="timed calls per row count; the median is kept")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--json", default=None, help="also write the numbers here")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with exit_on_bad_options():
        rows = sorted({int(r) for r in args.rows.split(",")})
        if rows[0] < 1 or args.context < 1 or args.repeats < 1:
            raise ValueError("--rows, --context and --repeats must be >= 1")
        loaded = load_from_args(args, log, few_row_kernels="auto")  # the plan this machine measures best
    result = measure(loaded.model, rows, args.context, args.repeats)
    bound = floor(loaded.model.base_model, loaded.device, read_bytes_per_token(loaded.model.base_model))
    result.update(device=device_name(loaded.device), cpu=cpu_description(), floor=bound, model=loaded.describe(),
                  context=args.context)  # fmt: skip
    print(f"{result['device']}; base {result['model']['base']} ({loaded.dtype}, weights {loaded.weights}), "
          f"{args.context} cached tokens")  # fmt: skip
    print(f"bandwidth floor: {bound['weight_mb']:.1f} MB of weights per token at {bound['bandwidth_gb_s']:.1f} GB/s "
          f"= {bound['ms_per_token']:.2f} ms per one-token step")  # fmt: skip
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
