"""The page: a chat with highlighted accepted draft tokens and live figures, a side-by-side EAGLE vs vanilla
tab, and the scripted endpoint `/chat`.

The event handlers live in `app.handlers`; this module lays out the page and wires the events. Every event
that uses the model runs in one queue group ("model", one at a time).
"""

from __future__ import annotations

import html

import gradio as gr

from eagle.shipped import ASSETS

from .handlers import make_handlers, new_state, summary_html
from .highlight import LEGEND_HTML, PLAIN_LABELS_JS
from .race import SPEEDS as RACE_SPEEDS
from .session import MAX_NEW_TOKENS_LIMIT
from .stats import figures_html

MODEL_GROUP = "model"
MODEL_PANEL_EVERY_S = 3.0
SAVED_KEY = "eagle-chat"  # the browser's local storage key of the saved conversation

MEASURE_NOTE = (
    "**How the speedup is measured.** The same prompt (no chat history, the system prompt and settings on the "
    "right) is decoded first with vanilla decoding (one token per forward pass of the base model) and then with "
    "EAGLE, one after the other on the same model, never at the same time. Tokens/s = new tokens ÷ the summed "
    "wall time of the decoding rounds (prompt prefill included, page rendering excluded). "
    "Speedup = EAGLE tokens/s ÷ vanilla tokens/s. At temperature 0 both texts must be identical: EAGLE is lossless."
)
RACE_NOTE = (
    "**The race.** After both runs, the two replies play back side by side at the pace each was decoded: every "
    "round's tokens appear at the time the round ended in its own run (its decoding time so far), with that run's "
    "tokens/s so far under it. **Replay** plays it again without decoding again."
)
FIGURES_NOTE = (
    "Tokens/s = new tokens ÷ decoding time. Mean accepted tokens / base forward = new tokens ÷ rounds "
    "(1.0 for vanilla). The vanilla figure comes from the source named under the table; speedup = EAGLE ÷ vanilla. "
    "New tokens by source: the base's own token of each forward, the head's drafts accepted, and context copies "
    "accepted (earlier text offered beside the head's drafts)."
)


def css() -> str:
    path = ASSETS / "app.css"
    return path.read_text() if path.is_file() else ""


# A narrow window (a phone) opens at the top: the message box's autofocus would scroll the page down to it.
NARROW_OPENS_AT_TOP_JS = """() => {
  if (window.innerWidth >= 700) return;
  setTimeout(() => { document.activeElement?.blur(); window.scrollTo(0, 0); }, 300);
}"""
PAGE_JS = f"() => {{ ({PLAIN_LABELS_JS})(); ({NARROW_OPENS_AT_TOP_JS})(); }}"


def launch_options() -> dict:
    """Keyword arguments for `demo.launch` (Gradio 6 takes css and js there)."""
    opts = {"css": css(), "js": PAGE_JS}
    if (ASSETS / "logo.svg").is_file():
        opts["favicon_path"] = str(ASSETS / "logo.svg")
    return opts


def _logo() -> str:
    path = ASSETS / "logo.svg"
    return path.read_text() if path.is_file() else ""


# layout --------------------------------------------------------------------------------------------------
def model_info_md(engine) -> str:
    i = engine.info
    reference = engine.reference()
    rows = [("model type", i.get("model_type")), ("base", i.get("base")), ("head", i.get("head")),
            ("draft", i.get("draft")), ("tree", i.get("tree")), ("forwards", i.get("forwards")),
            ("context drafts", i.get("context_drafts")),
            ("in the background", engine.status if engine.jobs or engine.child else None),
            ("EAGLE replies", engine.reply_figures()),
            ("vanilla reference", f"{1 / reference.step_s:.1f} tokens/s after the prefill ({reference.source})"
             if reference else f"being timed ({engine.path} forwards)"),
            ("dtype / device", i.get("dtype_device")), ("weights", i.get("weights")),
            ("context", engine.context_line()), ("template", engine.template)]  # fmt: skip
    return "\n".join(f"- **{k}**: `{v}`" for k, v in rows if v)


def model_panel(engine):
    """The Model panel now, and whether to look again (while idle work is left)."""
    return model_info_md(engine), gr.Timer(active=bool(engine.jobs or engine.child))


