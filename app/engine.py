"""The loaded model as the app uses it: prompts for its chat template, and one generation at a time.

Generations run one at a time, so two decoders never compete for the device and each one's tokens/s is its
own. The Gradio queue already runs generation events one at a time (one concurrency group, limit 1); the lock
here also covers the moment after a Stop, when a cancelled run may still be finishing its current round in a
worker thread, and it is the one queue that the page's replies and the OpenAI API's requests (app/openai_api.py)
share: a FIFO with a bound (app/model_queue.py), so they get the model in arrival order.

`launch.py` hands its main thread to `serve_model_calls`: from then on every round runs on the main thread,
which also loaded and warmed up the model, whichever Gradio worker thread asks for it. Once a second thread has
run OpenMP work, libgomp's thread teams outnumber the cores and stop spin-waiting, and every parallel product
pays a wake-up (docs/benchmarks.md, "The app's first and second start").

Context drafts (copies of earlier text offered beside the head's drafts, eagle/decoding/context_draft.py) are asked
for per reply when its settings want them and they keep the reply on the runner it has without them
(`context_drafts_served`): on eager forwards any tree shape runs, on compiled greedy rounds only once their own
compiled round is in (idle_work.py).

While no reply runs, the same thread does the idle work (`app/idle_work.py`: vanilla references, compiled rounds
loaded and measured), one unit at a time, and child processes compile the rounds (`app/precompile.py`); they are
stopped whenever a reply or a measurement runs, so neither shares the cores with them.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Iterator, Sequence

from eagle.chat.templates import FittedPrompt, Turn, build_prompt, encode, fit_turns, resolve_kind
from eagle.decoding.generate import Round
from eagle.decoding.verify import SamplingParams, TokenPicker

from .idle_work import REFRESH_S, Loading, VanillaReference, Wait, refresh_reference
from .model_queue import MAX_WAITING, EngineBusy, FairLock, Ticket

LOCK_TIMEOUT_S = 300.0
PATHS = ("eager", "compiled")


KV_BUDGET_MB = 2048  # one conversation's KV caches (the base's and the head's) at most: bounds the context used
KEPT_MB = 1024  # the caches conversations keep between turns, all together (least recently used dropped first)


def kv_bytes_per_token(model) -> int:
    """Bytes one token's keys and values take in a generation's caches: every layer of the base, in its dtype, and
    the draft head's one layer in its own."""
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    base = 2 * text.num_hidden_layers * kv_heads * head_dim * model.base.dtype.itemsize
    head_config = model.ea_layer.config
    head = 2 * head_config.num_key_value_heads * head_config.head_dim * model.ea_layer.fc.weight.dtype.itemsize
    return base + head


