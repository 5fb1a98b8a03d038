"""Command line: `python launch.py [--model-type smollm2|llama3|llama3.1|vicuna|llama2|mixtral|qwen2] ...`."""

from __future__ import annotations

import argparse
import os
import sys

from eagle.chat.model_types import ALIASES, COMPILE_MODES, DTYPES, MODEL_TYPES, WEIGHTS, ModelLoadError

from .engine import KEPT_MB, KV_BUDGET_MB
from .model_queue import MAX_WAITING

EXAMPLES = """examples:
  python launch.py                                   # SmolLM2-135M-Instruct + its EAGLE-3 head, on CPU
  python launch.py --model-type llama3.1             # Llama-3.1-8B-Instruct + EAGLE3-LLaMA3.1-Instruct-8B
  python launch.py --model-type vicuna --base-model-path ~/models/vicuna-7b-v1.3 --ea-model-path ~/models/eagle
  python launch.py --share --auth me:secret --api-key KEY   # a public link, with a login (and a key for /v1)

The OpenAI-compatible API is served on the same port: http://HOST:PORT/v1 (docs/openai-api.md).
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eagle-chat" if os.path.basename(sys.argv[0]) == "eagle-chat" else "launch.py",  # the console script
        description="Chat with an EAGLE speculative decoder in the browser.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    types = [*MODEL_TYPES, *ALIASES]
    p.add_argument("--model-type", default="smollm2", metavar="TYPE", help=f"chat template and default "
                   f"checkpoints: {', '.join(types)} (default: smollm2, the embedded model)")  # fmt: skip
    p.add_argument("--base-model-path", help="base model folder or hub id (default: the model type's)")
    p.add_argument("--ea-model-path", help="EAGLE head folder or hub id (default: the model type's)")
    p.add_argument("--total-token", type=int, default=None,
                   help="draft tree size per round; -1 = pick by timing. Default: with no tree option and a head "
                   "that ships an acceptance profile (the embedded default's), the tree is tuned on this machine "
                   "(size, depth and top-k; the Model panel shows the pick); else 60 on GPU, 4 on CPU")  # fmt: skip
    p.add_argument("--depth", type=int, default=None, help="draft tree depth (default: tuned, else 7 on GPU, 3 on CPU)")
    p.add_argument("--top-k", type=int, default=None,
                   help="draft tree branching (default: tuned, else 10 on GPU, 3 on CPU)")  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights dtype; auto = float32 on CPU, float16 on GPU (bfloat16 for qwen2)")  # fmt: skip
    p.add_argument("--draft-dtype", default="auto", choices=DTYPES,
                   help="draft head dtype; auto = under a float32 base on CPU, float32 or bfloat16, whichever "
                   "drafts faster on this machine (timed once, cached; lossless: the base verifies every token), "
                   "else the base's")  # fmt: skip
    p.add_argument("--weights", default="auto", choices=WEIGHTS,
                   help="the base's weights on CPU: auto (default) = q4_1 for the embedded default converted from its "
                   "GGUF, else fp32; q4_1 = the GGUF's own 4-bit blocks (and its 8-bit embedding) read by the panel "
                   "kernel, inputs rounded to 8 bits a block as llama.cpp does: vanilla and EAGLE both about 3x as "
                   "fast as at fp32, EAGLE's lead over vanilla smaller there (docs/benchmarks.md); fp32 = the blocks "
                   "dequantized (the Model panel says which)")  # fmt: skip
    p.add_argument("--device-map", default=None, help="transformers device_map (default: auto on GPU, cpu)")
    p.add_argument("--compile", default="auto", choices=COMPILE_MODES,
                   help="compiled rounds (CPU: inductor; CUDA: CUDA graphs), prepared in the background while the "
                   "page serves eagerly (minutes on a small CPU; eager if compiling fails): on, off, auto = kept "
                   "where they measure faster than eager on this machine (default), or inductor = on, and on CUDA "
                   "with inductor's fused kernels in the graphs (faster steps; minutes to compile the first time)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="default reply length limit (default 512)")
    p.add_argument("--max-length", type=int, default=None,
                   help="context, prompt + reply, in tokens (default: the base's window, as much of it as "
                   "--kv-budget-mb holds)")  # fmt: skip
    p.add_argument("--kv-budget-mb", type=float, default=KV_BUDGET_MB, metavar="MB",
                   help=f"memory one conversation's KV caches may take, the base's and the head's (default "
                   f"{KV_BUDGET_MB}): bounds the context where the base's window would take more")  # fmt: skip
    p.add_argument("--kept-mb", type=float, default=KEPT_MB, metavar="MB",
                   help=f"memory the conversations' caches kept between turns may take together (default {KEPT_MB}): "
                   "a turn then prefills only its new message; the least recently used conversation is dropped "
                   "first, and starts its next turn from the whole prompt")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 = all)")
    p.add_argument("--port", type=int, default=None, help="port (default: 7860 or the next free one)")
    p.add_argument("--share", action="store_true", help="also make a public *.gradio.live link (use --auth)")
    p.add_argument("--auth", metavar="USER:PASSWORD", help="require this login (the page; the API has --api-key)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("EAGLE_API_KEY") or None,
                   help="require this key on the OpenAI-compatible API (/v1/*) as 'Authorization: Bearer KEY' "
                   "(default: $EAGLE_API_KEY; none = open, unless --auth is set: then /v1 is refused until a key is "
                   "given); /health stays open")  # fmt: skip
    p.add_argument("--queue-size", type=int, default=MAX_WAITING, metavar="N",
                   help=f"generations that may wait for the model, the page's and the API's together, in arrival "
                   f"order (default {MAX_WAITING}); past it the API answers 503 with Retry-After")  # fmt: skip
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
    if args.kv_budget_mb <= 0:
        raise SystemExit("--kv-budget-mb needs a positive number of MB, for example --kv-budget-mb 2048")
    if args.kept_mb < 0:
        raise SystemExit("--kept-mb needs a number of MB, 0 or more (0 keeps no conversation's caches)")
    if args.max_length is not None and args.max_length < 2:
        raise SystemExit("--max-length needs at least 2 tokens (a prompt token and a reply token)")
    if args.queue_size < 1:
        raise SystemExit("--queue-size needs a number of at least 1")
    if args.api_key is not None and not args.api_key.strip():
        raise SystemExit("--api-key needs a key, for example --api-key $(openssl rand -hex 16)")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        engine = load_engine(args)
    except ModelLoadError as e:
        print(f"\nCannot start: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    from .openai_api import OpenAIServer
    from .ui import build, launch_options

    engine.queue.max_waiting = args.queue_size
    demo = build(engine, max_new_tokens=args.max_new_tokens)
    api = OpenAIServer(engine, max_new_tokens=args.max_new_tokens, api_key=args.api_key, locked=api_lock(args, auth))
    if args.share and not auth:
        print("note: --share makes the page public; consider --auth USER:PASSWORD"
              + ("" if args.api_key else " (and --api-key KEY for the API)"))  # fmt: skip
    try:
        demo.launch(server_name=args.host, server_port=args.port, share=args.share, auth=auth,
                    prevent_thread_lock=True, app_kwargs=api.app_kwargs(), **launch_options())  # fmt: skip
    except OSError as e:  # the port is taken, or the address is not this machine's
        print(f"\nCannot serve on {args.host}:{args.port or 'default port'}: {e}\n"
              "Pick another with --port N (or --host).", file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    print(f"\nEAGLE chat ready: {demo.local_url}")
    print(f"OpenAI-compatible API: {demo.local_url}v1 (model {api.model_id!r}"
          + (", key required)" if args.api_key else ", refused: --auth without --api-key)" if api.locked else ")"))
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


def api_lock(args, auth) -> str | None:
    """Why /v1 is refused: the page has a login and the API no key (it would be open where the page is not)."""
    if auth and not args.api_key:
        return ("This server's page needs a login (--auth) and its API has no key: start it with --api-key KEY "
                "to use the API.")  # fmt: skip
    return None


def load_engine(args):
    """Model type -> loaded model -> Engine (with a warm-up). Raises ModelLoadError."""
    from eagle.chat.model_types import load, model_type
    from eagle.chat.templates import default_system_prompt

    from .engine import Engine
    from .idle_work import vanilla_reference

    mtype = model_type(args.model_type)
    if args.base_model_path or args.ea_model_path:
        print(f"Loading with model type '{mtype.name}' (its chat template) and the paths given")
    else:
        print(f"Loading model type '{mtype.name}'" + (f" ({mtype.note})" if mtype.note else ""))
    big = mtype.base is not None and not args.base_model_path and not _cuda()
    if big:
        print(f"note: {mtype.base} has billions of parameters and wants a GPU; none is visible here, so it would "
              "decode very slowly on this CPU (the embedded default, `python launch.py`, suits a CPU)")  # fmt: skip
    # compiling takes minutes: the page serves eagerly first and the compiled rounds come in when ready
    try:
        loaded = load(mtype, args.base_model_path, args.ea_model_path, args.total_token, args.depth, args.top_k,
                      args.dtype, args.device_map, stages=3, draft_dtype=args.draft_dtype, compile="off",
                      weights=args.weights)  # fmt: skip
    except ModelLoadError as e:
        if big:
            raise ModelLoadError(f"{e}\n(Also: {mtype.base} wants a GPU, and this machine shows none.)") from None
        raise
    model = loaded.model
    info = {
        "model_type": mtype.name, "base": args.base_model_path or mtype.base or "SmolLM2-135M-Instruct (embedded)",
        "head": args.ea_model_path or mtype.head, "draft": "EAGLE-3" if model.use_eagle3 else "EAGLE-1/2",
        **describe_forwards(model), "dtype_device": f"{loaded.dtypes} / {loaded.device}",
    }  # fmt: skip
    system = mtype.system_prompt or default_system_prompt(mtype.template)
    name = f"{mtype.name}: {os.path.basename(str(info['base']).rstrip('/'))} + {info['draft']} head"
    engine = Engine(model, mtype.template, args.max_length, name=name, default_system=system, info=info,
                    kv_budget_mb=args.kv_budget_mb, kept_mb=args.kept_mb)
    engine.describe = describe_forwards
    if not args.no_warmup:
        print("[3/3] warming up (one short generation each way); vanilla decoding is timed once the page is up")
        engine.warmup()
    start_compiled_rounds(engine, loaded, args.compile)
    engine.add_job(vanilla_reference(engine, engine.path), first=True)  # the page's speedup needs it first
    return engine


def start_compiled_rounds(engine, loaded, mode: str, log=lambda line: print(f"[compile] {line}")) -> None:
    """Compiled rounds for `engine`: on CUDA, CUDA graphs captured now (seconds); on a CPU, compiled by child
    processes (minutes the first time) and brought in by the idle work (app/idle_work.py)."""
    from dataclasses import replace

    from eagle.model.compiling import compile_rounds

    from .idle_work import compiled_rounds, first_stage, first_tree, saved_verdict
    from .precompile import ChildCompile, compiled_before

    loaded.model.runtime = replace(loaded.model.runtime, compile=mode)  # loaded with "off": compiled from here on
    if mode == "off":
        return
    if loaded.device != "cpu":
        if compile_rounds(loaded.model, log):
            loaded.model.try_compile_round(log)  # the greedy round's own graphs (eagle/runtime/cuda_round.py)
        engine.info.update(describe_forwards(loaded.model))
        engine.describe_context()
        return
    spec = compile_spec(loaded)
    verdict = saved_verdict(spec.key())
    if mode == "auto" and verdict is not None and not verdict["compiled_pays"]:
        engine.status = "eager: compiled forwards measured slower here before (--compile on to use them anyway)"
        return
    first = first_stage(spec, first_tree(loaded.model))  # what compiled rounds need; the rest after they are in use
    if not compiled_before(first):
        log(f"compiling {len(first.graphs())} graphs in child processes, stopped whenever the model decodes or "
            f"measures")  # fmt: skip
        engine.child = ChildCompile(first)
    engine.add_job(compiled_rounds(engine, engine.child, spec, mode, log))
    engine.status = "compiled rounds being prepared"


def compile_spec(loaded):
    """The graphs to compile for the loaded model: the base's 1-row step, its tree's verify bucket, the 8-row one
    (and the 4-row one where the base reads GGUF blocks), the draft's up to what a level or a commit of the tree
    spans, the head in one dtype: in GGUF blocks (compiling.QUANTIZED_HEAD) where the panel kernel runs under a float32
    base (its quantized kernel reads them in the graphs), else the head's own."""
    import torch

    from eagle.kernels import few_rows, quant_panels
    from eagle.model.compiling import QUANTIZED_HEAD, quantized_head_pays
    from eagle.runtime.compiled import BUCKETS, bucket_for
    from eagle.runtime.compiled_draft import DRAFT_BUCKETS

    from .precompile import CompileSpec

    model, tree = loaded.model, loaded.model.tree
    panel = "panel" in few_rows.usable_kernels() and model.base.dtype == torch.float32
    # a large head in GGUF blocks (a sixth of the bytes a draft pass reads: its round draft step timed fastest here,
    # docs/benchmarks.md), else the base's dtype where the panel kernel runs, else the head's own
    quantized = quantized_head_pays(model.base.dtype, model.ea_layer)
    draft_dtype = (quant_panels.NAMES[QUANTIZED_HEAD] if quantized
                   else loaded.dtype if panel else model.ea_layer.dtype_name)  # fmt: skip
    verify = bucket_for(min(tree.max_nodes, max(BUCKETS)), BUCKETS)
    # a base reading GGUF blocks verifies 4 rows for much less than 8: its 4-row graph lets the tuner price 4-node trees
    quantized_base = few_rows.reads_gguf_blocks(model.base_model)
    draft = bucket_for(min(max(tree.top_k, tree.depth + 1), max(DRAFT_BUCKETS)), DRAFT_BUCKETS)
    return CompileSpec(
        base_path=os.path.realpath(loaded.base_path), head_path=os.path.realpath(loaded.head_path), dtype=loaded.dtype,
        draft_dtype=draft_dtype,
        few_row_plan=few_rows.plan_of(model.base_model), threads=torch.get_num_threads(),
        base_buckets=tuple(sorted({1, 8, verify} | ({4} if quantized_base else set()))),
        draft_buckets=tuple(b for b in DRAFT_BUCKETS if b <= draft),
    )  # fmt: skip


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def describe_forwards(model) -> dict:
    """The Model panel's lines that change when compiled rounds come in (the weights the linears read too: the
    kernels in use decide whether they read the GGUF's blocks)."""
    from eagle.chat.model_types import forwards_description, tree_description
    from eagle.kernels import few_rows

    # the tuner's predicted tokens/s are not shown: replies' own figures are (engine.reply_figures)
    return {"tree": tree_description(model, predictions=False), "forwards": forwards_description(model),
            "weights": few_rows.weights_of(model.base_model)}  # fmt: skip