def build(engine, max_new_tokens: int = 512, title: str = "EAGLE speculative decoding") -> gr.Blocks:
    h = make_handlers(engine)
    default_new = max(1, min(int(max_new_tokens), MAX_NEW_TOKENS_LIMIT))
    with gr.Blocks(title=title) as demo:
        state = gr.State(new_state())
        # the answered turns and last figures, in the browser's local storage (handlers.saved_conversation), for a
        # reload; saved at the end of each reply and by Clear; unreadable after a restart of the app (a new secret)
        saved = gr.BrowserState(None, storage_key=SAVED_KEY)
        gr.HTML(
            f'<div class="eagle-header"><div class="eagle-logo">{_logo()}</div><div><h1>{html.escape(title)}</h1>'
            f"<p>The draft head proposes a tree of tokens; the base model checks them all in one forward pass and "
            f"keeps the longest agreeing path. Model: <b>{html.escape(engine.name or '?')}</b></p></div></div>"
        )
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=420):
                with gr.Tabs():
                    with gr.Tab("Chat", id="chat"):
                        chatbot = gr.Chatbot(
                            height=480, label="Chat", show_label=False, elem_id="chat", latex_delimiters=[],
                            feedback_options=None,
                            buttons=["copy_all"], placeholder="Ask something: the reply streams in as the base "
                            "model accepts the draft's tokens.",
                        )  # fmt: skip
                        gr.HTML(LEGEND_HTML)
                        with gr.Row():
                            msg = gr.Textbox(placeholder="Your message (Enter to send, Shift+Enter for a new line)",
                                             show_label=False, lines=1, max_lines=8, scale=6, elem_id="msg",
                                             autofocus=True)  # fmt: skip
                            send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="send")
                        with gr.Row():
                            stop = gr.Button("Stop", variant="stop", elem_id="stop", interactive=False)
                            regen = gr.Button("Regenerate", elem_id="regen")
                            clear = gr.Button("Clear", elem_id="clear")
                    with gr.Tab("EAGLE vs vanilla", id="compare"):
                        gr.Markdown(MEASURE_NOTE, elem_classes=["eagle-note"])
                        with gr.Row():
                            cmp_msg = gr.Textbox(placeholder="A prompt to decode both ways (Enter to run)",
                                                 show_label=False, scale=6, lines=1, max_lines=6, elem_id="cmp_msg")  # fmt: skip
                            cmp_run = gr.Button("Run both", variant="primary", scale=1, min_width=80, elem_id="cmp_run")
                            cmp_stop = gr.Button("Stop", variant="stop", scale=1, min_width=80, interactive=False,
                                                 elem_id="cmp_stop")  # fmt: skip
                            replay = gr.Button("Replay", scale=1, min_width=80, elem_id="replay")
                        summary = gr.HTML(summary_html({}, False), elem_id="cmp_summary")
                        with gr.Row(equal_height=True):
                            with gr.Column():
                                gr.Markdown("#### Vanilla decoding (1 token per base forward)")
                                v_out = gr.HTML('<div class="eagle-tokens pane"></div>', elem_classes=["pane"])
                                v_fig = gr.HTML(figures_html(None))
                            with gr.Column():
                                gr.Markdown("#### EAGLE")
                                e_out = gr.HTML('<div class="eagle-tokens pane"></div>', elem_classes=["pane"])
                                e_fig = gr.HTML(figures_html(None))
                        with gr.Row(equal_height=True):
                            gr.HTML(LEGEND_HTML)
                            race_speed = gr.Radio([(f"{x:g}×", x) for x in RACE_SPEEDS], value=1.0,
                                                  label="Race playback speed", elem_id="race_speed")  # fmt: skip
                        gr.Markdown(RACE_NOTE, elem_classes=["eagle-note"])
            with gr.Column(scale=1, min_width=280):
                gr.Markdown("### Live figures")
                figures = gr.HTML(figures_html(None), elem_id="figures")
                gr.Markdown(FIGURES_NOTE, elem_classes=["eagle-note"])
                with gr.Accordion("Settings", open=True):
                    eagle = gr.Checkbox(True, label="EAGLE on (off = vanilla decoding)", elem_id="eagle")
                    highlight = gr.Checkbox(True, label="Highlight accepted draft tokens (off = plain text)",
                                            elem_id="highlight")  # fmt: skip
                    time_vanilla = gr.Checkbox(False, label="Time vanilla too (decodes each reply again without "
                                               "EAGLE, for the speedup figure)")  # fmt: skip
                    context_drafts = gr.Checkbox(True, label="Context drafts (copies of earlier text offered beside "
                                                 "the head's drafts; same reply either way)",
                                                 elem_id="context_drafts")  # fmt: skip
                    temperature = gr.Slider(0.0, 2.0, 0.0, step=0.05, label="temperature (0 = greedy)")
                    top_p = gr.Slider(0.0, 1.0, 1.0, step=0.01, label="top-p (1 = off)")
                    top_k = gr.Slider(0, 200, 0, step=1, label="top-k (0 = off)")
                    max_new = gr.Slider(1, MAX_NEW_TOKENS_LIMIT, default_new, step=1, label="max new tokens",
                                        elem_id="max_new")
                    system = gr.Textbox(engine.default_system, label="System prompt", lines=3, max_lines=10,
                                        placeholder="(empty: the chat template's default)")  # fmt: skip
                with gr.Accordion("Model", open=False):
                    model_md = gr.Markdown(model_info_md(engine))
                    model_timer = gr.Timer(MODEL_PANEL_EVERY_S)  # progress of the work done while idle

        # in handlers._settings' order (the page's own events take them all; /chat takes keywords with defaults)
        settings = [temperature, top_p, top_k, max_new, eagle, highlight, time_vanilla, system, context_drafts]
        # The page's own events are callable by clients ("undocumented") so that tests can drive a real
        # session; the documented scripting endpoint is /chat below. Stop, Clear and Regenerate bump the
        # session's epoch instead of cancelling Gradio events: the running generator ends at its next round.
        # queued (its own group, no limit) so that its "type a message first" toast reaches the page
        add_io = dict(fn=h["add_message"], inputs=[msg, state, highlight], outputs=[msg, chatbot, state],
                      concurrency_limit=None, show_progress="hidden")  # fmt: skip
        # trigger_mode "multiple": a message sent (or Run both clicked) while a run goes gets a run of its own, queued
        # behind it (under the default "once" the page drops a second trigger of a running event: never answered)
        bot_io = dict(fn=h["bot"], inputs=[state, *settings], outputs=[chatbot, figures, state],
                      concurrency_id=MODEL_GROUP, concurrency_limit=1, show_progress="minimal",
                      trigger_mode="multiple")  # fmt: skip
        cmp_io = dict(fn=h["run_compare"], inputs=[cmp_msg, state, *settings],
                      outputs=[v_out, v_fig, e_out, e_fig, summary, figures, state], concurrency_id=MODEL_GROUP,
                      concurrency_limit=1, show_progress="minimal", trigger_mode="multiple")  # fmt: skip
        # the race plays no model, so it waits in no queue; it ends when the session starts another run or race
        race_io = dict(fn=h["play_race"], inputs=[state, race_speed], outputs=[v_out, e_out, summary],
                       concurrency_limit=None, show_progress="hidden", trigger_mode="multiple")  # fmt: skip
        hidden = dict(api_visibility="private")
        undocumented = dict(api_visibility="undocumented")

        def running(event, io: dict, button, waiting=lambda state: False, **api):
            """`io` after `event`, with `button` (a Stop) live while it runs and greyed out after, unless
            `waiting(state)`: another request of this session is queued behind it."""
            live = dict(fn=lambda: gr.Button(interactive=True), inputs=None, outputs=button, queue=False, **hidden)
            idle = dict(fn=lambda state: gr.Button(interactive=waiting(state)), inputs=[state], outputs=button,
                        queue=False, **hidden)  # fmt: skip
            return event.then(**live).then(**io, **api).then(**idle)

        unanswered = h["unanswered"]
        save = dict(fn=h["save"], inputs=[state], outputs=[saved], queue=False, **hidden)
        running(msg.submit(**add_io, api_name="add_message", **undocumented), bot_io, stop, unanswered,
                api_name="respond", **undocumented).then(**save)  # fmt: skip
        running(send.click(**add_io, **hidden), bot_io, stop, unanswered, **hidden).then(**save)
        running(regen.click(h["regenerate"], [state, highlight], [chatbot, state], queue=False, api_name="regenerate",
                            **undocumented), bot_io, stop, unanswered, **hidden).then(**save)  # fmt: skip
        comparing = h["comparison_waits"]
        running(cmp_run.click(h["start_compare"], [state], [state], queue=False, api_name="start_compare",
                              **undocumented), cmp_io, cmp_stop, comparing, api_name="compare",
                **undocumented).then(**race_io, api_name="race", **undocumented)  # fmt: skip
        running(cmp_msg.submit(h["start_compare"], [state], [state], queue=False, **hidden), cmp_io, cmp_stop,
                comparing, **hidden).then(**race_io, **hidden)  # fmt: skip
        replay.click(**dict(race_io, fn=h["replay"]), api_name="replay", **undocumented)
        stop.click(h["stop"], [state], [state], queue=False, api_name="stop", **undocumented)
        cmp_stop.click(h["stop"], [state], [state], queue=False, **hidden)
        clear.click(h["clear"], [state], [chatbot, figures, state], queue=False, api_name="clear",
                    **undocumented).then(**save)  # fmt: skip
        chatbot.clear(h["clear"], [state], [chatbot, figures, state], queue=False, **hidden).then(**save)  # its 🗑
        highlight.change(h["rerender"], [state, highlight], [chatbot], queue=False, **hidden)
        gr.api(h["api_chat"], api_name="chat", concurrency_id=MODEL_GROUP, concurrency_limit=1)
        demo.load(h["restore"], [saved, state, highlight], [chatbot, figures, state], queue=False, **hidden)
        # read again at each page load and, while idle work is left, every few seconds
        demo.load(lambda: model_panel(engine), None, [model_md, model_timer], queue=False, **hidden)
        model_timer.tick(lambda: model_panel(engine), None, [model_md, model_timer], queue=False, **hidden)
    demo.queue(default_concurrency_limit=1, max_size=64)
    return demo
