"""The chat logic of one browser session, as pure generators (no Gradio here).

`respond(engine, message, turns, settings)` answers `message` after the earlier `turns` and yields an
`Update` (reply text, drafted-character marks, message HTML, figures) after every round of the model.
`compare(engine, message, settings)` decodes one prompt with vanilla decoding and then with EAGLE, one after
the other, and yields both panes as they grow.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

from eagle.chat.templates import PromptTooLong, Turn
from eagle.decoding.generate import Round

from .highlight import Reply, render
from .idle_work import VanillaReference
from .stats import SHARES, RunStats, with_vanilla

MAX_NEW_TOKENS_LIMIT = 4096
RERUN_SOURCE = "this reply decoded again without EAGLE (same prompt, length and forwards), timed on its own"
COMPARE_SOURCE = "the vanilla run of this prompt beside it, timed on its own"
CHECK_TOKENS = 32  # vanilla steps timed after a default EAGLE reply, at its start and at its end: its reference
CHECK_SOURCE = ("this prompt decoded without EAGLE for {n} tokens right after the reply (same forwards): its step "
                "time over this reply's length and prefill")
CHECK_ENDS_SOURCE = ("vanilla decoding timed right after the reply for {n} tokens at the reply's start and {m} at its "
                     "end (same forwards, the conversation's cache): their mean step over this reply's length and "
                     "prefill")


@dataclass(frozen=True)
class Settings:
    temperature: float = 0.0
    top_p: float = 1.0  # 1 (or 0) = off
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 512
    eagle: bool = True
    system_prompt: str = ""
    highlight: bool = True
    time_vanilla: bool = False
    context_drafts: bool = True  # copies of earlier text beside the head's drafts (where the engine serves them)
    notices: tuple[str, ...] = field(default=(), compare=False)  # what `parse` had to change, said to the user

    @classmethod
    def parse(cls, **raw) -> "Settings":
        """Settings from untrusted values (None, strings, NaN, out of range): never raising; a value that cannot
        be used as given is replaced (None = the default, silently) and `notices` says what was used instead."""
        d = cls()
        notices = []

        def num(key, lo, hi, cast=float):
            value = raw.get(key)
            if value is None:
                return getattr(d, key)
            try:
                v = float(value)
            except (TypeError, ValueError):
                v = math.nan
            if math.isnan(v):
                notices.append(f"{key}={value!r} is not a number: used the default {getattr(d, key)}")
                return getattr(d, key)
            used = cast(min(max(v, lo), hi))
            if used != v:
                notices.append(f"{key}={value!r} is outside {lo}..{hi}" + (" or not whole" if lo <= v <= hi else "")
                               + f": used {used}")  # fmt: skip
            return used

        def flag(key):
            v = raw.get(key)
            return getattr(d, key) if v is None else bool(v)

        system = raw.get("system_prompt")
        return cls(
            temperature=num("temperature", 0.0, 2.0),
            top_p=num("top_p", 0.0, 1.0),
            top_k=num("top_k", 0, 1000, int),
            max_new_tokens=num("max_new_tokens", 1, MAX_NEW_TOKENS_LIMIT, int),
            eagle=flag("eagle"),
            system_prompt=clean_text(system) if isinstance(system, str) else d.system_prompt,
            highlight=flag("highlight"),
            time_vanilla=flag("time_vanilla"),
            context_drafts=flag("context_drafts"),
            notices=tuple(notices),
        )  # fmt: skip


def parse_history(history) -> tuple[list[Turn], list[str]]:
    """(user, assistant) pairs from an untrusted `history`; each item that is not a pair of strings with a
    non-empty reply is left out, and a notice says which and why."""
    turns, notices = [], []
    if history is None:
        return turns, notices
    if not isinstance(history, (list, tuple)):
        return turns, [f"history must be a list of [user, assistant] pairs, got {type(history).__name__}: ignored"]
    for i, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            notices.append(f"history[{i}] is not a [user, assistant] pair of strings: left out")
        elif not pair[1].strip():
            notices.append(f"history[{i}] has an empty assistant reply: left out")
        else:
            turns.append((clean_text(pair[0]), clean_text(pair[1])))
    return turns, notices


def clean_text(text) -> str:
    """A message as a valid string: None -> "", lone surrogates replaced, NUL characters removed."""
    if text is None:
        return ""
    text = str(text)
    return text.encode("utf-8", "replace").decode("utf-8").replace("\x00", "")


@dataclass
class Update:
    text: str = ""
    marks: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    done: bool = False
    error: str | None = None  # the message could not be answered (nothing was generated)
    highlight: bool = True  # whether `html` marks the accepted draft tokens
    complete: bool = False  # the reply's text is final (its figures wait for a vanilla run): shown at once

    @property
    def html(self) -> str:
        """The reply as the chat shows it, rendered when asked: the handlers send only some updates (throttled),
        so the rounds they skip cost no rendering next to the model."""
        return render(self.text, self.marks, self.highlight)


def _sampling(s: Settings) -> dict:
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}


def _never() -> bool:
    return False


def _run(engine, ids, stop: Callable[[], bool], **kw) -> Iterator[Round]:
    """The engine's rounds until they end or `stop()` says so (checked after every round); the model is
    released as soon as the loop ends."""
    rounds = engine.rounds(ids, **kw)
    try:
        for r in rounds:
            yield r
            if stop():
                return
    finally:
        rounds.close()


def conversation_key(scope: str, system: str, turns: Sequence[Turn], message: str) -> tuple[str, str]:
    """The key a stateless caller's conversation keeps its caches under (the /chat endpoint's, the API's): its
    system prompt and first message, which every later turn resends unchanged. Two conversations that share them
    share one kept state, which is still exact: a turn reuses only the rows of the ids it has in common with it."""
    first = turns[0][0] if turns else message
    return scope, hashlib.sha256(f"{system}\x00{first}".encode("utf-8", "replace")).hexdigest()[:24]


def respond(engine, message: str, turns: Sequence[Turn], settings: Settings,
            stop: Callable[[], bool] = _never, conversation=None) -> Iterator[Update]:  # fmt: skip
    """Answer `message` after `turns` (earlier (user, reply) pairs). `stop()` is polled after every round: when it
    returns True the reply ends there (figures stop = "stopped"). conversation: the key the conversation's caches
    are kept under between turns (`Engine.decode`), so that a turn prefills only the new message and the reply
    before it; the vanilla reference reads them without changing them.

    The speedup of an EAGLE reply is against vanilla decoding on the same path (eager or compiled forwards). While
    it streams: the engine's vanilla reference for the path, timed while idle, over the reply's length and prefill
    (without one yet, no speedup is given). When it is done: this prompt decoded again without EAGLE, in full when
    `settings.time_vanilla`, else for CHECK_TOKENS tokens (`vanilla_check`), timed right after the reply: a VM's
    speed drifts by a fifth within minutes, and a reference timed seconds apart from the reply drifts with it."""
    message = clean_text(message)
    if not message.strip():
        error = "Empty message: type something first."
        yield Update(error=error, figures={"notice": error, "input_notices": list(settings.notices)}, done=True)
        return
    system = settings.system_prompt
    try:
        fit = engine.fit([*turns, (message, None)], system, settings.max_new_tokens)
    except PromptTooLong as e:
        yield Update(error=str(e), figures={"notice": str(e)}, done=True)
        return
    except Exception as e:  # a template or tokenizer that rejects this input
        error = f"Could not build the prompt: {type(e).__name__}: {e}"
        yield Update(error=error, figures={"notice": error}, done=True)
        return
    notices = list(settings.notices)
    if fit.dropped:
        notices.append(f"The conversation is longer than the model's context ({engine.max_length:,} tokens): "
                  f"the {fit.dropped} oldest turn{'s' if fit.dropped > 1 else ''} "
                  f"{'were' if fit.dropped > 1 else 'was'} left out of the prompt.")  # fmt: skip
    notice = " ".join(n if n.endswith(".") else n + "." for n in notices) or None
    reply, stats, reply_ids = Reply(engine.tokenizer), RunStats(eagle=settings.eagle), []
    path = None  # the path this reply runs on, read after its first round (it cannot change during a run)

    def update(done=False, measured=None, complete=False) -> Update:
        figs = with_vanilla(stats.as_dict(), *(measured or reference_figures(engine, path, stats)))
        figs.update(prompt_tokens=len(fit.ids), dropped_turns=fit.dropped, notice=notice,
                    context_tokens=len(fit.ids) + stats.new_tokens, context_limit=engine.max_length,
                    input_notices=list(settings.notices), forwards=path)  # fmt: skip
        return Update(reply.text, [list(m) for m in reply.marks], figs, done,
                      highlight=settings.highlight and settings.eagle, complete=complete)  # fmt: skip

    measured = None
    try:
        with engine.wanted():  # no idle work between the reply and its vanilla check
            if stop():  # stopped before it began (while waiting in the queue)
                stats.stop = "stopped"
            for r in _run(engine, fit.ids, stop, eagle=settings.eagle, max_new_tokens=settings.max_new_tokens,
                          context_drafts=settings.context_drafts, conversation=conversation,
                          **_sampling(settings)) if not stats.stop else ():  # fmt: skip
                path = path or engine.path
                reply.add_round(r.tokens, r.accepted, r.context)
                reply_ids += r.tokens
                stats.add(r)
                yield update()
            if not stats.stop:
                stats.stop = "stopped"
            elif settings.eagle and stats.new_tokens:
                engine.record_reply(path, stats.new_tokens, stats.rounds, stats.seconds)
            timed = settings.time_vanilla or stats.new_tokens > 2  # a check needs two steps after the prefill
            if settings.eagle and stats.new_tokens and stats.stop != "stopped" and timed:
                yield update(complete=True)  # the reply is complete; its figures wait for the vanilla run
                if settings.time_vanilla:
                    measured = vanilla_rerun(engine, fit.ids, stop, path, stats, settings, conversation)
                else:
                    measured = vanilla_check(engine, fit.ids, stop, path, stats, settings, conversation, reply_ids)
    except Exception as e:  # never lose the session over one failed generation
        final = update(done=True)
        final.error = f"Generation failed: {type(e).__name__}: {e}"
        final.figures["notice"] = final.error
        final.figures["stop"] = "error"
        yield final
        return
    yield update(done=True, measured=measured)


def _vanilla_rounds(engine, ids, stop: Callable[[], bool], max_new_tokens: int, settings: Settings,
                    conversation=None) -> tuple[list[Round], str | None]:  # fmt: skip
    """The prompt `ids` decoded without EAGLE (until `stop()`): its rounds and the path they ran on. conversation:
    whose kept caches it starts from, the reply's rows too (it is timed, not read), leaving them as they were."""
    rounds, path = [], None
    for r in _run(engine, ids, stop, eagle=False, max_new_tokens=max_new_tokens, conversation=conversation,
                  keep=False, exact=False, **_sampling(settings)):  # fmt: skip
        path = path or engine.path
        rounds.append(r)
    return rounds, path


