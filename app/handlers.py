"""What the page's events do, around the pure session logic: per-session state, chat messages, Stop / Clear /
Regenerate, the side-by-side run and its race (played back, replayed), and the scripted `/chat` endpoint.

Each browser session keeps its conversation in `gr.State` (plain text plus the character ranges that EAGLE
drafted, by source: `highlight.Reply.marks`; the HTML is rendered from it on every update). Only the model is
shared. The browser keeps a copy of the answered turns and the last figures (`saved_conversation`, in its local
storage), which a reload of the page brings back (`restored_conversation`).

(No `from __future__ import annotations` here: gr.api reads the /chat endpoint's types from real annotations.)
"""

import html
import json
import time
import uuid
from dataclasses import replace

import gradio as gr

from .highlight import render
from .markdown_render import CONTEXT
from .race import Race, parse_speed
from .race import pane_html as race_pane_html
from .race import status_html as race_status_html
from .session import Settings, clean_text, compare, conversation_key, parse_history, respond
from .stats import figures_html, shares_text

# At most 4 page updates per second while streaming: each update costs the page and the server a share of the
# cores the model needs, whatever the reply's length (measured by `python -m app.speed_check`;
# docs/history/2026-11-23-app-live-speed.md).
UPDATE_EVERY_S = 0.25
# The race after a side-by-side run plays at most 8 frames per second (it decodes nothing; each update costs the
# page as above), and checks every 0.1 s whether a newer race or run has replaced it.
RACE_FPS, RACE_POLL_S = 8.0, 0.1


# state ---------------------------------------------------------------------------------------------------
def new_state() -> dict:
    """One session's conversation and figures.

    turns: [{"user", "reply" (None until generated), "marks" (drafted character ranges), "eagle", "notice",
    "epoch"}]; figures: the last run's.
    epoch: bumped by Stop / Clear / Regenerate; a run goes on only while the epoch it was queued with is
    current. (Gradio hands every event of a session the same state object, so a running generator sees
    the bump at its next round; it then ends normally, which keeps history and page consistent.)
    compares: the epochs of side-by-side runs asked for (Run both) and not started, oldest first;
    comparing: a side-by-side run is running."""
    return {"turns": [], "figures": {}, "epoch": 0, "compares": [], "comparing": False}


def new_turn(message: str, epoch: int) -> dict:
    return {"user": message, "reply": None, "marks": [], "eagle": True, "notice": None, "epoch": epoch}


def _text(s: str) -> dict:
    return {"type": "text", "text": s}  # a text message as is (a bare string would be dedented by Gradio)


def _notice_html(notice: str) -> str:
    return f'<div class="eagle-notice">⚠ {html.escape(notice)}</div>'


def waits(turn: dict) -> bool:
    """The turn's message has no reply yet (nor a notice that stands for one): a run is writing it or queued for it."""
    return turn["reply"] is None and not turn.get("notice")


def chat_messages(state: dict, highlight: bool = True) -> list[dict]:
    msgs = []
    for t in state["turns"]:
        msgs.append({"role": "user", "content": _text(html.escape(t["user"]))})  # shown as typed, never as HTML
        if waits(t):
            if t.get("waiting"):  # the model is finishing a unit of idle work first
                msgs.append({"role": "assistant", "content": _text(
                    f'<div class="eagle-muted eagle-waiting">⏳ {html.escape(t["waiting"])}</div>')})
            continue
        body = render(t["reply"] or "", t["marks"], highlight and t.get("eagle", True)) if t["reply"] else ""
        extra = _notice_html(t["notice"]) if t.get("notice") else ""
        if t.get("stopped"):
            extra += '<div class="eagle-muted">⏹ stopped</div>'
        if extra:
            body = f"{body}\n\n{extra}" if body else extra
        msgs.append({"role": "assistant", "content": _text(body)})
    return msgs


def _settings(temperature, top_p, top_k, max_new_tokens, eagle, highlight, time_vanilla, system_prompt,
              context_drafts=None) -> Settings:  # fmt: skip
    """The page's settings, in the order of ui.build's `settings` list (context_drafts None: the default, on)."""
    return Settings.parse(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                          eagle=eagle, highlight=highlight, time_vanilla=time_vanilla, system_prompt=system_prompt,
                          context_drafts=context_drafts)  # fmt: skip


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


