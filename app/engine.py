"""The loaded model as the app uses it: prompts for its chat template, and one generation at a time.

Generations run one at a time, so two decoders never compete for the device and each one's tokens/s is its
own. The Gradio queue already runs generation events one at a time (one concurrency group, limit 1); the lock
here also covers the moment after a Stop, when a cancelled run may still be finishing its current round in a
worker thread.

`launch.py` hands its main thread to `serve_model_calls`: from then on every round runs on the main thread,
which also loaded and warmed up the model, whichever Gradio worker thread asks for it. Once a second thread has
run OpenMP work, libgomp's thread teams outnumber the cores and stop spin-waiting, and every parallel product
pays a wake-up (SmolLM2 on 2 cores: vanilla decoding 25-36 tokens/s on one thread, 13-16 after a second one).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Iterator, Sequence

from eagle.chat.templates import FittedPrompt, Turn, build_prompt, encode, fit_turns, resolve_kind
from eagle.model.generate import Round

LOCK_TIMEOUT_S = 300.0
BASELINE_TOKENS = 32
BASELINE_PROMPT = "Explain in a few sentences how a bicycle works."


class EngineBusy(RuntimeError):
    pass


class Engine:
    def __init__(self, model, template: str = "chat-template", max_length: int | None = None, name: str = "",
                 default_system: str = "", info: dict | None = None):  # fmt: skip
        self.model = model
        self.tokenizer = model.tokenizer
        self.template = resolve_kind(template, self.tokenizer)
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2048
        self.max_length = min(max_length or 2048, context)
        self.name = name
        self.default_system = default_system
        self.info = info or {}
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue | None = None  # set while serve_model_calls runs
        self._server_thread: threading.Thread | None = None
        self.compiling: threading.Thread | None = None  # `compile_in_background`'s thread, once started
        self._install = None  # what puts the compiled rounds in use, once compiled (`finish_compiling`)
        self._compile_log, self._describe = print, None
        # (tokens/s, where it came from): vanilla decoding timed at start-up, the speedup's reference until a
        # session measures its own (side-by-side tab, "time vanilla too", a reply with EAGLE off)
        self.baseline: tuple[float, str] | None = None

    # prompts ---------------------------------------------------------------------------------------------
    def prompt_ids(self, turns: Sequence[Turn], system: str = "") -> list[int]:
        return encode(self.template, self.tokenizer, build_prompt(self.template, turns, system, self.tokenizer))

    def fit(self, turns: Sequence[Turn], system: str, max_new_tokens: int) -> FittedPrompt:
        """The prompt for `turns`, dropping the oldest turns so that the reply has room in the context.

        Room kept for the reply: max_new_tokens, but at most half the context (a longer reply stops at
        the context's end)."""
        reserve = max(1, min(max_new_tokens, self.max_length // 2))
        return fit_turns(turns, self.max_length - reserve, lambda t: self.prompt_ids(t, system))

    # generation ------------------------------------------------------------------------------------------
    def rounds(self, ids: list[int], eagle: bool = True, temperature: float = 0.0, top_p: float = 0.0,
               top_k: int = 0, max_new_tokens: int = 512) -> Iterator[Round]:  # fmt: skip
        """The model's rounds for one generation, holding the model for the whole run."""
        if not self._lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise EngineBusy("the model is busy with another generation; try again")
        try:
            stream = self.model.stream(
                ids, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                max_length=self.max_length, eagle=eagle,
            )  # fmt: skip
            try:
                while (r := self._on_model_thread(next, stream, None)) is not None:
                    yield r
            finally:
                stream.close()
        finally:
            self._lock.release()

    def _on_model_thread(self, fn, *args):
        calls = self._calls
        if calls is None or threading.current_thread() is self._server_thread:
            return fn(*args)
        done: Future = Future()
        calls.put((done, fn, args))
        return done.result()

    def serve_model_calls(self, poll_s: float = 0.5) -> None:
        """Run the model's work on this thread until KeyboardInterrupt or `stop_serving` (module docstring)."""
        self._calls, self._server_thread = queue.SimpleQueue(), threading.current_thread()
        try:
            while True:
                try:
                    call = self._calls.get(timeout=poll_s)  # a timeout keeps Ctrl-C responsive
                except queue.Empty:
                    self.finish_compiling(wait=False)  # compiled rounds come in between replies
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

    def stop_serving(self) -> None:
        if self._calls is not None:
            self._calls.put(None)

    def compile_in_background(self, mode: str, log=print, describe=None) -> threading.Thread:
        """Compile the rounds (eagle/model/tuner.py `compile_rounds`) on a thread of its own while replies are served
        eagerly; `finish_compiling` puts them in use once that thread has ended. `describe(model)` (a dict) is merged
        into `info` then. Compiling runs no model call of the app's, so the page stays responsive (it shares the
        cores)."""
        from eagle.model.tuner import compile_rounds

        def run() -> None:
            try:  # swap: installing waits for the thread's end (its OpenMP threads slowed the 1-row step 19 -> 40 ms)
                compile_rounds(self.model, mode, log, swap=lambda install: setattr(self, "_install", install))
            except Exception as e:  # noqa: BLE001 - the app keeps serving eagerly, saying why
                log(f"compiling stopped ({type(e).__name__}: {e}); still decoding eagerly")

        self._install, self._compile_log, self._describe = None, log, describe
        self.compiling = threading.Thread(target=run, name="compile-rounds", daemon=True)
        self.compiling.start()
        return self.compiling

    def finish_compiling(self, wait: bool = True) -> bool | None:
        """Put compiled rounds in use once their thread has ended, between two replies, on the model thread; then
        re-tune the tree for them (when it was tuned here) and time the vanilla baseline again. `wait`: join the
        thread and the running reply; else return None at once if either is still going (the serving loop polls).
        Returns whether compiled rounds are in use, or None when there is nothing (yet) to put in use."""
        if self.compiling is None or (self.compiling.is_alive() and not wait):
            return None
        self.compiling.join()
        install, log = self._install, self._compile_log
        compiled = None  # nothing compiled (failed, or "auto" measured eager faster before)
        if install is not None:
            if not self._lock.acquire(blocking=wait):
                return None
            try:  # no reply is being written: a cache is sized for the graphs in use when it is made
                self._install = None
                compiled = self._on_model_thread(install)
                if compiled and self.model.acceptance is not None:
                    self._on_model_thread(self.model.tune_tree, log)
            finally:
                self._lock.release()
        if self._describe is not None:  # the Model panel's lines, once: how the rounds run now
            self.info.update(self._describe(self.model))
            self._describe = None
        if compiled:
            tps, _ = self.measure_baseline()
            log(f"compiled rounds in use; vanilla decoding now {tps:.1f} tokens/s")
        return compiled

    def warmup(self) -> None:
        """One short run of each decoder, so that the first timed reply does not pay one-off costs."""
        ids = self.prompt_ids([("Hello", None)])
        for eagle in (True, False):
            for _ in self.rounds(ids, eagle=eagle, max_new_tokens=8):
                pass

    def measure_baseline(self, tokens: int = BASELINE_TOKENS) -> tuple[float, str]:
        """Time vanilla decoding (greedy, `tokens` new tokens of a fixed prompt) and keep it as `baseline`."""
        ids = self.prompt_ids([(BASELINE_PROMPT, None)], self.default_system)
        new, seconds = 0, 0.0
        for r in self.rounds(ids, eagle=False, max_new_tokens=tokens):
            new, seconds = new + len(r.tokens), seconds + r.seconds
        self.baseline = (new / seconds, f"a {new}-token greedy vanilla run at start-up")
        return self.baseline
