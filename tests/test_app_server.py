"""The app served on 127.0.0.1 with a tiny real model, driven with gradio_client: the /chat endpoint, a
browser session's own events, bad input, Stop, Regenerate, and concurrent sessions."""

from __future__ import annotations

import threading
import time

import pytest
from app_fixtures import LIST_ROUNDS, ScriptedEngine, greedy_reply, one_thread, serve, tiny_engine
from gradio_client import Client

from app.highlight import plain_text

# gradio's queue statistics use pandas options that pandas 3 deprecates: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:.*no_silent_downcasting", "ignore:The copy keyword")
SETTINGS = dict(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=16, eagle=True, highlight=True,
                time_vanilla=False, system_prompt="", context_drafts=True)  # fmt: skip


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with one_thread():
        engine = tiny_engine(str(tmp_path_factory.mktemp("app_server")), max_length=512)
        with serve(engine) as demo:
            yield engine, demo


def client(demo) -> Client:
    return Client(demo.local_url, verbose=False)


def respond(c: Client, **over):
    s = {**SETTINGS, **over}
    args = list(s.values())  # the page's settings in their order (ui.build's `settings`)
    return c.submit(*args, api_name="/respond")


def say(c: Client, message: str, **over):
    """One chat turn as the page does it: add the message, then stream the reply. Returns (chat, figures)."""
    c.predict(message, True, api_name="/add_message")
    return respond(c, **over).result(timeout=120)


def last_reply(chat) -> str:
    msg = chat[-1]
    assert msg["role"] == "assistant"
    return msg["content"][0]["text"]


# ---------------------------------------------------------------------------------------------------------
def test_chat_endpoint_is_documented_and_streams(app):
    engine, demo = app
    c = client(demo)
    api = c.view_api(print_info=False, return_format="dict")
    params = [p["parameter_name"] for p in api["named_endpoints"]["/chat"]["parameters"]]
    assert params[:7] == ["message", "system_prompt", "temperature", "top_p", "top_k", "max_new_tokens", "use_eagle"]
    assert set(api["named_endpoints"]) == {"/chat"}  # the page's own events stay out of the docs

    job = c.submit("w7 w8 w9", max_new_tokens=24, api_name="/chat")
    chunks = list(job)
    html, text, figures = job.result()
    assert len(chunks) >= 2  # streamed
    assert text == greedy_reply(engine, [("w7 w8 w9", None)], 24)
    assert plain_text(html) == text and html.startswith('<div class="eagle-tokens">')
    for key in ("tokens_per_s", "mean_accepted_tokens_per_forward", "rounds", "new_tokens", "elapsed_s", "stop"):
        assert key in figures
    assert figures["tokens_per_s"] > 0 and figures["new_tokens"] == 24
    assert figures["draft_tokens_accepted"] > 0 and '<span class="acc">' in html

    html2, text2, fig2 = c.predict("w10", use_eagle=False, time_vanilla=True, max_new_tokens=8, api_name="/chat")
    assert fig2["mode"] == "vanilla" and 'class="acc"' not in html2
    _, _, fig3 = c.predict("w10", time_vanilla=True, max_new_tokens=8, history=[["w3", "w4 w5"]], api_name="/chat")
    assert fig3["speedup"] > 0 and fig3["vanilla_tokens_per_s"] > 0
    # context drafts: an optional keyword (after history), the shares by source in the figures
    assert params[-1] == "context_drafts"
    html4, text4, fig4 = c.predict("w7 w8 w9", max_new_tokens=24, context_drafts=False, api_name="/chat")
    assert text4 == text and fig4["share_from_context"] == 0.0 and 'class="ctx"' not in html4
    assert sum(figures[k] for k in ("share_from_base", "share_from_head", "share_from_context")) == pytest.approx(1)