def vanilla_rerun(engine, ids, stop: Callable[[], bool], path: str, stats: RunStats, settings: Settings,
                  conversation=None) -> tuple[float, str] | None:  # fmt: skip
    """(vanilla tokens/s, source) for the EAGLE reply `stats` on `path`: the prompt `ids` decoded again without
    EAGLE for the reply's length (from the conversation's kept caches, as the reply was); None when it was stopped
    or ran on other forwards."""
    rounds, rerun_path = _vanilla_rounds(engine, ids, stop, stats.new_tokens, settings, conversation)
    base = RunStats(eagle=False)
    for r in rounds:
        base.add(r)
    return (base.tokens_per_s, RERUN_SOURCE) if base.stop and rerun_path == path else None


def vanilla_check(engine, ids, stop: Callable[[], bool], path: str, stats: RunStats, settings: Settings,
                  conversation=None, reply_ids: Sequence[int] = ()) -> tuple[float, str] | None:  # fmt: skip
    """(vanilla tokens/s, source) for the EAGLE reply `stats` on `path`: vanilla decoding for up to CHECK_TOKENS
    tokens after the prompt `ids` and, where the reply is longer than two such windows and its conversation's caches
    are kept (so that its prefill reads them), again after `ids + reply_ids` but its last CHECK_TOKENS: a step costs
    more as the context grows, so the mean of the two windows' median steps is the step over the reply's own
    context lengths, applied to its length and prefill (`VanillaReference`). None when a window ran on other
    forwards or made fewer than three steps (then the idle reference stands). A stop asked for meanwhile ends it
    early: the steps made are still timed on their own."""
    k = min(stats.new_tokens, CHECK_TOKENS)
    windows = [list(ids)]
    if conversation is not None and len(reply_ids) > 2 * k:
        windows.append([*ids, *reply_ids[: len(reply_ids) - k]])
    steps, made = [], []
    for window in windows:
        rounds, check_path = _vanilla_rounds(engine, window, stop, k, settings, conversation)
        if check_path != path or len(rounds) < 3:
            return None
        steps.append(statistics.median(r.seconds for r in rounds[1:]))  # the first round is the prefill
        made.append(len(rounds))
    source = CHECK_SOURCE.format(n=made[0]) if len(made) == 1 else CHECK_ENDS_SOURCE.format(n=made[0], m=made[1])
    ref = VanillaReference(path, statistics.fmean(steps), source)
    return stats.new_tokens / ref.seconds(stats.first_round_s, stats.new_tokens), ref.source


