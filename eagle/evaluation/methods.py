"""One runner per decoding method: prompt ids -> (new token ids, wall seconds, base forward passes).

- hf            transformers `generate` on the plain base model (greedy, or sampling at --temperature)
- hf_pld        the same with prompt-lookup decoding (`prompt_lookup_num_tokens`)
- hf_assisted   the same with a small assistant model (`assistant_model`)
- vanilla       our `naivegenerate`: one token per base forward, on the engine's own code and cache
- eagle         the loaded head with the EAGLE-2 dynamic tree (total_token, depth, top_k)
- eagle_ctx     the same, with context drafts (copies of earlier text) in the same tree where they measure worth it
- eagle_static  the same head with EAGLE-1's static tree (MC_SIM_7B_63)
- llama_cpp     llama.cpp (llama-cpp-python, an optional extra) on the base as GGUF F32, greedy; llama_cpp_f16 and
                llama_cpp_q4_1 on F16 and Q4_1 files: other precisions (eagle/evaluation/llamacpp.py)

All methods get the same max_new_tokens and stop at the model's stop ids (EOS and end-of-turn tokens, which the
hf methods receive as `eos_token_id`). The wall time covers the whole call (prefill included); on CUDA the device
is synchronised before and after. A runner also takes `conversation` (a key): our engine's methods pass it to
`EaModel.stream`, which starts from the caches that conversation's last turn left (the app's kept conversation) and
reports the prompt tokens it read from them; the hf methods and llama.cpp prefill the whole prompt every call (hf's
`generate` is given no cache, the llama.cpp runner empties its own) and ignore it. Every runner reports the time to
its first token (`prefill_s`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from eagle.timing import timed

LLAMA_CPP_METHODS = ("llama_cpp", "llama_cpp_f16", "llama_cpp_q4_1")  # not in DEFAULT_METHODS: an optional extra
METHODS = ("hf", "hf_pld", "hf_assisted", "vanilla", "eagle", "eagle_ctx", "eagle_static", *LLAMA_CPP_METHODS)
DEFAULT_METHODS = ("hf", "hf_pld", "vanilla", "eagle", "eagle_static")
HF_METHODS = ("hf", "hf_pld", "hf_assisted")


@dataclass
class Output:
    tokens: list[int]  # the new token ids (stop token included)
    seconds: float
    forwards: int | None  # base forward passes, prefill included; None where the method does not report them
    drafted: int | None = None  # of the tokens, those drafted and accepted (our engine only)
    copied: int | None = None  # of those, context drafts (copies of earlier text)
    cached: int | None = None  # prompt tokens read from a kept conversation's cache, not prefilled (0: none)
    prefill_s: float | None = None  # seconds to the first new token (prefill included); None where not measured


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int = 512
    temperature: float = 0.0
    pld_tokens: int = 10  # prompt_lookup_num_tokens for hf_pld


Runner = Callable[..., Output]  # (prompt ids, conversation=None) -> Output


def _generation_config(model, settings: Settings, **extra):
    """An explicit config, so that defaults in the checkpoint's generation_config.json (sampling, top-k, top-p,
    repetition penalty) cannot make the baseline decode differently from the engine."""
    from transformers import GenerationConfig

    stops = sorted(model.stop_token_ids)
    pad = model.tokenizer.pad_token_id if model.tokenizer is not None else None
    common = dict(
        max_new_tokens=settings.max_new_tokens, eos_token_id=stops or None,
        pad_token_id=pad if pad is not None else (stops[0] if stops else 0),
        repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0, **extra,
    )  # fmt: skip
    if settings.temperature > 1e-5:
        return GenerationConfig(do_sample=True, temperature=settings.temperature, top_k=0, top_p=1.0, **common)
    return GenerationConfig(do_sample=False, **common)


class _FirstToken:
    """A `generate` streamer that notes when the first new token came (its first `put` is the prompt): the time to
    the first token from `start` (set as the call begins). transformers hands it the token on the host (`.cpu()`),
    so on CUDA the time holds the device's work."""

    def __init__(self):
        self.start, self.seconds, self._puts = time.perf_counter(), None, 0

    def put(self, value) -> None:
        self._puts += 1
        if self._puts == 2:
            self.seconds = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def hf_runner(model, settings: Settings, assistant: dict | None = None, **extra) -> Runner:
    """`assistant`: generate() arguments from `load_assistant`; `extra`: generation-config fields."""
    base = model.base_model
    device = base.get_input_embeddings().weight.device
    config = _generation_config(model, settings, **extra)
    kwargs = dict(assistant or {})

    def run(ids: list[int], conversation=None) -> Output:  # no cache kept: hf prefills the whole prompt every call
        x = torch.tensor([ids], device=device)
        first = _FirstToken()

        def go():
            first.start = time.perf_counter()
            return base.generate(x, attention_mask=torch.ones_like(x), generation_config=config, streamer=first,
                                 **kwargs)  # fmt: skip

        with torch.inference_mode():
            out, seconds = timed(device, go)
        return Output(out[0, len(ids) :].tolist(), seconds, None, cached=0, prefill_s=first.seconds)

    return run


