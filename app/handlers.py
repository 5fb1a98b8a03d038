"""What the page's events do, around the pure session logic: per-session state, chat messages, Stop / Clear /
Regenerate, the side-by-side run, and the scripted `/chat` endpoint.

Each browser session keeps its conversation in `gr.State` (plain text plus the character ranges that EAGLE
drafted; the HTML is rendered from it on every update). Only the model is shared.

(No `from __future__ import annotations` here: gr.api reads the /chat endpoint's types from real annotations.)
"""

import html
import time
from dataclasses import replace

import gradio as gr

from .highlight import highlighted_html, render
from .session import COMPARE_SOURCE, Settings, clean_text, compare, parse_history, respond
from .stats import figures_html, with_vanilla

# At most 4 page updates per second while streaming. Each update costs the page ~20 ms of a core (Gradio's update,
# layout, paint) and the server a few ms under the GIL, whatever the reply's length; at 20 per second that took
# 15-25% off the model's own speed on a 2-core CPU with the browser beside it (python -m eagle.evaluation.app_speed;
# BENCHMARKS.md, "App live speed vs the bench").
UPDATE_EVERY_S = 0.25


# state ---------------------------------------------------------------------------------------------------
def new_state() -> dict:
    """One session's conversation and figures.

    turns: [{"user", "reply" (None until generated), "marks" (drafted character ranges), "eagle", "notice",
    "epoch"}]; figures: the last run's; vanilla: [tokens/s, source] of the last vanilla measurement.
    epoch: bumped by Stop / Clear / Regenerate; a run goes on only while the epoch it was queued with is
    current. (Gradio hands every event of a session the same state object, so a running generator sees
    the bump at its next round; it then ends normally, which keeps history and page consistent.)"""
    return {"turns": [], "vanilla": None, "figures": {}, "epoch": 0, "compare_epoch": 0}


def new_turn(message: str, epoch: int) -> dict:
    return {"user": message, "reply": None, "marks": [], "eagle": True, "notice": None, "epoch": epoch}


def _text(s: str) -> dict:
    return {"type": "text", "text": s}  # a text message as is (a bare string would be dedented by Gradio)


def _notice_html(notice: str) -> str:
    return f'<div class="eagle-notice">⚠ {html.escape(notice)}</div>'


def chat_messages(state: dict, highlight: bool = True) -> list[dict]:
    msgs = []
    for t in state["turns"]:
        msgs.append({"role": "user", "content": _text(html.escape(t["user"]))})  # shown as typed, never as HTML
        if t["reply"] is None and not t.get("notice"):
            continue
        body = render(t["reply"] or "", t["marks"], highlight and t.get("eagle", True)) if t["reply"] else ""
        extra = _notice_html(t["notice"]) if t.get("notice") else ""
        if t.get("stopped"):
            extra += '<div class="eagle-muted">⏹ stopped</div>'
        if extra:
            body = f"{body}\n\n{extra}" if body else extra
        msgs.append({"role": "assistant", "content": _text(body)})
    return msgs


def _settings(temperature, top_p, top_k, max_new_tokens, eagle, highlight, time_vanilla, system_prompt) -> Settings:
    return Settings.parse(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                          eagle=eagle, highlight=highlight, time_vanilla=time_vanilla, system_prompt=system_prompt)  # fmt: skip


class Throttle:
    """True at most every `every` seconds (and always for the first and the last update)."""

    def __init__(self, every: float | None = None):
        self.every, self.last = UPDATE_EVERY_S if every is None else every, 0.0

    def __call__(self, final: bool = False) -> bool:
        now = time.monotonic()
        if final or now - self.last >= self.every:
            self.last = now
            return True
        return False