def too_long(engine, message: str) -> str | None:
    """Why `message` can never be answered (alone it fills the model's context), or None. Checked when it is sent,
    outside the model's queue, so that it is refused at once; one that fits but leaves too little room for the
    reply is refused by `respond`, which knows max_new_tokens."""
    limit = engine.max_length
    if 4 * len(message) + 1 < limit:  # a character is at most 4 tokens (its UTF-8 bytes), plus one leading piece
        return None
    try:
        tokens = len(engine.tokenizer(message, add_special_tokens=False)["input_ids"])
    except Exception:  # a tokenizer that cannot count it here: `respond` still refuses it
        return None
    if tokens < limit:
        return None
    return (f"This message is {tokens:,} tokens ({len(message):,} characters), but the model's context holds "
            f"{limit:,} tokens for the prompt and the reply together. Please shorten it and send it again.")


# a reload ------------------------------------------------------------------------------------------------
SAVED_VERSION = 1  # the form `saved_conversation` writes; data of another form is dropped, never guessed at
SAVED_MAX_CHARS = 1_000_000  # JSON characters kept, newest turns first: a browser stores ~5 MB for a site


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, bool, int, float))


def _figures(figures) -> dict:
    """The plain JSON entries of `figures` (scalars, lists of scalars), if the figures panel renders them, else {}."""
    if not isinstance(figures, dict):
        return {}
    out = {k: v for k, v in figures.items()
           if isinstance(k, str) and (_scalar(v) or isinstance(v, list) and all(map(_scalar, v)))}  # fmt: skip
    try:
        figures_html(out)
    except Exception:  # a value of the wrong type for its row
        return {}
    return out


def _marks(marks, length: int) -> list[list[int]]:
    """The valid marks of `marks` (`highlight.Reply.marks`): [start, end) ranges of whole numbers, ascending, inside
    the text, not overlapping, each [start, end] (the head's drafts) or [start, end, CONTEXT] (context copies)."""
    out, pos = [], 0
    for m in marks if isinstance(marks, list) else ():
        if (isinstance(m, list) and len(m) in (2, 3) and all(type(x) is int for x in m)
                and m[2:] in ([], [CONTEXT]) and pos <= m[0] < m[1] <= length):  # fmt: skip
            out.append(m)
            pos = m[1]
    return out


def _turn(t) -> dict | None:
    """A saved turn as the session keeps it (`new_turn`'s keys), or None if it is not one."""
    if not isinstance(t, dict) or not isinstance(t.get("user"), str):
        return None
    reply, notice = t.get("reply"), t.get("notice")
    reply = clean_text(reply) if isinstance(reply, str) else None
    notice = clean_text(notice) if isinstance(notice, str) and notice else None
    if reply is None and notice is None:
        return None  # never answered
    return {"user": clean_text(t["user"]), "reply": reply, "marks": _marks(t.get("marks"), len(reply or "")),
            "eagle": t.get("eagle") is not False, "notice": notice, "stopped": t.get("stopped") is True}  # fmt: skip


def saved_conversation(state: dict) -> dict:
    """What the browser keeps of a session: its answered turns (the newest SAVED_MAX_CHARS of them) and the figures
    of its last reply. A turn still waiting for its reply is left out: a reload shows what was saved before it."""
    turns, size = [], 0
    for t in reversed(state["turns"]):
        turn = _turn(t)
        if turn is None:
            continue
        size += len(json.dumps(turn))
        if size > SAVED_MAX_CHARS:
            break
        turns.append(turn)
    return {"version": SAVED_VERSION, "turns": turns[::-1], "figures": _figures(state.get("figures"))}


def restored_conversation(saved) -> tuple[list[dict], dict]:
    """(turns, figures) from what the browser sent back: untrusted (old, edited, or from any client), so whatever
    is not as `saved_conversation` writes it is dropped; never raises."""
    if not isinstance(saved, dict) or saved.get("version") != SAVED_VERSION:
        return [], {}
    turns = [t for t in map(_turn, saved.get("turns") if isinstance(saved.get("turns"), list) else []) if t]
    return turns, _figures(saved.get("figures"))