def reference_figures(engine, path: str | None, stats: RunStats) -> tuple[float | None, str | None]:
    """(vanilla tokens/s, source) for an EAGLE reply on `path` from the engine's reference for that path, projected
    onto the reply's length and prefill; (None, why) while there is none."""
    if not stats.eagle or path is None or not stats.new_tokens:
        return None, None
    ref = engine.reference(path)
    if ref is None:
        return None, f"timing vanilla decoding on {path} forwards… (no speedup until then)"
    seconds = ref.seconds(stats.first_round_s, stats.new_tokens)
    return stats.new_tokens / seconds, f"{ref.source}, over this reply's length and prefill"


@dataclass
class Pane:
    text: str = ""
    marks: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    running: bool = False
    # [[t, chars, tokens]] after each round: t = decoding seconds so far (the figures' elapsed_s), chars =
    # len(text) then (text only grows: text[:chars] is what was shown), tokens = new tokens then
    timeline: list = field(default_factory=list)

    @property
    def html(self) -> str:
        """The pane's reply, highlighted, rendered when asked (the handler sends only some rounds)."""
        return render(self.text, self.marks, True)


@dataclass
class Comparison:
    vanilla: Pane
    eagle: Pane
    summary: dict
    done: bool = False
    error: str | None = None


def compare(engine, message: str, settings: Settings, stop: Callable[[], bool] = _never) -> Iterator[Comparison]:
    """Vanilla first, then EAGLE, on the same prompt and settings; never at the same time. Each pane records
    its run's timeline (`Pane.timeline`), for the race played back afterwards (`app.race`)."""
    message = clean_text(message)
    panes = Comparison(Pane(), Pane(), {})
    if not message.strip():
        panes.error = "Empty message: type something first."
        panes.done = True
        yield panes
        return
    one = replace(settings, time_vanilla=False, highlight=True)
    vanilla_tps = None
    for pane, eagle in ((panes.vanilla, False), (panes.eagle, True)):
        pane.running, rounds = True, 0
        for u in respond(engine, message, [], replace(one, eagle=eagle), stop=stop):
            if u.error and not u.text:
                panes.error, panes.done = u.error, True
                yield panes
                return
            pane.text, pane.marks, pane.figures = u.text, u.marks, u.figures
            if u.figures.get("rounds", 0) > rounds:  # a round's update (not the final one, which repeats it)
                rounds = u.figures["rounds"]
                pane.timeline.append([u.figures["elapsed_s"], len(u.text), u.figures["new_tokens"]])
            if eagle and vanilla_tps:
                pane.figures = with_vanilla(u.figures, vanilla_tps, COMPARE_SOURCE)
            panes.summary = summary(panes)
            yield panes
        pane.running = False
        if pane.figures.get("stop") == "stopped":
            break
        if not eagle:
            vanilla_tps = pane.figures.get("tokens_per_s")
    panes.done = True
    panes.summary = summary(panes, settings.temperature == 0)
    yield panes


def summary(c: Comparison, greedy: bool = False) -> dict:
    """Speedup (once EAGLE has finished) and, at temperature 0, whether both texts are the same."""
    if "stopped" in (c.vanilla.figures.get("stop"), c.eagle.figures.get("stop")):
        return {"stopped": True}
    v, e = c.vanilla.figures.get("tokens_per_s"), c.eagle.figures.get("tokens_per_s")
    if c.vanilla.figures.get("forwards") != c.eagle.figures.get("forwards") and not c.eagle.running and e:
        v = None  # compiled rounds came in between the two runs: not a fair pair
    out = {"vanilla_tokens_per_s": v, "eagle_tokens_per_s": e,
           "speedup": round(e / v, 2) if v and e and not c.eagle.running else None,
           "mean_accepted_tokens_per_forward": c.eagle.figures.get("mean_accepted_tokens_per_forward"),
           **{k: c.eagle.figures.get(k) for k in SHARES}}  # fmt: skip
    if greedy and c.vanilla.text and c.eagle.text:
        out["same_text"] = c.vanilla.text == c.eagle.text
    return out
