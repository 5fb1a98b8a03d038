"""The app served on 127.0.0.1 with a tiny real model, driven with gradio_client: the /chat endpoint, a
browser session's own events, bad input, Stop, Regenerate, and concurrent sessions."""

from __future__ import annotations

import threading
import time

import pytest
from gradio_client import Client
from test_app_helpers import greedy_reply, one_thread, serve, tiny_engine

from app.highlight import plain_text

# gradio's queue statistics use pandas options that pandas 3 deprecates: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:.*no_silent_downcasting", "ignore:The copy keyword")
SETTINGS = dict(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=16, eagle=True, highlight=True,
                time_vanilla=False, system_prompt="")  # fmt: skip


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
    args = [s[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens", "eagle", "highlight",
                           "time_vanilla", "system_prompt")]  # fmt: skip
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


def test_the_chat_shows_a_speedup_from_the_start_up_vanilla_timing(app):
    engine, demo = app
    saved = engine.baseline
    try:
        tps, source = engine.measure_baseline(8)
        assert tps > 0 and "start-up" in source
        _, figures = say(client(demo), "w40")  # a fresh session: no vanilla of its own yet
        assert "speedup" in figures and "start-up" in figures
        _, _, api = client(demo).predict("w40", max_new_tokens=8, api_name="/chat")
        assert api["vanilla_tokens_per_s"] == round(tps, 2) and api["speedup"] > 0
    finally:
        engine.baseline = saved


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

    chat, figures = say(c, "w9 " * 33_334)  # 100,002 characters: too long for the context, said so
    assert len(chat) == 4 and chat[2]["content"][0]["text"].startswith("w9 w9")
    assert "shorten" in last_reply(chat) and "shorten" in figures

    chat, _ = say(c, "héllo wörld 😀🦅 中文 \u200b")  # unicode and emoji (unknown words)
    assert chat[-2]["content"][0]["text"].startswith("héllo wörld 😀🦅")

    chat, _ = say(c, "w22")  # and the conversation goes on, with the earlier turns intact
    assert len(chat) == 8 and last_reply(chat) != "" and chat[1]["content"][0]["text"] == good


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
    args = [SETTINGS[k] for k in ("temperature", "top_p", "top_k", "max_new_tokens", "eagle", "highlight",
                                  "time_vanilla", "system_prompt")]  # fmt: skip
    c.predict(api_name="/start_compare")
    v_html, v_fig, e_html, e_fig, summary, figures = c.predict("w15 w16", *args, api_name="/compare")
    assert plain_text(v_html) == plain_text(e_html) == greedy_reply(engine, [("w15 w16", None)], 16)
    assert "Speedup <b" in summary and "×</b>" in summary and "same text as vanilla: yes" in summary
    assert "Vanilla" in v_fig and "tokens/s" in e_fig
    assert "EAGLE" in figures and "your last side-by-side run" in figures  # the chat's panel follows the run
    chat, figures = say(c, "w17")  # the chat now quotes the side-by-side vanilla figure
    assert "your last side-by-side run" in figures and "speedup" in figures