def test_bad_values_through_the_api_are_named_not_silently_used(app):
    engine, demo = app
    c = client(demo)
    _, text, figures = c.predict("w10", max_new_tokens=0, temperature=-1, top_p=2, top_k=-5, history=[["hi"]],
                                 api_name="/chat")  # fmt: skip
    notices = figures["input_notices"]
    assert len(notices) == 5, notices
    for name in ("max_new_tokens=0", "temperature=-1", "top_p=2", "top_k=-5", "history[0]"):
        assert any(n.startswith(name) for n in notices), name
    assert figures["new_tokens"] == 1 and text  # max_new_tokens 0 -> 1, said so
    _, text, figures = c.predict("  ", api_name="/chat")
    assert text == "" and figures["notice"].startswith("Empty message")


def test_the_speedup_shown_is_against_vanilla_on_the_same_forwards_or_none(app):
    from app.idle_work import VanillaReference, vanilla_reference

    engine, demo = app
    saved = dict(engine.references)
    try:
        engine.references.clear()
        engine.set_reference(VanillaReference("compiled", 1e-4, "compiled forwards"))  # not this reply's path
        # one new token: too short for the check after the reply, so only the idle reference could give a figure
        _, _, api = client(demo).predict("w40", max_new_tokens=1, api_name="/chat")
        assert api["forwards"] == "eager" and api["speedup"] is None and api["vanilla_tokens_per_s"] is None
        assert api["vanilla_source"].startswith("timing vanilla decoding on eager forwards")
        _, figures = say(client(demo), "w40", max_new_tokens=1)
        assert "fig-speedup" not in figures and "timing vanilla decoding on eager forwards" in figures

        engine.add_job(vanilla_reference(engine, "eager"))
        engine.run_idle_work()
        step = engine.reference("eager").step_s
        _, _, api = client(demo).predict("w40", max_new_tokens=2, api_name="/chat")
        assert api["speedup"] > 0 and "timed while idle" in api["vanilla_source"]
        # vanilla's time for this reply = its prefill round + a step per further token: longer than the steps
        assert api["new_tokens"] / api["vanilla_tokens_per_s"] > (api["new_tokens"] - 1) * step * 0.99
        _, figures = say(client(demo), "w40", max_new_tokens=2)
        assert "fig-speedup" in figures and "timed while idle" in figures and "eager" in figures
        # a longer reply: its final figure is against this prompt's vanilla timed right after it
        _, _, api = client(demo).predict("w40", max_new_tokens=8, api_name="/chat")
        assert api["speedup"] > 0 and api["vanilla_source"].startswith("this prompt decoded without EAGLE for 8 ")
    finally:
        engine.references = saved


def test_the_chat_endpoint_renders_markdown_as_the_page_does():
    message = "<script>alert(0)</script> A list, please."
    with serve(ScriptedEngine(LIST_ROUNDS)) as demo:
        c = client(demo)
        html, text, _ = c.predict(message, api_name="/chat")
        chat, _ = say(c, message)
    assert "<li>" in html and "<strong>" in html and "<code>" in html and "**" not in html
    assert '<span class="acc">Draft fast</span>' in html and '<span class="acc">code</span>' in html
    assert "<script" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # the model's HTML is text
    assert html == last_reply(chat) and plain_text(html).startswith("Steps:")


def test_page_session_chat_regenerate_clear(app):
    engine, demo = app
    c = client(demo)
    chat, figures = say(c, "w11 w12")
    reply = plain_text(last_reply(chat))
    assert reply == greedy_reply(engine, [("w11 w12", None)], 16)
    assert 'class="eagle-tokens"' in last_reply(chat) and "tokens/s" in figures and "EAGLE" in figures

    chat, _ = say(c, "w13")  # the second turn sees the first
    second = plain_text(last_reply(chat))
    assert second == greedy_reply(engine, [("w11 w12", reply), ("w13", None)], 16)
    assert [m["role"] for m in chat] == ["user", "assistant"] * 2

    chat = c.predict(True, api_name="/regenerate")
    assert chat[-1]["role"] == "user"  # the reply is gone, the question stays
    chat, _ = respond(c).result(timeout=60)
    assert plain_text(last_reply(chat)) == second and len(chat) == 4  # greedy: the same reply again

    chat, _ = say(c, "w14", highlight=False)
    assert 'class="acc"' not in last_reply(chat)  # the plain-text toggle: no highlights

    chat, figures = c.predict(api_name="/clear")
    assert chat == [] and "No reply yet" in figures


