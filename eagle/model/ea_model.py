"""`EaModel`: the public API, call-compatible with the reference project (SafeAILab/EAGLE).

    model = EaModel.from_pretrained(base_model_path, ea_model_path, total_token=60, depth=7, top_k=10)
    ids = model.eagenerate(input_ids, temperature=0.0, max_new_tokens=512)       # prompt + new tokens
    ids, new_tokens, rounds = model.eagenerate(input_ids, log=True)               # tokens / base forward = new / (rounds + 1)
    for ids in model.ea_generate(input_ids): ...                                  # streams after each round
    for r in model.stream(input_ids): r.tokens, r.accepted, r.seconds             # typed rounds, for UIs
    for r in model.stream(ids, conversation="session-1"): ...   # a chat turn: the prefix the conversation's last turn
                                                                 # left in its caches is not prefilled again

`naivegenerate` / `naive_generate` decode one token per base forward on the same code: the vanilla baseline.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import replace
from typing import Iterator

import torch
from torch import nn

from eagle.decoding.context_draft import BUCKETS, ContextDrafter, ContextStats
from eagle.decoding.draft import Drafter, HeadStep
from eagle.decoding.generate import Budget, Round, TreeSpec, eagle_rounds, greedy_tree_rounds, vanilla_rounds
from eagle.decoding.prefix_cache import PrefixStore, Turn
from eagle.decoding.round_steps import TreeShape
from eagle.decoding.verify import SamplingParams, TokenPicker
from eagle.kernels import few_rows, quant_panels
from eagle.models.base import BaseModel
from eagle.models.checkpoint import build_draft_head, read_acceptance_profile, read_checkpoint, read_context_profile
from eagle.models.draft_head import DraftHead
from eagle.runtime import runners
from eagle.runtime.config import RuntimeConfig, check_compile
from eagle.runtime.round_graphs import EagerRound
from eagle.tuning.tuner import TreeChoice, faster_draft_dtype, few_row_plan, panel_tiling, tune

from .compiling import compile_rounds

# End-of-turn tokens of common chat templates; those present in the vocabulary stop generation.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>", "<|eom_id|>")
AUTO_TREE_SIZES = (4, 8, 12, 16, 24, 32, 40, 48, 60)
CONTEXT_CHAIN = 8  # nodes a context draft adds to a round's tree (context_drafts=True) where no profile tunes them


def stop_token_ids(tokenizer=None, *configs) -> set[int]:
    """Token ids that end an assistant turn: the eos ids of the tokenizer and of `configs` (model config,
    generation config; None entries skipped), plus the end-of-turn tokens of common templates in the vocabulary."""
    ids: set[int] = set()
    for source in (*configs, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if tokenizer is not None:  # token by token, not through get_vocab (a dict of the whole vocabulary)
        for token in END_OF_TURN_TOKENS:
            i = tokenizer.convert_tokens_to_ids(token)
            if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == token:  # absent tokens map to unk
                ids.add(i)
    return ids


class EaModel(nn.Module):
    def __init__(
        self, base_model: nn.Module, ea_layer: DraftHead, tokenizer=None, total_token: int = 60, depth: int = 7,
        top_k: int = 10, tree_choices: list[list[int]] | None = None, few_row_plan: dict | bool | None = None,
        runtime: RuntimeConfig | None = None,
    ):  # fmt: skip
        """few_row_plan: the kernel per row count of the base's float32 CPU layers (eagle/kernels/few_rows.py;
        None = its default plan, False = plain nn.Linear). runtime: how passes run (default: eagerly, on the
        base's device); `runners.py` builds every compiled runner from it."""
        super().__init__()
        self.runtime = runtime or RuntimeConfig.of(base_model)
        runners.device_settings(self.runtime)
        self.base_model = base_model
        self.ea_layer = ea_layer
        self.tokenizer = tokenizer
        self.use_eagle3 = ea_layer.eagle3
        layers = ea_layer.config.base_feature_layers(base_model.config.get_text_config().num_hidden_layers)
        self.base = BaseModel(base_model, ea_layer.eagle3, layers, few_row_plan)
        self.hidden_size = self.base.hidden_size
        self.vocab_size = self.base.vocab_size
        self.config = base_model.config
        self.tree = TreeSpec(total_token, depth, top_k, tuple(map(tuple, tree_choices)) if tree_choices else None)
        self._validate_tree(self.tree)
        self.stop_token_ids = self._default_stop_ids()
        self.tree_choice: TreeChoice | None = None  # set when the tree was tuned on this machine (total_token=-1)
        self.compiled_draft = None  # the CompiledDraft in use (`compile_draft` builds one)
        # CompiledRound per tree shape (round_graphs.py), used while the base's graphs are in use (`compile_round`)
        self.compiled_rounds: dict[TreeShape, object] = {}
        # (head, CompiledDraft) per dtype compiled (compiling.compile_rounds), which `tune_tree` picks among; None: the
        # head in use only
        self.draft_options: list[tuple] | None = None
        self.acceptance: list[list[float]] | None = None  # the head's acceptance profile, when the tree is tuned
        # M per match bucket (context_draft.BUCKETS); tuned with the tree where a context profile is known
        self.context_chains: tuple[int, ...] = (CONTEXT_CHAIN,) * len(BUCKETS)
        self.context_profile: dict | None = None  # how far copies are accepted (context_draft.pick_chains)
        self.context_stats = ContextStats()  # what context drafts earned here, across generations (context_draft.py)
        # conversations' caches kept between turns (stream(..., conversation=key)); its `budget` in bytes a setting
        self.prefix_store = PrefixStore()

    # ---------------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, base_model_path: str | None = None, ea_model_path: str | None = None, total_token: int = 60,
        depth: int = 7, top_k: int = 10, use_eagle3: bool | None = None, threshold: float = 1.0,
        tree_choices: list[list[int]] | None = None, draft_dtype: torch.dtype | str | None = None,
        few_row_kernels: bool | str | dict = True, compile: str = "off", log=None, **kwargs,
    ) -> "EaModel":  # fmt: skip
        """Load the base through transformers (`kwargs` go to its `from_pretrained`: torch_dtype/dtype,
        device_map, low_cpu_mem_usage, gguf_file, ...) and the draft head from `ea_model_path` (folder or hub id).

        `use_eagle3` forces the draft format (None = detect from the keys). `threshold` is accepted for
        compatibility and unused, as in the reference. `tree_choices` selects an EAGLE-1 static tree.
        `draft_dtype` runs the head in another dtype than the base (None = the base's; "auto" = bfloat16 where a
        float32 CPU head drafts faster in it, timed here): the head only proposes tokens and the base verifies
        them, so a bfloat16 head under a float32 base stays lossless. `few_row_kernels` (float32 CPU layers,
        eagle/kernels/few_rows.py): True = the default plan, False = none, "auto" = the fastest kernel per row count
        as timed on this machine (cached; for linears that read GGUF blocks, the quantized kernel's fastest tiling),
        or a plan {rows: kernel}. `compile` (CPU, eagle/runtime/compiled.py):
        "on" = the vanilla step and verify passes as compiled graphs (minutes the first time on a small CPU;
        eager if compiling fails, said through `log`), "off", or "auto" = on where a start with "on" measured
        them faster on this machine; on CUDA "on" captures CUDA graphs of the eager kernels (seconds), "inductor"
        of inductor's fused ones (minutes the first time; faster steps, docs/benchmarks.md). `log` (a print-like
        function) hears about measurements and compiling."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        check_compile(compile)  # before minutes of loading
        if base_model_path is None or ea_model_path is None:
            raise ValueError("from_pretrained needs base_model_path and ea_model_path")
        if "torch_dtype" in kwargs:  # the reference's spelling; transformers 5 calls it dtype
            kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
        kwargs.setdefault("dtype", "auto")
        if kwargs.get("attn_implementation", "").startswith("flash"):
            raise ValueError("tree verification needs arbitrary 4D masks: use attn_implementation='sdpa' or 'eager'")
        tok_kwargs = {"gguf_file": kwargs["gguf_file"]} if "gguf_file" in kwargs else {}
        tokenizer = AutoTokenizer.from_pretrained(base_model_path, **tok_kwargs)
        base = AutoModelForCausalLM.from_pretrained(base_model_path, **kwargs).eval()
        config, state = read_checkpoint(ea_model_path)
        head = load_head(base, config, state, use_eagle3, None if draft_dtype == "auto" else draft_dtype)
        # The plan known before the layers are installed, so that no weight is packed for a plan without "packed"
        # ("auto" starts unpacked: the tuner packs only to time the packed kernel, once per machine).
        plan = few_row_kernels if isinstance(few_row_kernels, dict) else {
            True: None, False: False, "auto": few_rows.uniform_plan("linear")}[few_row_kernels]  # fmt: skip
        runtime = RuntimeConfig.of(base, compile)
        model = cls(base, head, tokenizer, max(total_token, 2), depth, top_k, tree_choices, plan, runtime)
        if few_rows.plan_of(base) is not None:  # float32 CPU layers: the kernel per row count
            if few_row_kernels == "auto":
                few_rows.set_plan(base, few_row_plan(model))
            if set(few_rows.plan_of(base).values()) == {"linear"} and not few_rows.reads_gguf_blocks(base):
                few_rows.uninstall(base)
        if few_row_kernels == "auto" and few_rows.reads_gguf_blocks(base):  # the tiling timed fastest here
            quant_panels.set_tiling(panel_tiling(model, log))
        if draft_dtype == "auto" and head.fc.weight.dtype == torch.float32 and head.fc.weight.device.type == "cpu":
            model.ea_layer.to(faster_draft_dtype(model))  # bf16 where it drafts faster on this CPU
        if compile != "off":
            compile_rounds(model, log or (lambda line: None))
        if total_token == -1:
            profile = read_acceptance_profile(ea_model_path)
            if profile is not None and not tree_choices:  # the tree that measures fastest here (tuner.py)
                model.acceptance = profile["accept"]["0"]
                model.context_profile = read_context_profile(ea_model_path)
                model.tune_tree()
            else:
                model.tree = TreeSpec(model.pick_total_token(), depth, top_k, model.tree.choices)
        if compile != "off" and model.base.compiled is not None:
            model.try_compile_round(log or (lambda line: None))
        return model.eval()

    def tune_tree(self, log=None) -> None:
        """Pick the tree that measures fastest here with the forwards in use now (tuner.py); needs the head's
        acceptance profile (`self.acceptance`, read at load with total_token=-1). With a context profile
        (`self.context_profile`) the context chains' sizes are picked on the same costs."""
        self.tree_choice = c = tune(self, self.acceptance, log, self.context_profile)
        if self.draft_options:  # the head (and its compiled draft steps) the tree was priced with
            self.ea_layer, self.compiled_draft = self.draft_options[c.option]
        self.tree = TreeSpec(c.total_token, c.depth, c.top_k, None)
        if c.chains:
            self.context_chains = c.chains

    @property
    def context_chain(self) -> int:
        """The longest context chain a round may add (sizes caches and trees)."""
        return max(self.context_chains)

    @context_chain.setter
    def context_chain(self, nodes: int) -> None:  # the same size for every match bucket
        self.context_chains = (nodes,) * len(BUCKETS)

    def shape_of(self, tree: TreeSpec) -> TreeShape:
        """The static shape of `tree`'s rounds: with the context chains' sizes where `tree.chain` is set."""
        shape = TreeShape.of(tree.total_token, tree.depth, tree.top_k)
        return shape.with_chains(self.context_chains) if tree.chain else shape

    def compile_base(self, buckets=None):
        """The base's vanilla step and verify passes as compiled graphs (runners.decode_graphs), compiled lazily or
        now with their `warm()`; `forward` runs them once set as `self.base.compiled`. buckets: default the
        runtime's."""
        return runners.decode_graphs(self.base, self.runtime.with_buckets(base=buckets or ()))

    def compile_draft(self, buckets=None, head=None):
        """The draft head's steps as compiled graphs (runners.draft_graphs), compiled lazily or now with their
        `warm()`; drafting runs them once they are set as `self.compiled_draft` (with `head` as `self.ea_layer`).
        The head's dtype and weights are frozen into the graphs: cast it first. head: default `self.ea_layer`;
        buckets: default the runtime's."""
        step = HeadStep(head or self.ea_layer, self.base.lm_head)
        return runners.draft_graphs(step, self.runtime.with_buckets(draft=buckets or ()))

    def round_runner(self, tree: TreeSpec, picker: TokenPicker):
        """The runner of greedy dynamic-tree rounds in two steps (round_graphs.py): eager while the base runs
        eagerly, the compiled one for this tree's shape while the base's graphs are in use (`compile_round`). None
        where `eagle_rounds` runs the round instead: sampling, static trees, and a tree shape whose steps are not
        compiled (the forwards' graphs serve it)."""
        if not picker.params.greedy or tree.choices:
            return None
        shape = self.shape_of(tree)
        if self.base.compiled is None:
            return EagerRound(self.base, HeadStep(self.ea_layer, self.base.lm_head), shape)
        compiled = self.compiled_rounds.get(shape)
        return compiled if compiled is not None and compiled.step.head is self.ea_layer else None

    def compile_round(self, tree: TreeSpec | None = None, log=None, context_drafts: bool = False):
        """The greedy round's draft and verify steps as one compiled graph each for `tree`'s shape (default: the
        tree in use), compiled now; used while the base's graphs are (`self.base.compiled`). Where the head was
        compiled in two dtypes (`draft_options`), the round is compiled with each and the head whose draft step
        times faster here is put in use. context_drafts: the shape of rounds with context drafts (a third graph:
        verify with a chain), with the head in use. On CUDA, CUDA graphs of the same steps (cuda_round.py; a context
        chain's pass runs eagerly there). Returns the runner."""
        tree = replace(tree or self.tree, chain=self.context_chain if context_drafts else 0)
        shape = self.shape_of(tree)
        # heads of two dtypes are timed against each other in CPU graphs (CompiledRound.draft_seconds); in CUDA
        # graphs the head in use is kept
        several = self.draft_options and len(self.draft_options) > 1 and not context_drafts
        several = several and not runners.graphed_on_cuda(self.base)
        options = self.draft_options if several else None  # a context round keeps the head its plain round chose
        heads = [head for head, _ in options] if options else [self.ea_layer]
        rounds = [runners.round_graphs(self.base, HeadStep(head, self.base.lm_head), shape) for head in heads]
        for runner in rounds:
            runner.warm(log)
        if options:  # the head whose round draft step is the faster here, in use from now on
            runner = rounds[self._faster_round_draft(rounds, log)]
            self.ea_layer, self.compiled_draft = next(o for o in options if o[0] is runner.step.head)
            if self.tree_choice is not None:
                self.tree_choice = replace(self.tree_choice, draft_dtype=self.ea_layer.dtype_name)
        self.compiled_rounds[shape] = runner
        return runner

    @staticmethod
    def _faster_round_draft(rounds: list, log=None, sittings: int = 3) -> int:
        """Index of the round whose draft step is the fastest, timed in turn `sittings` times (the best of each)."""
        seconds = [min(ts) for ts in zip(*([r.draft_seconds() for r in rounds] for _ in range(sittings)))]
        fastest = min(range(len(rounds)), key=seconds.__getitem__)
        if log:
            times = ", ".join(f"{1e3 * s:.2f} ms in {r.step.head.dtype_name}" for r, s in zip(rounds, seconds))
            log(f"the round's draft step: {times}; the {rounds[fastest].step.head.dtype_name} head kept")
        return fastest

    def try_compile_round(self, log) -> bool:
        """`compile_round` for the tree in use, or, if compiling fails, one line in `log` and the rounds as before
        (the base's graphs and the draft's steps). Returns whether the round is compiled."""
        if self.tree.choices:
            return False
        try:
            self.compile_round(log=log)
        except Exception as e:  # noqa: BLE001 - any compiler failure means: the rounds as before, said once
            first = str(e).splitlines()[0] if str(e) else ""
            log(f"compiling the round's two steps failed ({type(e).__name__}: {first}); drafting and verifying "
                "with the forwards' graphs")  # fmt: skip
            return False
        return True

    def get_tokenizer(self):
        return self.tokenizer

    def _validate_tree(self, tree: TreeSpec) -> None:
        if tree.choices:
            return
        if tree.depth < 1 or tree.top_k < 1 or tree.total_token < 2:
            raise ValueError(f"need depth >= 1, top_k >= 1, total_token >= 2 (or -1 = auto), got {tree}")
        if tree.top_k > self.ea_layer.config.draft_vocab_size:
            raise ValueError(f"top_k={tree.top_k} exceeds the draft vocabulary ({self.ea_layer.config.draft_vocab_size})")

    def _default_stop_ids(self) -> set[int]:
        generation_config = getattr(self.base_model, "generation_config", None)
        return stop_token_ids(self.tokenizer, self.base_model.config, generation_config)

    # ---------------------------------------------------------------------------------------------------------
    def _check_input(self, input_ids) -> torch.Tensor:
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"batch size must be 1 (input_ids of shape [1, n]), got shape {list(input_ids.shape)}")
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids is empty: give at least one prompt token")
        if int(input_ids.max()) >= self.vocab_size or int(input_ids.min()) < 0:
            raise ValueError(f"input_ids holds ids outside the vocabulary [0, {self.vocab_size})")
        return input_ids.cpu()

    def stream(self, input_ids, **kw) -> Iterator[Round]:
        """Typed rounds: `Round.tokens`, `.accepted` (drafted and accepted), `.context` (of those, context copies),
        `.seconds`, `.stop`; the first round's `.cached` and `.prefill_s` (prompt tokens read from a conversation's
        kept cache, and the time to the first token). Keywords as `_rounds`: temperature, top_p, top_k,
        max_new_tokens, max_length, eagle, stop_token_ids, tree, context_drafts, conversation, keep, exact."""
        return self._rounds(self._check_input(input_ids), **kw)

    @torch.inference_mode()
    def _rounds(
        self, input_ids, temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0, max_new_tokens: int = 512,
        max_length: int = 2048, eagle: bool = True, stop_token_ids=None, tree: TreeSpec | None = None,
        context_drafts: bool = False, conversation: Hashable | None = None, keep: bool = True, exact: bool = True,
    ) -> Iterator[Round]:  # fmt: skip
        """`stream` on input_ids already checked by `_check_input` ([1, n], on CPU). context_drafts: copies of
        earlier text offered beside the head's drafts where they measure worth it (context_draft.py).
        conversation: a key of `self.prefix_store` (any hashable the caller chooses: a browser session, an API
        conversation): the generation starts from the caches that conversation's last generation left, where its
        sequence (prompt + reply ids) shares a prefix with this prompt, prefilling only the rest, and leaves its own
        there when its rounds end or the stream is closed (prefix_cache.py). None: nothing kept.
        keep=False: the conversation's kept caches are read (a copy) and left as they were; nothing is kept after.
        exact (default): only the rows a prefill wrote are read (the earlier prompts'), so that the output is the
        cold start's token for token; False reads the rows decoding steps wrote too (a reply's), which some paths
        compute with other kernels than a prefill (compiled graphs, float32's one-row products): for timing."""
        t_start = time.perf_counter()
        params = SamplingParams(float(temperature), float(top_p or 0.0), int(top_k or 0))
        picker = TokenPicker(params, batched=self.runtime.batched_draws)
        stops = self.stop_token_ids if stop_token_ids is None else set(stop_token_ids)
        n = input_ids.shape[1]
        budget = Budget(n, max_new_tokens, max_length, stops)
        tree = replace(tree or self.tree, chain=self.context_chain if context_drafts and eagle else 0)
        self._validate_tree(tree)
        store = self.prefix_store
        kept = None if conversation is None else store.take(conversation) if keep else store.borrow(conversation)
        if not keep:
            conversation = None  # the rounds' state is not kept
        turn = Turn(input_ids[0].tolist(), kept, self.ea_layer if eagle else None, exact)
        L = turn.start  # rows both caches hold from the conversation: prefilled from there
        # Caches belong to this call (allocated once, sized for it, a conversation's kept ones, or the CUDA graphs'
        # own, leased until the stream ends or is dropped), so concurrent or abandoned streams never share state.
        # Room after the budget: one tree, or the accepted path that compaction writes. A kept cache too small for
        # this turn grows towards twice its size, never past what a turn under this max_length needs (the bound).
        room = max(tree.max_nodes, tree.max_depth + tree.chain + 1) + 1
        with self.base.leased_cache(n + budget.limit + room, turn.kept_base, L, max_length + room) as cache:
            turn.base_cache = cache
            if not eagle:
                rounds = vanilla_rounds(self.base, input_ids, picker, budget, cache, L)
                yield from self._kept_rounds(turn, conversation, t_start, rounds)
                return
            context = None
            if tree.chain:
                proposal = tree.max_depth + tree.chain
                context = ContextDrafter(self.context_chains, proposal, self.context_stats, self.base.input_device)
            runner = self.round_runner(tree, picker)
            if runner is not None:
                head_room = runner.shape.commit_rows + runner.shape.draft_entries + 1
                leased = runner.leased_draft_cache(n + budget.limit + head_room, turn.kept_head, L,
                                                   max_length + head_room)  # fmt: skip
                with leased as draft_cache:
                    turn.head_cache = draft_cache
                    rounds = greedy_tree_rounds(self.base, runner, input_ids, budget, cache, draft_cache, context, L)
                    yield from self._kept_rounds(turn, conversation, t_start, rounds)
                return
            head_room = tree.max_draft_entries + 1
            with Drafter(self.ea_layer, self.base.lm_head, n + budget.limit + head_room, self.compiled_draft,
                         turn.kept_head, L, max_length + head_room) as drafter:  # fmt: skip
                turn.head_cache = drafter.cache
                rounds = eagle_rounds(self.base, drafter, input_ids, picker, budget, tree, cache, context, L)
                yield from self._kept_rounds(turn, conversation, t_start, rounds)

    def _kept_rounds(self, turn: Turn, conversation, t_start: float, rounds: Iterator[Round]) -> Iterator[Round]:
        """`rounds`, the first with its figures (`cached`, `prefill_s`); when they end or the stream is closed at a
        round, the caches' state kept under `conversation` (before the leases end: lent rows are copied out). A
        round that raises keeps nothing: its caches may be half-written."""
        first, ended = True, False
        try:
            for r in rounds:
                turn.produced += r.tokens
                if first:
                    r, first = replace(r, cached=turn.start, prefill_s=time.perf_counter() - t_start), False
                yield r
            ended = True
        except GeneratorExit:  # closed at a yield: the caches hold the rounds so far
            ended = True
            raise
        finally:
            if ended and conversation is not None:
                self.prefix_store.put(conversation, turn.kept_after())

    def _generate(self, input_ids, eagle: bool, log: bool, **kw):
        input_ids = self._check_input(input_ids)
        new, rounds = [], 0
        for r in self._rounds(input_ids, eagle=eagle, **kw):
            new += r.tokens
            rounds += 1
        ids = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype)], dim=1)
        # rounds - 1 verification passes follow the prefill: new_tokens / (that + 1) = tokens per base forward
        return (ids, len(new), rounds - 1) if log else ids

    def _stream_ids(self, input_ids, eagle: bool, **kw):
        input_ids = self._check_input(input_ids)
        ids = input_ids
        for r in self._rounds(input_ids, eagle=eagle, **kw):
            ids = torch.cat([ids, torch.tensor([r.tokens], dtype=ids.dtype)], dim=1)
            yield ids

    def eagenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0, max_new_tokens=512, max_length=2048,
                   log=False, is_llama3=False, **kw):  # fmt: skip
        """EAGLE decoding. Returns ids [1, prompt + new], or (ids, new_tokens, rounds) with log=True.
        `is_llama3` is accepted for compatibility: <|eot_id|> always stops when the vocabulary has it."""
        return self._generate(input_ids, True, log, temperature=temperature, top_p=top_p, top_k=top_k,
                              max_new_tokens=max_new_tokens, max_length=max_length, **kw)  # fmt: skip

    def naivegenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0, max_new_tokens=512, max_length=2048,
                      log=False, is_llama3=False, **kw):  # fmt: skip
        """Vanilla decoding (one token per base forward) on the same model code: the baseline."""
        return self._generate(input_ids, False, log, temperature=temperature, top_p=top_p, top_k=top_k,
                              max_new_tokens=max_new_tokens, max_length=max_length, **kw)  # fmt: skip

    def ea_generate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0, max_new_tokens=512, max_length=2048,
                    log=False, is_llama3=False, **kw):  # fmt: skip
        """Streaming EAGLE: yields ids [1, prompt + new so far] after every round."""
        yield from self._stream_ids(input_ids, True, temperature=temperature, top_p=top_p, top_k=top_k,
                                    max_new_tokens=max_new_tokens, max_length=max_length, **kw)  # fmt: skip

    def naive_generate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0, max_new_tokens=512, max_length=2048,
                       log=False, is_llama3=False, **kw):  # fmt: skip
        """Streaming vanilla decoding: yields ids after every token."""
        yield from self._stream_ids(input_ids, False, temperature=temperature, top_p=top_p, top_k=top_k,
                                    max_new_tokens=max_new_tokens, max_length=max_length, **kw)  # fmt: skip

    # ---------------------------------------------------------------------------------------------------------
    def pick_total_token(self, sizes=AUTO_TREE_SIZES, repeats: int = 5) -> int:
        """total_token=-1: time one verification pass per tree size on this device and pick the size with the
        best expected tokens per second, expected accepted length / pass time. The accepted length is modelled
        as 1 + 0.15 * log2(size): it grows slowly with the tree (a modelling assumption, not a measurement of
        this head); the pass time is measured. On a GPU the pass time is flat up to a size, so the largest flat
        size wins; on a CPU it grows with the size, so small trees win."""
        import math

        seconds = self.base.pass_seconds(list(sizes), repeats=repeats)
        return max(sizes, key=lambda n: (1 + 0.15 * math.log2(n)) / seconds[n])


def load_head(
    base: nn.Module, config: dict, state: dict, use_eagle3: bool | None = None, dtype: torch.dtype | str | None = None
) -> DraftHead:
    """Build the head for `base`, on the device of its lm_head, in `dtype` (None = the lm_head's dtype)."""
    text = base.config.get_text_config()
    lm_head = base.get_output_embeddings()
    head = build_draft_head(
        config, state, base.get_input_embeddings(), text.hidden_size, lm_head.weight.shape[0], use_eagle3
    )
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return head.to(device=lm_head.weight.device, dtype=dtype or lm_head.weight.dtype).eval()
