"""Command line: `python launch.py [--model-type smollm2|llama3|llama3.1|vicuna|llama2|mixtral|qwen2] ...`."""

from __future__ import annotations

import argparse
import os
import sys

from eagle.chat.model_types import ALIASES, COMPILE_MODES, DTYPES, MODEL_TYPES, ModelLoadError

EXAMPLES = """examples:
  python launch.py                                   # SmolLM2-135M-Instruct + its EAGLE-3 head, on CPU
  python launch.py --model-type llama3.1             # Llama-3.1-8B-Instruct + EAGLE3-LLaMA3.1-Instruct-8B
  python launch.py --model-type vicuna --base-model-path ~/models/vicuna-7b-v1.3 --ea-model-path ~/models/eagle
  python launch.py --share --auth me:secret          # a public link, with a login
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch.py", description="Chat with an EAGLE speculative decoder in the browser.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    types = [*MODEL_TYPES, *ALIASES]
    p.add_argument("--model-type", default="smollm2", metavar="TYPE", help=f"chat template and default "
                   f"checkpoints: {', '.join(types)} (default: smollm2, the embedded model)")  # fmt: skip
    p.add_argument("--base-model-path", help="base model folder or hub id (default: the model type's)")
    p.add_argument("--ea-model-path", help="EAGLE head folder or hub id (default: the model type's)")
    p.add_argument("--total-token", type=int, default=None,
                   help="draft tree size per round; -1 = pick by timing (default: 60 on GPU, 4 on CPU)")
    p.add_argument("--depth", type=int, default=None, help="draft tree depth (default: 7 on GPU, 3 on CPU)")
    p.add_argument("--top-k", type=int, default=None, help="draft tree branching (default: 10 on GPU, 3 on CPU)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights dtype; auto = float32 on CPU, float16 on GPU (bfloat16 for qwen2)")  # fmt: skip
    p.add_argument("--draft-dtype", default="auto", choices=DTYPES,
                   help="draft head dtype; auto = under a float32 base on CPU, float32 or bfloat16, whichever "
                   "drafts faster on this machine (timed once, cached; lossless: the base verifies every token), "
                   "else the base's")  # fmt: skip
    p.add_argument("--device-map", default=None, help="transformers device_map (default: auto on GPU, cpu)")
    p.add_argument("--compile", default="auto", choices=COMPILE_MODES,
                   help="compiled rounds (CPU: inductor; CUDA: CUDA graphs), prepared in the background while the "
                   "page serves eagerly (minutes on a small CPU; eager if compiling fails): on, off, or auto = kept "
                   "where they measure faster than eager on this machine (default)")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=512, help="default reply length limit (default 512)")
    p.add_argument("--max-length", type=int, default=2048,
                   help="context budget, prompt + reply (default 2048, capped by the model's)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 = all)")
    p.add_argument("--port", type=int, default=None, help="port (default: 7860 or the next free one)")
    p.add_argument("--share", action="store_true", help="also make a public *.gradio.live link (use --auth)")
    p.add_argument("--auth", metavar="USER:PASSWORD", help="require this login")
    p.add_argument("--no-warmup", action="store_true", help="skip the short warm-up generation")
    return p


def parse_auth(value: str | None):
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise SystemExit("--auth needs USER:PASSWORD, for example --auth alice:s3cret")
    return (user, password)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    auth = parse_auth(args.auth)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        engine = load_engine(args)
    except ModelLoadError as e:
        print(f"\nCannot start: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from .ui import build, launch_options

    demo = build(engine, max_new_tokens=args.max_new_tokens)
    if args.share and not auth:
        print("note: --share makes the page public; consider --auth USER:PASSWORD")
    try:
        demo.launch(server_name=args.host, server_port=args.port, share=args.share, auth=auth,
                    prevent_thread_lock=True, **launch_options())  # fmt: skip
    except OSError as e:  # the port is taken, or the address is not this machine's
        print(f"\nCannot serve on {args.host}:{args.port or 'default port'}: {e}\n"
              "Pick another with --port N (or --host).", file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    print(f"\nEAGLE chat ready: {demo.local_url}")
    if args.share:
        if demo.share_url:
            print(f"public link: {demo.share_url}")
        else:
            print("Could not create the public --share link (the tunnel needs internet access to gradio.live); "
                  f"still serving locally at {demo.local_url}")  # fmt: skip
    try:
        engine.serve_model_calls()  # the model runs on this thread (see app/engine.py)
    except KeyboardInterrupt:
        print("stopping")
    finally:
        demo.close()


def load_engine(args):
    """Model type -> loaded model -> Engine (with a warm-up). Raises ModelLoadError."""
    from eagle.chat.model_types import load, model_type
    from eagle.chat.templates import default_system_prompt

    from .engine import Engine

    mtype = model_type(args.model_type)
    if args.base_model_path or args.ea_model_path:
        print(f"Loading with model type '{mtype.name}' (its chat template) and the paths given")
    else:
        print(f"Loading model type '{mtype.name}'" + (f" ({mtype.note})" if mtype.note else ""))
    # compiling takes minutes: the page serves eagerly first and the compiled rounds come in when ready
    loaded = load(mtype, args.base_model_path, args.ea_model_path, args.total_token, args.depth, args.top_k,
                  args.dtype, args.device_map, stages=3, draft_dtype=args.draft_dtype, compile="off")  # fmt: skip
    model = loaded.model
    info = {
        "model_type": mtype.name, "base": args.base_model_path or mtype.base or "SmolLM2-135M-Instruct (embedded)",
        "head": args.ea_model_path or mtype.head, "draft": "EAGLE-3" if model.use_eagle3 else "EAGLE-1/2",
        **describe_forwards(model), "dtype_device": f"{loaded.dtypes} / {loaded.device}",
    }  # fmt: skip
    system = mtype.system_prompt or default_system_prompt(mtype.template)
    name = f"{mtype.name}: {os.path.basename(str(info['base']).rstrip('/'))} + {info['draft']} head"
    engine = Engine(model, mtype.template, args.max_length, name=name, default_system=system, info=info)
    if not args.no_warmup:
        print("[3/3] warming up (one short generation each way), then timing vanilla decoding for the speedup")
        engine.warmup()
        tps, _ = engine.measure_baseline()
        print(f"      vanilla decoding: {tps:.1f} tokens/s")
    if args.compile != "off" and loaded.device == "cpu":
        engine.info["forwards"] += " (compiled rounds being prepared in the background)"
        engine.compile_in_background(args.compile, lambda line: print(f"[compile] {line}"), describe_forwards)
    return engine


def describe_forwards(model) -> dict:
    """The Model panel's lines that change when compiled rounds come in."""
    from eagle.chat.model_types import forwards_description, tree_description

    return {"tree": tree_description(model), "forwards": forwards_description(model)}