class Engine:
    def __init__(self, model, template: str = "chat-template", max_length: int | None = None, name: str = "",
                 default_system: str = "", info: dict | None = None, queue_size: int = MAX_WAITING,
                 kv_budget_mb: float = KV_BUDGET_MB, kept_mb: float = KEPT_MB):  # fmt: skip
        self.model = model
        self.tokenizer = model.tokenizer
        self.template = resolve_kind(template, self.tokenizer)
        # the base's context window, as much of it as `kv_budget_mb` of one conversation's KV caches holds, or
        # `max_length` where a smaller one is asked for
        self.window = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2048
        self.kv_bytes_per_token = kv_bytes_per_token(model)
        self.kv_budget_mb = kv_budget_mb
        self.kv_budget_tokens = int(kv_budget_mb * 2**20 // self.kv_bytes_per_token)
        self.max_length = max(1, min(max_length or self.window, self.window, self.kv_budget_tokens))
        model.prefix_store.budget = int(kept_mb * 2**20)  # conversations' caches kept between turns, LRU
        self.name = name
        self.default_system = default_system
        self.info = info or {}
        # held by a generation or an idle unit: one model user at a time, generations (the page's and the API's)
        # in arrival order, at most queue_size waiting (app/model_queue.py)
        self.queue = self._lock = FairLock(queue_size)
        self._calls: queue.SimpleQueue | None = None  # set while serve_model_calls runs
        self._server_thread: threading.Thread | None = None
        self.references: dict[str, VanillaReference] = {}  # path -> vanilla timed while idle (idle_work.py)
        self.jobs: list = []  # idle work: generators of units (idle_work.py), run in order
        self.child = None  # the ChildCompile compiling the rounds, while there is one
        self.activity: tuple[str, float] | None = None  # what the model thread does now and since when (monotonic)
        self.status = ""  # what the idle work is at (compiling, loading, timing...), for the Model panel
        self.replies: dict[str, list[tuple[int, int, float]]] = {p: [] for p in PATHS}  # (tokens, rounds, seconds)
        self.describe = lambda model: {}  # the Model panel's lines that change with the path (cli.describe_forwards)
        self._waiting, self._waiting_lock = 0, threading.Lock()  # generations waiting for the model (they go first)
        self._pending: dict = {}  # job -> the line (or Wait) it announced last
        self._refresh = None  # the job timing a reference again (`record_reply`)
        self.describe_context()

    def context_line(self) -> str:
        """The Model panel's line on the context: how long, why, and the memory a full one's KV caches take."""
        full_mb = self.max_length * self.kv_bytes_per_token / 2**20
        why = ("the base's window" if self.max_length == self.window else
               f"of the base's {self.window:,}: as much as --kv-budget-mb {self.kv_budget_mb:g} holds"
               if self.max_length == self.kv_budget_tokens else
               f"of the base's {self.window:,}: --max-length")  # fmt: skip
        return f"{self.max_length:,} tokens ({why}); a full conversation's KV caches {full_mb:,.0f} MB"

    # prompts ---------------------------------------------------------------------------------------------
    def prompt_ids(self, turns: Sequence[Turn], system: str = "") -> list[int]:
        return encode(self.template, self.tokenizer, build_prompt(self.template, turns, system, self.tokenizer))

    def fit(self, turns: Sequence[Turn], system: str, max_new_tokens: int) -> FittedPrompt:
        """The prompt for `turns`, dropping the oldest turns so that the reply has room in the context.

        Room kept for the reply: max_new_tokens, but at most half the context (a longer reply stops at
        the context's end)."""
        return fit_turns(turns, self.prompt_room(max_new_tokens), lambda t: self.prompt_ids(t, system))

    def prompt_room(self, max_new_tokens: int) -> int:
        """The prompt tokens that fit with room kept for a reply of max_new_tokens (at most half the context)."""
        return self.max_length - max(1, min(max_new_tokens, self.max_length // 2))

    # generation ------------------------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """Which forwards the next generation runs: "compiled" rounds or "eager" ones. It changes only between
        generations (on the model thread, with the lock held), so a generation's path is the one read after
        its first round."""
        return "compiled" if self.model.base.compiled is not None else "eager"

    def reference(self, path: str | None = None) -> VanillaReference | None:
        return self.references.get(path or self.path)

    def set_reference(self, ref: VanillaReference) -> None:
        self.references[ref.path] = ref

    def record_reply(self, path: str, tokens: int, rounds: int, seconds: float) -> None:
        """An EAGLE reply as it was made, for the Model panel's figures of each path (the last 20 kept); the path's
        vanilla reference is timed again after it where it is older than REFRESH_S."""
        self.replies[path] = [*self.replies[path][-19:], (tokens, rounds, seconds)]
        ref = self.references.get(path)
        if ref is not None and time.monotonic() - ref.timed_at > REFRESH_S and self._refresh not in self.jobs:
            self._refresh = refresh_reference(self, path)  # idle work: after this reply, before none
            self.add_job(self._refresh)

    def reply_figures(self, path: str | None = None) -> str:
        done = self.replies[path or self.path]
        if not done:
            return ""
        tokens, rounds, seconds = (sum(x) for x in zip(*done))
        return (f"{tokens / seconds:.1f} tokens/s, {tokens / rounds:.2f} tokens per base forward over the last "
                f"{len(done)} EAGLE repl{'y' if len(done) == 1 else 'ies'}")  # fmt: skip

    # the model thread ----------------------------------------------------------------------------------------
    def _on_model_thread(self, fn, *args):
        calls = self._calls
        if calls is None or threading.current_thread() is self._server_thread:
            return fn(*args)
        done: Future = Future()
        calls.put((done, fn, args))
        return done.result()

    def serve_model_calls(self, poll_s: float = 0.5) -> None:
        """Run the model's work on this thread until KeyboardInterrupt or `stop_serving` (module docstring): the
        calls of generations, and idle work between them."""
        self._calls, self._server_thread = queue.SimpleQueue(), threading.current_thread()
        try:
            while True:
                try:  # idle work runs unit after unit while there is some, checking for calls in between
                    call = self._calls.get(timeout=0.005 if self.jobs else poll_s)
                except queue.Empty:
                    if self.idle_step():
                        continue
                    try:  # nothing runnable: wait for a call while the child compiles
                        call = self._calls.get(timeout=poll_s)
                    except queue.Empty:
                        continue
                if call is None:
                    return
                done, fn, args = call
                try:
                    done.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    done.set_exception(e)
        finally:
            self._calls = None
            if self.child is not None:
                self.child.stop()

    def stop_serving(self) -> None:
        if self._calls is not None:
            self._calls.put(None)

    # using the model -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _model(self, what: str, timeout: float | None = LOCK_TIMEOUT_S, pause_child: bool = True,
               ticket: Ticket | None = None):  # fmt: skip
        """Hold the model for `what`: one user at a time, and (unless not `pause_child`: work that times nothing)
        the compiling children stopped meanwhile. A generation waits its turn in the queue from `ticket` (a place
        taken when its request came, `queue.join()`), else from now; QueueFull (an EngineBusy) when the queue is
        full, model_queue.Withdrawn when the place was given up meanwhile."""
        if timeout == 0:  # idle work: only when no generation waits for the model either
            if self._waiting or not self._lock.acquire(blocking=False):
                raise EngineBusy("the model is in use")
        else:
            with self.wanted():
                acquired = self._lock.wait(ticket or self._lock.join(), timeout)
            if not acquired:
                raise EngineBusy("the model is busy with another generation; try again")
        try:
            if self.child is not None and pause_child:
                self.child.pause()
            self.activity = (what, time.monotonic())
            yield
        finally:
            self.activity = None
            if self.child is not None:
                self.child.resume()
            self._lock.release()

    def busy_line(self) -> str | None:
        """What a message waits for when the model is doing idle work, or None."""
        activity = self.activity
        if activity is None or activity[0] == "reply":
            return None
        return f"waiting for the model: {activity[0]} ({time.monotonic() - activity[1]:.0f} s)"

    def waiting_lines(self, poll_s: float = 0.5) -> Iterator[str]:
        """While a unit of idle work holds the model: what it is, every `poll_s`; no further unit starts meanwhile."""
        with self.wanted():
            while (line := self.busy_line()) is not None:
                yield line
                time.sleep(poll_s)

    @contextlib.contextmanager
    def wanted(self):
        """A generation wants the model: idle work starts no unit meanwhile (a reply holds this across its runs,
        so that its vanilla check follows it with nothing between)."""
        with self._waiting_lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._waiting_lock:
                self._waiting -= 1

    def rounds(self, ids: list[int], eagle: bool = True, temperature: float = 0.0, top_p: float = 0.0,
               top_k: int = 0, max_new_tokens: int = 512, context_drafts: bool = False, ticket: Ticket | None = None,
               seed: int | None = None, cancel: threading.Event | None = None, conversation=None,
               keep: bool = True, exact: bool = True) -> Iterator[Round]:  # fmt: skip
        """The model's rounds for one generation, holding the model for the whole run (its turn in the queue from
        `ticket`, see `_model`). seed: torch's random numbers seeded with it right before the first round. cancel:
        once set, the rounds end after the one in progress (checked where they run, so no further round starts
        while the reader catches up). conversation, keep, exact: the caches kept between a conversation's turns
        (`decode`)."""
        with self._model("reply", ticket=ticket):
            stream = self.decode(ids, eagle, temperature, top_p, top_k, max_new_tokens, context_drafts, conversation,
                                 keep, exact)  # fmt: skip
            if seed is not None:
                stream = _seeded(stream, seed)
            if self._calls is None or threading.current_thread() is self._server_thread:
                try:
                    for r in stream:
                        yield r
                        if cancel is not None and cancel.is_set():
                            break
                finally:
                    stream.close()
            else:
                yield from self._from_model_thread(stream, cancel)

    def _from_model_thread(self, stream: Iterator[Round], cancel: threading.Event | None = None) -> Iterator[Round]:
        """`stream` run on the model thread round after round, as the idle work's timings run, without waiting for
        the reader between rounds (a thread that waits lets libgomp's team fall asleep, and every round paid the
        wake-up); the rounds reach the reader through a queue. Closing this generator (or setting `cancel`) ends the
        stream after the round in progress; closing it returns once the model thread is done with it."""
        rounds, stop, done = queue.SimpleQueue(), threading.Event(), Future()

        def produce() -> None:
            try:
                for r in stream:
                    rounds.put(r)
                    if stop.is_set() or cancel is not None and cancel.is_set():
                        break
            except BaseException as e:  # noqa: BLE001 - raised in the reader's thread
                rounds.put(e)
            finally:
                stream.close()
                rounds.put(None)

        self._calls.put((done, produce, ()))
        try:
            while (r := rounds.get()) is not None:
                if isinstance(r, BaseException):
                    raise r
                yield r
        finally:
            stop.set()
            done.result()

    def decode(self, ids: list[int], eagle: bool = True, temperature: float = 0.0, top_p: float = 0.0,
               top_k: int = 0, max_new_tokens: int = 512, context_drafts: bool = False, conversation=None,
               keep: bool = True, exact: bool = True) -> Iterator[Round]:  # fmt: skip
        """The model's rounds, without taking the model (for work that holds it already). context_drafts: wanted by
        the reply's settings; asked of the model only where the rounds serve them (`context_drafts_served`).
        conversation: the key its caches are kept under between turns (a browser session, an API conversation:
        `model.prefix_store`, within `kept_mb`), so that a turn prefills only what its last turn did not read;
        keep=False reads them and leaves them as they were (a vanilla reference timed beside a reply); exact=False
        reads a reply's rows too, not only the prompts' (for timing: EaModel.stream)."""
        context = context_drafts and eagle and self.context_drafts_served(temperature, top_p, top_k)
        return self.model.stream(ids, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                 max_length=self.max_length, eagle=eagle, context_drafts=context,
                                 conversation=conversation, keep=keep, exact=exact)  # fmt: skip

    def forget(self, conversation) -> None:
        """Free the caches kept for `conversation` (its history was cleared)."""
        self.model.prefix_store.drop(conversation)

    def context_drafts_served(self, temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0) -> bool:
        """Whether context drafts keep a reply with these sampling settings as fast as it is without them.

        Eager forwards: always (the eager runners serve any tree). Compiled forwards: where the two-step runner for
        the tree with a context chain is in (`context_rounds` brings it in after the two-step rounds); else never
        for a greedy reply on CPU graphs (it would leave its compiled steps for the general loop), and for the
        replies that run the general loop either way (sampling, static trees, CUDA graphs) only where the tree with
        its chain still verifies in one of the forwards' graphs."""
        model, compiled = self.model, self.model.base.compiled
        if compiled is None:
            return True
        picker = TokenPicker(SamplingParams(float(temperature), float(top_p or 0.0), int(top_k or 0)))
        chained = replace(model.tree, chain=model.context_chain)
        if model.round_runner(chained, picker) is not None:
            return True
        from eagle.runtime import runners

        if picker.params.greedy and not model.tree.choices and not runners.graphed_on_cuda(model.base):
            return False
        return chained.max_nodes <= max(compiled.buckets)

    def describe_context(self) -> None:
        """The Model panel's line on context drafts (greedy replies), for the forwards in use now."""
        where = "eager forwards" if self.model.base.compiled is None else "compiled rounds"
        if self.context_drafts_served():
            chains = self.model.context_chains
            sizes = " or ".join(map(str, sorted(set(chains))))
            tuned = self.model.tree_choice is not None and self.model.tree_choice.chains == chains
            line = (f"chains of {sizes} nodes{' (by match length, tuned here)' if tuned else ''} offered beside the "
                    f"head's drafts where they measure worth it ({where})")  # fmt: skip
        else:
            line = "off for greedy replies until their compiled round is in (they go without them meanwhile)"
        self.info["context_drafts"] = line

    # idle work -----------------------------------------------------------------------------------------------
    def add_job(self, job: Iterator, first: bool = False) -> None:
        """Model work to run while idle, a unit per `idle_step` (app/idle_work.py), after the jobs there (or first)."""
        self.jobs.insert(0 if first else len(self.jobs), job)

    def idle_step(self) -> bool:
        """Run one unit of the first job that has one ready, if the model is free. Returns whether a unit ran.

        A job announces each unit with a line (or a `Wait`) before running it; after a `Wait` it does no model work
        until it announces a unit, so asking it again needs no model."""
        for job in list(self.jobs):
            line = self._pending.pop(job, None) or self._next_unit(job)
            if isinstance(line, Wait):
                line = self._next_unit(job)
            if line is None:
                continue  # finished
            if isinstance(line, Wait):
                self.status = line.line
                self._pending[job] = line
                continue
            text = line.line if isinstance(line, Loading) else line
            try:
                with self._model(text, timeout=0, pause_child=not isinstance(line, Loading)):
                    self.status = text
                    after = self._next_unit(job)  # runs the unit
                if after is not None:
                    self._pending[job] = after
            except EngineBusy:
                self._pending[job] = line
                return False
            return True
        return False

    def _next_unit(self, job):
        """What the job announces next, running the unit it announced before; None once it has finished."""
        try:
            return next(job)
        except StopIteration:
            pass
        except Exception as e:  # noqa: BLE001 - idle work never takes the app down; it says why it stopped
            self.status = f"stopped: {type(e).__name__}: {e}"
        self.jobs.remove(job)
        return None

    def run_idle_work(self, timeout: float = 900.0) -> None:
        """Run all idle work now (waiting for the compiling child): for callers without a serving loop."""
        end = time.monotonic() + timeout
        while self.jobs and time.monotonic() < end:
            if not self.idle_step():
                time.sleep(0.2)

    def compiled_in_use(self) -> None:
        """The compiled rounds are now the path (called by the idle work that put them in use)."""
        self.info.update(self.describe(self.model))
        self.describe_context()
        self.status = "compiled rounds in use"
        self.child = None

    def warmup(self) -> None:
        """One short run of each decoder, so that the first timed reply does not pay one-off costs."""
        ids = self.prompt_ids([("Hello", None)])
        for eagle in (True, False):
            for _ in self.rounds(ids, eagle=eagle, max_new_tokens=8):
                pass


def _seeded(stream: Iterator[Round], seed: int) -> Iterator[Round]:
    """`stream`, with torch's generators seeded on the thread that runs it, right before its first round."""
    import torch

    torch.manual_seed(seed)
    yield from stream