# handlers ------------------------------------------------------------------------------------------------
def make_handlers(engine):
    def add_message(message, state, highlight):
        message = clean_text(message)
        if not message.strip():
            gr.Info("Type a message first.")
            return message, chat_messages(state, highlight), state
        state["turns"].append(new_turn(message, state["epoch"]))
        return "", chat_messages(state, highlight), state

    def bot(state, *raw):
        settings = _settings(*raw)
        turns = state["turns"]
        if not turns or turns[-1]["reply"] is not None or turns[-1].get("notice"):
            yield chat_messages(state, settings.highlight), figures_html(state.get("figures")), state
            return
        turn = turns[-1]
        turn["eagle"] = settings.eagle
        history = [(t["user"], t["reply"]) for t in turns[:-1] if t["reply"]]
        stopped = lambda: state["epoch"] != turn["epoch"]  # noqa: E731
        vanilla = tuple(state["vanilla"]) if state["vanilla"] else engine.baseline
        for notice in settings.notices:
            gr.Warning(notice)
        throttle = Throttle()
        for u in respond(engine, turn["user"], history, settings, vanilla, stop=stopped):
            if u.error and not u.text:
                turn["notice"] = u.error
                gr.Warning(u.error)
            elif u.done and u.figures.get("stop") == "stopped" and not u.text:
                turn["notice"] = "Stopped before the reply began."
            else:
                turn["reply"], turn["marks"] = u.text, u.marks
                turn["stopped"] = u.done and u.figures.get("stop") == "stopped"
                if u.done and (u.error or u.figures.get("notice")):
                    turn["notice"] = u.error or u.figures["notice"]
            if turn in state["turns"]:  # not cleared or regenerated meanwhile
                state["figures"] = u.figures
                if u.vanilla:
                    state["vanilla"] = list(u.vanilla)
            if throttle(u.done):
                yield chat_messages(state, settings.highlight), figures_html(state["figures"], not u.done), state

    def unanswered(state) -> bool:
        """The last message waits for its reply (a reply is being written or queued)."""
        last = state["turns"][-1] if state["turns"] else None
        return last is not None and last["reply"] is None and not last.get("notice")

    def regenerate(state, highlight):
        if not state["turns"]:
            gr.Info("Nothing to regenerate yet.")
        else:
            state["epoch"] += 1  # stops the reply being written, if any
            state["turns"][-1] = new_turn(state["turns"][-1]["user"], state["epoch"])
        return chat_messages(state, highlight), state

    def clear(state):
        state["epoch"] += 1
        state["turns"].clear()  # in place: a run that is ending renders this same (empty) list
        state["figures"] = {}
        return [], figures_html(None), state

    def stop(state):
        state["epoch"] += 1
        return state

    def rerender(state, highlight):
        return chat_messages(state, highlight)

    def start_compare(state):
        state["compare_epoch"] = state["epoch"]
        return state

    def run_compare(message, state, *raw):
        settings = _settings(*raw)
        epoch = state["compare_epoch"]
        throttle = Throttle()
        for c in compare(engine, message, settings, stop=lambda: state["epoch"] != epoch):
            if c.error:
                gr.Warning(c.error)
            stopped = c.vanilla.figures.get("stop") == "stopped" or c.eagle.figures.get("stop") == "stopped"
            if c.done and c.vanilla.figures.get("tokens_per_s") and not stopped:
                state["vanilla"] = [c.vanilla.figures["tokens_per_s"], COMPARE_SOURCE]
            if c.done and not stopped and c.eagle.figures.get("tokens_per_s"):  # the side panel follows this run
                state["figures"] = with_vanilla(c.eagle.figures, *(state["vanilla"] or (None, None)))
            if throttle(c.done):
                yield (c.vanilla.html, figures_html(c.vanilla.figures, c.vanilla.running), c.eagle.html,
                       figures_html(c.eagle.figures, c.eagle.running), summary_html(c.summary, c.done),
                       figures_html(state["figures"]), state)  # fmt: skip

    def api_chat(
        message: str, system_prompt: str = "", temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        max_new_tokens: int = 256, use_eagle: bool = True, time_vanilla: bool = False,
        history: list[list[str]] | None = None,
    ) -> tuple[str, str, dict]:  # fmt: skip  (a generator: each item is one such tuple)
        """Answer `message` (after `history`, a list of [user, assistant] pairs) and stream the reply.

        Bad values never fail the call: each is replaced and named in figures["input_notices"] (out-of-range
        numbers, history items that are not [user, assistant] pairs); an empty message gives figures["notice"].

        Yields (reply_html, reply_text, figures): reply_html marks the tokens that EAGLE drafted and the base
        accepted with <span class="acc">; figures holds tokens_per_s, mean_accepted_tokens_per_forward,
        rounds, new_tokens, elapsed_s, stop, vanilla_tokens_per_s and speedup (vanilla_source names the reference:
        this reply decoded again without EAGLE when time_vanilla is set, else the start-up vanilla timing)."""
        settings = Settings.parse(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                  eagle=use_eagle, time_vanilla=time_vanilla,
                                  system_prompt=system_prompt or engine.default_system)  # fmt: skip
        turns, history_notices = parse_history(history)
        settings = replace(settings, notices=settings.notices + tuple(history_notices))
        throttle = Throttle()
        for u in respond(engine, message, turns, settings, engine.baseline):
            figs = dict(u.figures, error=u.error) if u.error else u.figures
            if throttle(u.done):
                yield highlighted_html(u.text, u.marks), u.text, figs

    return dict(add_message=add_message, bot=bot, unanswered=unanswered, regenerate=regenerate, clear=clear, stop=stop,
                rerender=rerender, start_compare=start_compare, run_compare=run_compare, api_chat=api_chat)  # fmt: skip


def summary_html(s: dict, done: bool) -> str:
    if not s:
        return '<div class="eagle-summary">Speedup: –</div>'
    v, e, x = s.get("vanilla_tokens_per_s"), s.get("eagle_tokens_per_s"), s.get("speedup")
    if s.get("stopped"):
        return '<div class="eagle-summary">Stopped: no speedup figure for this run.</div>'
    speed = f'<b class="{"slower" if x and x < 1 else ""}">{x:.2f}×</b>' if x else ""
    parts = [f"Speedup {speed}" if x else "Speedup: " + ("–" if done else "measuring…")]
    if v:
        parts.append(f"vanilla {v:.2f} tokens/s")
    if e:
        parts.append(f"EAGLE {e:.2f} tokens/s")
    if s.get("mean_accepted_tokens_per_forward"):
        parts.append(f"{s['mean_accepted_tokens_per_forward']:.2f} tokens per base forward")
    if "same_text" in s:
        parts.append("same text as vanilla: " + ("yes" if s["same_text"] else "no"))
    return f'<div class="eagle-summary">{" · ".join(parts)}</div>'