def test_bad_input_keeps_the_session(app):
    engine, demo = app
    c = client(demo)
    chat, _ = say(c, "w20 w21")
    good = last_reply(chat)

    msg, chat = c.predict("   ", True, api_name="/add_message")  # empty: nothing is added
    assert len(chat) == 2
    chat, _ = respond(c).result(timeout=60)
    assert len(chat) == 2 and last_reply(chat) == good

    long = "w9 " * 33_334  # 100,002 characters: refused when sent, left in the box to be shortened
    msg, chat = c.predict(long, True, api_name="/add_message")
    assert msg == long and len(chat) == 2
    chat, figures = say(c, "w9 " * 300, max_new_tokens=400)  # fits the context, but not with the reply's room
    assert len(chat) == 4 and chat[2]["content"][0]["text"].startswith("w9 w9")
    assert "shorten" in last_reply(chat) and "shorten" in figures

    chat, _ = say(c, "héllo wörld 😀🦅 中文 \u200b")  # unicode and emoji (unknown words)
    assert chat[-2]["content"][0]["text"].startswith("héllo wörld 😀🦅")

    chat, _ = say(c, "w22")  # and the conversation goes on, with the earlier turns intact
    assert len(chat) == 8 and last_reply(chat) != "" and chat[1]["content"][0]["text"] == good


def test_an_overlong_message_is_refused_at_once_while_the_model_is_busy(app, monkeypatch):
    engine, demo = app
    busy, c = client(demo), client(demo)
    busy.predict("w7 w8", True, api_name="/add_message")
    gate, forward = threading.Event(), engine.model.base.forward
    monkeypatch.setattr(engine.model.base, "forward", lambda *a, **k: gate.wait(60) and forward(*a, **k))
    job = respond(busy)  # holds the model until the gate opens
    try:
        time.sleep(0.5)
        long = "w9 " * 6_667  # 20,001 characters
        start = time.monotonic()
        msg, chat = c.predict(long, True, api_name="/add_message")
        assert time.monotonic() - start < 10 and not job.done()  # refused while the model is still busy
        assert msg == long and chat == []
    finally:
        gate.set()
    job.result(timeout=60)


def long_prompt(engine, candidates=("w30 w31", "w36 w37 w38", "w44 w45")):
    """A prompt whose greedy reply does not end early (so there is time to stop it), and that reply."""
    replies = {p: greedy_reply(engine, [(p, None)], 4096) for p in candidates}
    best = max(replies, key=lambda p: len(replies[p]))
    return best, replies[best]


def test_stop_mid_stream_then_new_message(app, monkeypatch):
    engine, demo = app
    prompt, full = long_prompt(engine)
    assert len(full.split()) >= 200
    c = client(demo)
    c.predict(prompt, True, api_name="/add_message")
    # vanilla, one token per base forward, each held to >= 10 ms: on a fast machine the tiny model would otherwise
    # write hundreds of tokens before the Stop lands, and the next turn's prompt would outgrow the context
    forward = engine.model.base.forward
    monkeypatch.setattr(engine.model.base, "forward", lambda *a, **k: time.sleep(0.01) or forward(*a, **k))
    job = respond(c, max_new_tokens=4096, eagle=False)
    deadline = time.time() + 60
    while len(job.outputs()) < 2 and time.time() < deadline:
        time.sleep(0.005)
    assert len(job.outputs()) >= 2
    c.predict(api_name="/stop")  # the Stop button
    chat, figures = job.result(timeout=30)  # the reply ends at the next round
    monkeypatch.undo()
    assert "stopped by you" in figures and len(chat) == 2
    chat, figures = say(c, "w32")
    assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
    shown, marker = chat[1]["content"][0]["text"].split("\n\n", 1)  # the reply, then the "stopped" line
    assert "stopped" in marker
    partial = plain_text(shown)  # rendered words: a paragraph's spaces are the source's
    assert partial and full.startswith(partial) and len(partial) < len(full)  # stopped; what was shown is kept
    assert plain_text(last_reply(chat)) == greedy_reply(engine, [(prompt, partial), ("w32", None)], 16)
    # the server still serves normally
    assert c.predict("w7 w8 w9", max_new_tokens=24, api_name="/chat")[1] == greedy_reply(
        engine, [("w7 w8 w9", None)], 24
    )