# handlers ------------------------------------------------------------------------------------------------
def make_handlers(engine):
    def add_message(message, state, highlight):
        message = clean_text(message)
        if not message.strip():
            gr.Info("Type a message first.")
            return message, chat_messages(state, highlight), state
        if notice := too_long(engine, message):
            gr.Warning(notice)
            return message, chat_messages(state, highlight), state  # kept in the box, to be shortened
        state["turns"].append(new_turn(message, state["epoch"]))
        return "", chat_messages(state, highlight), state

    def bot(state, *raw):
        settings = _settings(*raw)
        turns = state["turns"]
        turn = next((t for t in turns if waits(t)), None)  # the oldest message still waiting: one run each, in order
        if turn is None:
            yield chat_messages(state, settings.highlight), figures_html(state.get("figures")), state
            return
        turn["eagle"] = settings.eagle
        history = [(t["user"], t["reply"]) for t in turns[:turns.index(turn)] if t["reply"]]
        stopped = lambda: state["epoch"] != turn["epoch"]  # noqa: E731
        for notice in settings.notices:
            gr.Warning(notice)
        for line in engine.waiting_lines():  # the model finishes a unit of idle work first (seconds)
            turn["waiting"] = line
            yield chat_messages(state, settings.highlight), figures_html(state.get("figures")), state
        turn.pop("waiting", None)
        throttle = Throttle()
        conversation = state.setdefault("conversation", uuid.uuid4().hex)  # this session's kept caches' key
        for u in respond(engine, turn["user"], history, settings, stop=stopped, conversation=conversation):
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
            if throttle(u.done or u.complete):
                yield chat_messages(state, settings.highlight), figures_html(state["figures"], not u.done), state

    def unanswered(state) -> bool:
        """A message waits for its reply (a reply is being written or queued)."""
        return any(map(waits, state["turns"]))

    def regenerate(state, highlight):
        if not state["turns"]:
            gr.Info("Nothing to regenerate yet.")
        else:
            state["epoch"] += 1  # stops the reply being written, if any
            state["turns"][-1] = new_turn(state["turns"][-1]["user"], state["epoch"])
        return chat_messages(state, highlight), state

    def clear(state):
        engine.forget(state.pop("conversation", None))  # a new conversation: its caches start afresh
        state["epoch"] += 1
        state["turns"].clear()  # in place: a run that is ending renders this same (empty) list
        state["figures"] = {}
        return [], figures_html(None), state

    def stop(state):
        state["epoch"] += 1
        return state

    def rerender(state, highlight):
        return chat_messages(state, highlight)

    def save(state):
        return saved_conversation(state)

    def restore(saved, state, highlight):
        """A page load: the conversation and figures that the browser kept, in this new session. They go before
        anything sent in it already (a message can beat the load event), in place (a running reply holds the list)."""
        turns, figures = restored_conversation(saved)
        state["turns"][:0] = [dict(t, epoch=state["epoch"]) for t in turns]
        state["figures"] = state["figures"] or figures
        return chat_messages(state, highlight), figures_html(state["figures"]), state

    def end_race(state):
        """No race to replay until a run finishes, and the one playing (if any) ends."""
        state["race"] = None
        state["race_play"] = state.get("race_play", 0) + 1

    def start_compare(state):
        """A click of Run both: its run is queued behind any other (one run each, in order); Stop before it
        starts stops it too."""
        state["compares"].append(state["epoch"])
        end_race(state)
        return state

    def run_compare(message, state, *raw):
        # the oldest click's (runs start in click order); called without a click (a script): now's epoch
        epoch = state["compares"].pop(0) if state["compares"] else state["epoch"]
        state["comparing"] = True
        try:
            yield from _run_compare(message, state, epoch, _settings(*raw))
        finally:
            state["comparing"] = False

    def comparison_waits(state) -> bool:
        """A side-by-side run is running or queued."""
        return state["comparing"] or bool(state["compares"])

    def _run_compare(message, state, epoch: int, settings: Settings):
        end_race(state)  # at the click, and again when this run gets the model (a run queued behind another)
        throttle = Throttle()
        for c in compare(engine, message, settings, stop=lambda: state["epoch"] != epoch):
            if c.error:
                gr.Warning(c.error)
            stopped = c.vanilla.figures.get("stop") == "stopped" or c.eagle.figures.get("stop") == "stopped"
            if c.done and not stopped and c.eagle.figures.get("tokens_per_s"):  # the side panel follows this run
                state["figures"] = c.eagle.figures  # with the vanilla run beside it
            if c.done:
                race = Race.from_comparison(c)
                state["race"] = race.as_dict() if race else None
            if throttle(c.done):
                yield (c.vanilla.html, figures_html(c.vanilla.figures, c.vanilla.running), c.eagle.html,
                       figures_html(c.eagle.figures, c.eagle.running), summary_html(c.summary, c.done),
                       figures_html(state["figures"]), state)  # fmt: skip

    def play_race(state, speed=1.0):
        """Play the session's last race (`app.race`) into the two panes and the summary line, each frame at its
        time; never touches the model. Ends early when another race starts playing or a run starts."""
        if not state.get("race"):
            return
        race, speed = Race.from_dict(state["race"]), parse_speed(speed)
        state["race_play"] = mine = state.get("race_play", 0) + 1
        start = time.monotonic()
        for f in race.frames(RACE_FPS, speed):
            while (wait := start + f.at - time.monotonic()) > 0:
                time.sleep(min(wait, RACE_POLL_S))
                if state.get("race_play") != mine:
                    return
            if state.get("race_play") != mine:
                return
            status = race_status_html(f, speed) + (summary_html(race.summary, True) if f.finished else "")
            yield race_pane_html(race.vanilla, f.vanilla), race_pane_html(race.eagle, f.eagle), status

    def replay(state, speed=1.0):
        if not state.get("race"):
            gr.Info("Nothing to replay yet: run both first (a stopped run leaves no race).")
            return
        yield from play_race(state, speed)

    def api_chat(
        message: str, system_prompt: str = "", temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        max_new_tokens: int = 256, use_eagle: bool = True, time_vanilla: bool = False,
        history: list[list[str]] | None = None, context_drafts: bool = True,
    ) -> tuple[str, str, dict]:  # fmt: skip  (a generator: each item is one such tuple)
        """Answer `message` (after `history`, a list of [user, assistant] pairs) and stream the reply.

        Bad values never fail the call: each is replaced and named in figures["input_notices"] (out-of-range
        numbers, history items that are not [user, assistant] pairs); an empty message gives figures["notice"].

        context_drafts (default on): copies of earlier text (the prompt or the reply so far) offered beside the
        head's drafts, verified in the same base pass (the reply is the same either way); the engine offers them
        where they measure worth it, and on compiled rounds once their compiled round is in.

        Yields (reply_html, reply_text, figures): reply_html is the reply as the page shows it, its markdown
        rendered and sanitised (the model's HTML shows as text), with the characters of the tokens that EAGLE
        drafted and the base accepted highlighted when use_eagle is on: in <span class="acc"> where the head
        drafted them, in <span class="ctx"> where they were copied from the context; figures holds tokens_per_s,
        mean_accepted_tokens_per_forward, rounds, new_tokens, elapsed_s, stop, draft_tokens_accepted (all
        accepted drafts), context_tokens_accepted (of those, context copies), share_from_base, share_from_head
        and share_from_context (fractions of new_tokens, adding up to 1; None before any token),
        vanilla_tokens_per_s and speedup (vanilla_source names the reference: this reply decoded again without
        EAGLE when time_vanilla is set, else this prompt decoded without EAGLE for 32 tokens right after the reply
        (while it streams: vanilla decoding on the same forwards timed while the app was idle; none while that is
        being timed), over this reply's length), and forwards: what the reply ran on, "eager"
        or "compiled")."""
        settings = Settings.parse(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                  eagle=use_eagle, time_vanilla=time_vanilla, context_drafts=context_drafts,
                                  system_prompt=system_prompt or engine.default_system)  # fmt: skip
        turns, history_notices = parse_history(history)
        settings = replace(settings, notices=settings.notices + tuple(history_notices))
        throttle = Throttle()
        conversation = conversation_key("chat", settings.system_prompt, turns, message)
        for u in respond(engine, message, turns, settings, conversation=conversation):
            figs = dict(u.figures, error=u.error) if u.error else u.figures
            if throttle(u.done or u.complete):
                yield u.html, u.text, figs  # rendered as the page renders it (highlights: EAGLE runs only)

    return dict(add_message=add_message, bot=bot, unanswered=unanswered, regenerate=regenerate, clear=clear, stop=stop,
                rerender=rerender, save=save, restore=restore, start_compare=start_compare, run_compare=run_compare,
                comparison_waits=comparison_waits, play_race=play_race, replay=replay,
                api_chat=api_chat)  # fmt: skip


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
    if shares := shares_text(s):
        parts.append(f"EAGLE's tokens: {shares}")
    if "same_text" in s:
        parts.append("same text as vanilla: " + ("yes" if s["same_text"] else "no"))
    return f'<div class="eagle-summary">{" · ".join(parts)}</div>'