def engine_runner(model, settings: Settings, eagle: bool, tree=None, context_drafts: bool = False) -> Runner:
    device = model.base_model.get_input_embeddings().weight.device
    extra = {"tree": tree} if eagle and tree is not None else {}

    def run(ids: list[int], conversation=None) -> Output:
        """conversation: a key of the model's prefix store (None: a cold start, nothing kept)."""
        x = torch.tensor([ids])
        kept = {"conversation": conversation} if conversation is not None else {}
        rounds, seconds = timed(device, lambda: list(model.stream(
            x, eagle=eagle, temperature=settings.temperature, max_new_tokens=settings.max_new_tokens,
            max_length=len(ids) + settings.max_new_tokens, context_drafts=context_drafts, **extra, **kept,
        )))  # fmt: skip
        tokens = [t for r in rounds for t in r.tokens]
        drafted, copied = sum(r.accepted for r in rounds), sum(r.context for r in rounds)
        first = rounds[0] if rounds else None  # the first round carries the prefill's figures
        cached, prefill_s = getattr(first, "cached", None), getattr(first, "prefill_s", None) or None
        return Output(tokens, seconds, len(rounds), drafted, copied, cached, prefill_s)  # a round per base forward

    return run


def llama_cpp_runner(name: str, model, settings: Settings, base_path: str, model_type: str = "") -> Runner:
    """llama.cpp greedy on the GGUF of `name`'s precision (converted from `base_path` once, cached); its `label`
    names the precision and the bytes a token reads."""
    from . import llamacpp

    if settings.temperature > 1e-5:
        raise ValueError(f"method {name} runs greedy only (--temperature 0)")
    path = llamacpp.gguf_path(name, base_path, model_type)
    precision, kv = llamacpp.PRECISIONS[name]
    n_ctx = min(4096, model.base_model.config.max_position_embeddings)  # KV cache positions (prompt + answer)
    go = llamacpp.runner(path, model.stop_token_ids, settings.max_new_tokens, kv_type=kv, n_ctx=n_ctx)

    def run(ids: list[int], conversation=None) -> Output:  # the runner empties llama.cpp's KV cache every prompt
        tokens, seconds, calls, prefill_s = go(ids, with_prefill=True)
        return Output(tokens, seconds, calls, cached=0, prefill_s=prefill_s)

    run.label = f"llama.cpp {llamacpp.version()}, GGUF {precision}, KV cache {kv}"
    run.weight_bytes = llamacpp.gguf_weight_bytes(path)  # per decoded token, for its own-precision floor
    return run


def make_runners(names: list[str], model, settings: Settings, assistant: dict | None = None,
                 base_path: str | None = None, model_type: str = "") -> dict[str, Runner]:  # fmt: skip
    """Runners for `names` (in that order). `model` is an EaModel, its tree spec the EAGLE-2 one; `assistant`
    comes from `load_assistant`; `base_path` is the base's local folder (the llama_cpp methods convert it)."""
    from eagle.decoding.generate import TreeSpec
    from eagle.decoding.tree import MC_SIM_7B_63

    runners: dict[str, Runner] = {}
    for name in names:
        if name == "hf":
            runners[name] = hf_runner(model, settings)
        elif name == "hf_pld":
            runners[name] = hf_runner(model, settings, prompt_lookup_num_tokens=settings.pld_tokens)
        elif name == "hf_assisted":
            if assistant is None:
                raise ValueError("method hf_assisted needs --assistant-model PATH")
            runners[name] = hf_runner(model, settings, assistant=assistant)
        elif name == "vanilla":
            runners[name] = engine_runner(model, settings, eagle=False)
        elif name in ("eagle", "eagle_ctx"):
            t = model.tree
            runners[name] = engine_runner(model, settings, True, TreeSpec(t.total_token, t.depth, t.top_k),
                                          context_drafts=name == "eagle_ctx")  # fmt: skip
        elif name == "eagle_static":
            runners[name] = engine_runner(model, settings, True, TreeSpec(choices=tuple(map(tuple, MC_SIM_7B_63))))
        elif name in LLAMA_CPP_METHODS:
            if base_path is None:
                raise ValueError(f"method {name} needs the base's local folder (base_path)")
            runners[name] = llama_cpp_runner(name, model, settings, base_path, model_type)
        else:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return runners


def parse_methods(text: str, have_assistant: bool) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()] if text else list(DEFAULT_METHODS)
    if not text and have_assistant:
        names.insert(2, "hf_assisted")
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if "hf_assisted" in names and not have_assistant:
        raise ValueError("method hf_assisted needs --assistant-model PATH")
    if len(set(names)) != len(names):
        raise ValueError(f"a method is listed twice in {text!r}")
    if any(n in LLAMA_CPP_METHODS for n in names):
        from .llamacpp import require

        require()  # before any model is loaded: one line naming the install command when the extra is missing
    return names


def load_assistant(path: str, model, dtype: torch.dtype) -> dict:
    """generate() arguments for hf_assisted: the assistant on the base's device and, when its tokenizer differs
    from the base's, both tokenizers (transformers' universal assisted decoding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = model.base_model.get_input_embeddings().weight.device
    assistant = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    extra = {"assistant_model": assistant}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return extra  # no tokenizer next to the weights: assume the base's
    if model.tokenizer is not None and tokenizer.get_vocab() != model.tokenizer.get_vocab():
        extra.update(tokenizer=model.tokenizer, assistant_tokenizer=tokenizer)
    return extra