def test_regenerate_while_generating(app):
    engine, demo = app
    prompt, full = long_prompt(engine)
    c = client(demo)
    c.predict(prompt, True, api_name="/add_message")
    job = respond(c, max_new_tokens=4096, eagle=False)
    deadline = time.time() + 60
    while len(job.outputs()) < 2 and time.time() < deadline:
        time.sleep(0.005)
    chat = c.predict(True, api_name="/regenerate")  # the page chains /respond after this
    assert len(chat) == 1
    job.result(timeout=30)  # the old reply ends at its next round
    chat, figures = respond(c, max_new_tokens=16).result(timeout=60)
    assert len(chat) == 2 and "stopped" not in last_reply(chat)
    assert plain_text(last_reply(chat)) == greedy_reply(engine, [(prompt, None)], 16)


def test_eight_concurrent_sessions_get_their_own_replies(app):
    engine, demo = app
    prompts = [f"w{10 + i} w{20 + 2 * i} w{40 - i}" for i in range(8)]
    expected = [greedy_reply(engine, [(p, None)], 16) for p in prompts]
    follow = [f"w{30 + i}" for i in range(8)]
    assert len(set(expected)) >= 6  # the prompts really give different replies
    clients = [client(demo) for _ in prompts]
    results, errors = [None] * 8, []

    def session(i):
        try:
            chat1, _ = say(clients[i], prompts[i])
            chat2, _ = say(clients[i], follow[i])
            results[i] = (chat1, chat2)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and all(results)
    for i, (chat1, chat2) in enumerate(results):
        first = plain_text(last_reply(chat1))
        assert first == expected[i], f"session {i} got another reply"
        assert len(chat2) == 4 and chat2[0]["content"][0]["text"] == prompts[i]
        assert plain_text(last_reply(chat2)) == greedy_reply(engine, [(prompts[i], first), (follow[i], None)], 16)


def test_side_by_side_endpoint(app):
    engine, demo = app
    c = client(demo)
    args = list(SETTINGS.values())
    c.predict(api_name="/start_compare")
    v_html, v_fig, e_html, e_fig, summary, figures = c.predict("w15 w16", *args, api_name="/compare")
    assert plain_text(v_html) == plain_text(e_html) == greedy_reply(engine, [("w15 w16", None)], 16)
    assert "Speedup <b" in summary and "×</b>" in summary and "same text as vanilla: yes" in summary
    assert "Vanilla" in v_fig and "tokens/s" in e_fig
    assert "EAGLE" in figures and "the vanilla run of this prompt beside it" in figures  # the panel follows the run
    chat, figures = say(c, "w17")  # another prompt: its speedup is never the side-by-side run's vanilla figure
    assert "the vanilla run of this prompt beside it" not in figures
    assert "right after the reply (same forwards)" in figures


def test_side_by_side_race_plays_and_replays_without_the_model(app, monkeypatch):
    engine, demo = app
    c = client(demo)
    args = list(SETTINGS.values())
    c.predict(1.0, api_name="/replay")  # nothing to replay yet: a toast, no frames, no error
    c.predict(api_name="/start_compare")
    v_html, _, e_html, _, summary, _ = c.predict("w18 w19", *args, api_name="/compare")
    job = c.submit(2.0, api_name="/race")  # as the page does after the run
    frames = list(job) or [job.result(timeout=60)]
    v_end, e_end, status = frames[-1]
    assert plain_text(v_end).startswith(plain_text(v_html)) and plain_text(e_end).startswith(plain_text(e_html))
    assert "tokens/s" in v_end and "finished" in e_end and "🏁" in status
    assert summary.split("Speedup ")[1].split("×")[0] in status  # the final ratio is the run's speedup

    def no_model(*a, **k):
        raise AssertionError("Replay decoded again")

    monkeypatch.setattr(engine, "rounds", no_model)
    assert c.predict(4.0, api_name="/replay") == frames[-1]
