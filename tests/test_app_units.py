"""Unit tests of the app's pure parts: templates, highlighting, history truncation, settings, session logic."""

from __future__ import annotations

import json

import gradio as gr
import pytest
from app_fixtures import LIST_ROUNDS, ScriptedEngine, greedy_reply, one_thread, tiny_engine

from app.handlers import (
    chat_messages, make_handlers, new_state, new_turn, restored_conversation, saved_conversation, too_long,
)  # fmt: skip
from app.highlight import Detokenizer, Reply, plain_text, render
from app.session import Settings, compare, respond
from app.stats import RunStats, figures_html, with_vanilla
from eagle.chat.templates import (
    LLAMA2_SYSTEM_PROMPT, PromptTooLong, build_prompt, default_system_prompt, encode, fit_turns, messages, resolve_kind,
)  # fmt: skip
from eagle.decoding.generate import Round


# templates -------------------------------------------------------------------------------------------------
def test_vicuna_template_matches_fastchat_v11():
    p = build_prompt("vicuna", [("Hi", "Hello!"), ("How are you?", None)])
    assert p.startswith("A chat between a curious user and an artificial intelligence assistant.")
    assert p.endswith(" USER: Hi ASSISTANT: Hello!</s>USER: How are you? ASSISTANT:")
    custom = build_prompt("vicuna", [("Hi", None)], system="Be brief.")
    assert custom == "Be brief. USER: Hi ASSISTANT:"
    assert default_system_prompt("vicuna").startswith("A chat between")


def test_llama2_template_as_reference_web_ui():
    p = build_prompt("llama-2", [("Hi", "Hello!"), ("More?", None)], system=LLAMA2_SYSTEM_PROMPT)
    assert p == (f"[INST] <<SYS>>\n{LLAMA2_SYSTEM_PROMPT}\n<</SYS>>\n\nHi [/INST]  Hello! </s><s>[INST] More? "
                 "[/INST] ")  # fmt: skip
    assert default_system_prompt("llama-2") == LLAMA2_SYSTEM_PROMPT
    assert "You are a helpful, respectful and honest assistant." in LLAMA2_SYSTEM_PROMPT


def test_mixtral_template_has_no_system_and_eos_sep():
    p = build_prompt("mixtral", [("Hi", "Yo"), ("Again", None)], system="ignored")
    assert "<<SYS>>" not in p and "ignored" not in p
    assert p == "[INST] Hi [/INST]  Yo</s>[INST] Again [/INST] "


class _TemplateTok:
    chat_template = "x"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        self.calls.append(msgs)
        if msgs[0]["role"] == "system" and getattr(self, "no_system", False):
            raise ValueError("system role not supported")
        return "|".join(f"{m['role']}:{m['content']}" for m in msgs) + ("|assistant:" if add_generation_prompt else "")


def test_tokenizer_chat_template_gets_system_and_history():
    tok = _TemplateTok()
    p = build_prompt("chat-template", [("a", "b"), ("c", None)], system="S", tokenizer=tok)
    assert p == "system:S|user:a|assistant:b|user:c|assistant:"
    tok.no_system = True  # templates that refuse a system role get it in front of the first user message
    p = build_prompt("chat-template", [("a", None)], system="S", tokenizer=tok)
    assert p == "user:S\n\na|assistant:"


def test_template_fallback_and_errors():
    class NoTemplate:
        chat_template = None

    assert resolve_kind("chat-template", NoTemplate()) == "plain"
    assert build_prompt("chat-template", [("hi", "yo"), ("more", None)], "S", NoTemplate()) == (
        "System: S\n\nUser: hi\nAssistant: yo\nUser: more\nAssistant:"
    )
    with pytest.raises(ValueError):
        build_prompt("vicuna", [("hi", "done")])  # nothing to answer
    with pytest.raises(ValueError):
        resolve_kind("nope", None)
    assert messages([("u", None)], "") == [{"role": "user", "content": "u"}]


def test_encode_adds_bos_only_without_chat_template():
    class Tok:
        chat_template = "x"

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [0] * add_special_tokens + [len(text)]}

    assert encode("chat-template", Tok(), "abc") == [3]  # the template wrote its own BOS text
    assert encode("vicuna", Tok(), "abc") == [0, 3]
    assert encode("plain", Tok(), "abc") == [0, 3]


# history truncation ----------------------------------------------------------------------------------------
def _words(turns):
    return [w for u, r in turns for w in (u + " " + (r or "")).split()]


def test_fit_turns_drops_oldest_first():
    turns = [(f"u{i} " * 10, f"r{i} " * 10) for i in range(6)] + [("last", None)]
    fit = fit_turns(turns, 100, _words)
    assert fit.dropped == 2 and len(fit.ids) <= 100  # 4 * 20 + 1 words fit, 5 * 20 + 1 do not
    assert fit.ids[0] == "u2"
    assert fit_turns(turns, 1000, _words).dropped == 0


def test_fit_turns_message_alone_too_long():
    with pytest.raises(PromptTooLong) as e:
        fit_turns([("a b", "c"), ("x " * 50, None)], 10, _words)
    assert e.value.tokens == 50 and "shorten" in str(e.value)


# highlighting ----------------------------------------------------------------------------------------------
def test_plain_toggle_renders_the_same_markdown_without_highlights():
    plain = render("**x**\n- y", [[0, 2]], highlight=False)
    assert "<strong>x</strong>" in plain and "<li>y</li>" in plain and "acc" not in plain
    assert render("", [], True) == '<div class="eagle-tokens"></div>'


class _ByteTok:
    """Decodes ids as UTF-8 bytes: multi-byte characters come in pieces, as with byte-level BPE."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_detokenizer_waits_for_complete_characters():
    text = "né 😀!"
    ids = list(text.encode())
    d = Detokenizer(_ByteTok())
    pieces = [d.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[ids.index(0xF0)] == ""  # the emoji's first byte alone shows nothing


def test_reply_marks_accepted_tokens():
    r = Reply(_ByteTok())
    r.add_round(list(b"ab"), 1)  # "a" drafted, "b" the base's own
    r.add_round(list(b"cd"), 1)
    r.add_round(list("é".encode()) + [ord("e")], 2)  # the two bytes of é drafted
    assert r.text == "abcdée"
    assert r.marks == [[0, 1], [2, 3], [4, 5]]


# settings and figures --------------------------------------------------------------------------------------
def test_settings_parse_clamps_untrusted_values():
    s = Settings.parse(temperature="abc", top_p=7, top_k=-3, max_new_tokens=1e9, eagle=None, system_prompt=None)
    assert s == Settings(top_p=1.0, top_k=0, max_new_tokens=4096)
    assert Settings.parse(temperature=float("nan")).temperature == 0.0
    assert Settings.parse(system_prompt="a\x00b\ud800").system_prompt == "ab?"


def test_settings_parse_names_every_value_it_changed():
    s = Settings.parse(temperature=-1, top_p=2, top_k=2.5, max_new_tokens=0, eagle=True)
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.0, 1.0, 2, 1)
    assert [n.split(" ")[0] for n in s.notices] == ["temperature=-1", "top_p=2", "top_k=2.5", "max_new_tokens=0"]
    assert Settings.parse(temperature=0.7, top_k=5, max_new_tokens=None).notices == ()  # None: the default


def test_parse_history_keeps_pairs_and_names_the_rest():
    from app.session import parse_history

    turns, notices = parse_history([["a", "b"], ["hi"], ["c", ""], "x", [1, 2], ("d", "e")])
    assert turns == [("a", "b"), ("d", "e")]
    assert [n.split(" ")[0] for n in notices] == ["history[1]", "history[2]", "history[3]", "history[4]"]
    assert parse_history("nope")[1][0].startswith("history must be a list")
    assert parse_history(None) == ([], [])


def test_run_stats_and_speedup():
    st = RunStats()
    st.add(Round([1, 2, 3], 2, 0.5))
    st.add(Round([4], 0, 0.5, "eos"))
    d = with_vanilla(st.as_dict(), 2.0, "test")
    assert d["tokens_per_s"] == 4.0 and d["mean_accepted_tokens_per_forward"] == 2.0 and d["speedup"] == 2.0
    assert d["draft_tokens_accepted"] == 2 and d["stop"] == "eos"
    page = figures_html(d)
    assert "4.00" in page and "2.00×" in page and "vanilla: test" in page
    assert "No reply yet" in figures_html(None)


# the session generator on a real tiny model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with one_thread():
        yield tiny_engine(str(tmp_path_factory.mktemp("app_units")), max_length=96)


def test_respond_streams_the_greedy_reply(engine):
    s = Settings(max_new_tokens=20)
    ups = list(respond(engine, "w7 w8 w9", [], s))
    assert len(ups) >= 2 and ups[-1].done and not ups[-1].error
    final = ups[-1]
    assert final.text == greedy_reply(engine, [("w7 w8 w9", None)], 20)
    assert plain_text(final.html) == final.text
    f = final.figures
    assert f["mode"] == "eagle" and f["new_tokens"] >= 1 and f["rounds"] >= 1 and f["tokens_per_s"] > 0
    assert f["mean_accepted_tokens_per_forward"] == pytest.approx(f["new_tokens"] / f["rounds"], abs=1e-3)
    assert [len(u.text) for u in ups] == sorted(len(u.text) for u in ups)  # grows as it streams


def test_respond_vanilla_and_time_vanilla(engine):
    v = list(respond(engine, "w7 w8 w9", [], Settings(max_new_tokens=20, eagle=False)))[-1]
    e = list(respond(engine, "w7 w8 w9", [], Settings(max_new_tokens=20, time_vanilla=True)))[-1]
    assert v.text == e.text  # greedy EAGLE is lossless
    assert v.figures["mean_accepted_tokens_per_forward"] == 1.0 and "acc" not in v.html
    assert v.figures["speedup"] is None and v.figures["forwards"] == "eager"
    assert e.figures["vanilla_tokens_per_s"] > 0 and e.figures["speedup"] > 0
    assert e.figures["vanilla_source"].startswith("this reply decoded again without EAGLE")


def test_the_final_speedup_is_against_vanilla_timed_right_after_the_reply(engine):
    from app.idle_work import VanillaReference

    saved = dict(engine.references)
    try:
        engine.references.clear()  # no idle reference yet: no figure while the reply streams
        ups = list(respond(engine, "w7 w8 w9", [], Settings(max_new_tokens=20)))
        assert all(u.figures["speedup"] is None and u.figures["vanilla_source"].startswith("timing vanilla")
                   for u in ups[:-1] if u.figures["new_tokens"])  # fmt: skip
        final = ups[-1].figures
        n = final["new_tokens"]
        assert n > 2 and final["speedup"] > 0
        assert final["vanilla_source"].startswith(f"this prompt decoded without EAGLE for {n} tokens right after")
        # an idle reference of an absurd slowness (a second a step): the live figures use it, the final one does not
        engine.set_reference(VanillaReference("eager", 1.0, "timed while idle"))
        ups = list(respond(engine, "w7 w8 w9", [], Settings(max_new_tokens=40)))
        assert ups[-2].complete and ups[-2].text == ups[-1].text  # the text at once, the figures after the check
        live = ups[-2].figures
        assert live["speedup"] > 10 and live["vanilla_source"].startswith("timed while idle")
        assert ups[-1].figures["speedup"] < 10
        assert ups[-1].figures["vanilla_source"].startswith("this prompt decoded without EAGLE for 32 tokens")
        stopped = list(respond(engine, "w7 w8 w9", [], Settings(max_new_tokens=40), stop=stop_after(4)))[-1]
        assert stopped.figures["vanilla_source"].startswith("timed while idle")  # a stopped reply: no check
    finally:
        engine.references = saved


def stop_after(calls: int):
    seen = []

    def stop():
        seen.append(1)
        return len(seen) > calls

    return stop


def test_respond_bad_input_and_truncation(engine):
    assert list(respond(engine, "   ", [], Settings()))[-1].error
    too_long = list(respond(engine, "w9 " * 500, [], Settings(max_new_tokens=8)))[-1]
    assert too_long.error and "shorten" in too_long.error
    history = [(f"w{i} " * 8, f"w{i+1} " * 8) for i in range(2, 12)]
    last = list(respond(engine, "w7", history, Settings(max_new_tokens=8)))[-1]
    assert last.figures["dropped_turns"] > 0 and "left out" in last.figures["notice"]
    assert last.figures["prompt_tokens"] <= engine.max_length - 8
    emoji = list(respond(engine, "héllo 😀 \ud800", [], Settings(max_new_tokens=4)))[-1]
    assert emoji.done and not emoji.error


def test_messages_sent_while_a_reply_runs_are_answered_in_order_one_run_each(engine):
    h = make_handlers(engine)
    page = (0.0, 0.0, 0, 8, True, True, False, "", True)  # the page's settings: greedy, 8 new tokens, EAGLE
    state = new_state()
    for message in ("w7 w8", "w9"):  # the second sent before the first's run began
        _, _, state = h["add_message"](message, state, True)
    first, second = state["turns"]
    list(h["bot"](state, *page))
    assert first["reply"] == greedy_reply(engine, [("w7 w8", None)], 8) and second["reply"] is None
    assert h["unanswered"](state)  # Stop stays live: the second message's run is queued
    list(h["bot"](state, *page))
    assert second["reply"] == greedy_reply(engine, [("w7 w8", first["reply"]), ("w9", None)], 8)
    assert not h["unanswered"](state)
    list(h["bot"](state, *page))  # a run that finds no message waiting leaves the conversation as it is
    assert [t["reply"] for t in state["turns"]] == [first["reply"], second["reply"]]


def test_side_by_side_runs_asked_during_a_run_run_in_order_and_stop_ends_the_queued_too(engine):
    h = make_handlers(engine)
    page = (0.0, 0.0, 0, 8, True, True, False, "", True)  # the page's settings: greedy, 8 new tokens, EAGLE
    state = new_state()
    assert not h["comparison_waits"](state)
    h["start_compare"](state)
    h["start_compare"](state)  # Run both clicked again while the first run goes: a run of its own, queued
    run = h["run_compare"]("w7 w8", state, *page)
    next(run)
    assert h["comparison_waits"](state)
    *_, summary, _, _ = list(run)[-1]
    assert "Speedup <b" in summary and "same text as vanilla: yes" in summary
    assert h["comparison_waits"](state)  # the second click's run is queued: Stop stays live
    h["stop"](state)  # before the queued run began: it stops too, at once
    *_, summary, _, _ = list(h["run_compare"]("w9", state, *page))[-1]
    assert "Stopped" in summary and not h["comparison_waits"](state)
    h["start_compare"](state)  # a click after Stop runs
    *_, summary, _, _ = list(h["run_compare"]("w9", state, *page))[-1]
    assert "Speedup <b" in summary and not h["comparison_waits"](state)


def test_respond_stops_when_asked(engine):
    calls = []

    def stop():
        calls.append(1)
        return len(calls) >= 3

    ups = list(respond(engine, "w7 w8 w9", [], Settings(max_new_tokens=200, eagle=False), stop=stop))
    final = ups[-1]
    assert final.done and final.figures["stop"] == "stopped" and final.figures["rounds"] == 2  # 1st call: before
    assert greedy_reply(engine, [("w7 w8 w9", None)], 200).startswith(final.text)
    queued = list(respond(engine, "w7", [], Settings(), stop=lambda: True))[-1]  # stopped while waiting
    assert queued.text == "" and queued.figures["stop"] == "stopped" and queued.figures["rounds"] == 0
    assert engine._lock.acquire(blocking=False)  # the model was released
    engine._lock.release()


def test_compare_runs_vanilla_then_eagle(engine):
    steps = list(compare(engine, "w10 w11", Settings(max_new_tokens=16)))
    first_eagle = next(i for i, c in enumerate(steps) if c.eagle.text)
    assert all(not c.vanilla.running for c in steps[first_eagle:])  # never both at once
    last = steps[-1]
    assert last.done and last.summary["same_text"] is True and last.summary["speedup"] > 0
    assert last.vanilla.text == last.eagle.text


def test_rounds_run_on_the_thread_serving_model_calls(tmp_path):
    import threading

    from app_fixtures import tiny_engine

    engine = tiny_engine(str(tmp_path))
    ids = engine.prompt_ids([("w1 w2", None)])
    seen = []
    real_forward = engine.model.base.forward

    def forward(*args, **kwargs):
        seen.append(threading.current_thread())
        return real_forward(*args, **kwargs)

    engine.model.base.forward = forward
    list(engine.rounds(ids, max_new_tokens=4))  # nobody serving: the caller's thread runs them
    assert set(seen) == {threading.current_thread()}
    seen.clear()
    server = threading.Thread(target=engine.serve_model_calls, kwargs={"poll_s": 0.05})
    server.start()
    try:
        while engine._calls is None:
            threading.Event().wait(0.01)
        rounds = list(engine.rounds(ids, max_new_tokens=4))
    finally:
        engine.stop_serving()
        server.join(5)
    assert sum(len(r.tokens) for r in rounds) == 4
    assert seen and set(seen) == {server}
    assert not server.is_alive() and engine._calls is None


# the page's handlers: the /chat endpoint's HTML, a reload, an overlong message ------------------------------
def test_the_api_reply_html_is_the_page_s_rendered_markdown():
    engine = ScriptedEngine(LIST_ROUNDS)
    api = make_handlers(engine)["api_chat"]
    message = "<script>alert(0)</script> A list, please."
    html, text, figures = list(api(message))[-1]
    assert text == "".join(p for r in LIST_ROUNDS for p in r) and figures["stop"] == "eos"
    assert "<li>" in html and "<strong>" in html and "<code>" in html  # markdown, not its syntax
    assert '<span class="acc">Draft fast</span>' in html and '<span class="acc">code</span>' in html
    assert "<script" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # the model's HTML is text
    final = list(respond(engine, message, [], Settings()))[-1]  # what the page shows for the same reply
    state = new_state()
    state["turns"] = [dict(new_turn(message, 0), reply=final.text, marks=final.marks)]
    assert html == chat_messages(state)[-1]["content"]["text"]

    html, _, _ = list(api(message, use_eagle=False))[-1]  # vanilla: the same markdown, no highlights
    assert "<li>" in html and "<strong>" in html and 'class="acc"' not in html and "<script" not in html


def conversation() -> dict:
    state = new_state()
    state["turns"] = [
        dict(new_turn("**hi** <b>x</b>", 0), reply="- one\n- **two**", marks=[[2, 5], [10, 13]]),
        dict(new_turn("go on", 0), reply="Par", marks=[[0, 1]], stopped=True),
        dict(new_turn("w9 " * 50, 0), notice="Please shorten it."),
        dict(new_turn("plain", 0), reply="done", eagle=False),
        new_turn("still waiting", 0),  # no reply yet: not saved
    ]
    state["figures"] = {"mode": "eagle", "tokens_per_s": 12.5, "mean_accepted_tokens_per_forward": 2.1, "rounds": 4,
                        "new_tokens": 9, "elapsed_s": 0.7, "stop": "eos", "speedup": 1.4, "vanilla_tokens_per_s": 8.9,
                        "vanilla_source": "test", "input_notices": ["a"], "notice": None}  # fmt: skip
    return state


def test_a_saved_conversation_comes_back_after_a_reload():
    h = make_handlers(None)
    state = conversation()
    saved = json.loads(json.dumps(h["save"](state)))  # as the browser keeps it
    assert [t["user"] for t in saved["turns"]] == ["**hi** <b>x</b>", "go on", "w9 " * 50, "plain"]
    page = new_state()
    page["epoch"] = 3
    chat, figures, page = h["restore"](saved, page, True)
    state["turns"].pop()
    assert chat == chat_messages(state) and figures == figures_html(state["figures"])
    assert "<li>" in chat[1]["content"]["text"] and "stopped" in chat[3]["content"]["text"]
    assert "shorten" in chat[5]["content"]["text"] and 'class="acc"' not in chat[7]["content"]["text"]
    assert page["figures"] == state["figures"] and all(t["epoch"] == 3 for t in page["turns"])  # this session's
    assert h["save"](page) == saved

    early = new_state()  # a message sent before the page's load event came back stays, after the saved turns
    held = early["turns"]
    held.append(new_turn("sent first", 0))
    chat, _, early = h["restore"](saved, early, True)
    assert early["turns"] is held and [t["user"] for t in held] == [*(t["user"] for t in saved["turns"]), "sent first"]


def test_garbage_in_the_browser_s_storage_is_dropped_never_raised():
    h = make_handlers(None)
    empty = ([], figures_html({}))
    for garbage in (None, "text", 42, [], {}, {"version": 0, "turns": [{"user": "a", "reply": "b"}]},
                    {"version": 1, "turns": "x", "figures": []}, {"version": 1, "turns": [None, 1, {"user": 5}]},
                    {"version": 1, "turns": [{"user": "never answered"}], "figures": {"rounds": 2.5}}):  # fmt: skip
        chat, figures, state = h["restore"](garbage, new_state(), True)
        assert (chat, figures) == empty and state["turns"] == [] and state["figures"] == {}
    turn = {"user": "u\ud800", "reply": "abc\x00", "eagle": "yes", "stopped": 1,
            "marks": [[0, 2], [1, 3], [5, 9], ["a", 1], [2, 3, 4], [True, 3], [2, 3]]}  # fmt: skip
    figures = {"tokens_per_s": 3.0, "mode": "eagle", "extra": {"nested": 1}, 7: "x"}
    turns, kept = restored_conversation({"version": 1, "turns": [turn], "figures": figures})
    assert turns == [{"user": "u?", "reply": "abc", "marks": [[0, 2], [2, 3]], "eagle": True, "notice": None,
                      "stopped": False}]  # fmt: skip
    assert kept == {"tokens_per_s": 3.0, "mode": "eagle"}  # only what the panel can show
    assert restored_conversation({"version": 1, "figures": {"tokens_per_s": "fast"}}) == ([], {})


def test_the_saved_conversation_keeps_the_newest_turns_that_fit(monkeypatch):
    import app.handlers

    state = new_state()
    state["turns"] = [dict(new_turn(f"q{i}", 0), reply="x" * 100) for i in range(10)]
    one = len(json.dumps(saved_conversation({"turns": state["turns"][:1]})["turns"][0]))
    monkeypatch.setattr(app.handlers, "SAVED_MAX_CHARS", 3 * one + 1)
    assert [t["user"] for t in saved_conversation(state)["turns"]] == ["q7", "q8", "q9"]


def test_an_overlong_message_is_refused_when_sent_and_stays_in_the_box(engine, monkeypatch):
    shown = []
    monkeypatch.setattr(gr, "Warning", shown.append)
    add = make_handlers(engine)["add_message"]
    state = new_state()
    long = "w9 " * 7000  # 21,000 characters, 7,000 tokens: the context holds 96
    box, chat, state = add(long, state, True)
    assert box == long and chat == [] and state["turns"] == []  # nothing queued for the model
    assert len(shown) == 1 and "7,000 tokens (21,000 characters)" in shown[0] and "holds 96 tokens" in shown[0]
    assert "shorten" in shown[0]
    box, chat, state = add("w9 " * 90, state, True)  # fits the context (the reply's room is respond's to judge)
    assert box == "" and len(chat) == 1 and len(shown) == 1
    assert too_long(ScriptedEngine(LIST_ROUNDS), "x" * 20_000) is None  # a tokenizer that cannot count: respond's


def test_the_context_defaults_to_the_bases_window_within_the_kv_budget(tmp_path):
    from app.engine import Engine, kv_bytes_per_token

    model = tiny_engine(str(tmp_path)).model
    window = model.config.get_text_config().max_position_embeddings
    per_token = kv_bytes_per_token(model)
    text = model.config.get_text_config()
    kv_heads = text.num_key_value_heads or text.num_attention_heads
    assert per_token >= 2 * text.num_hidden_layers * kv_heads * (text.hidden_size // text.num_attention_heads) * 4
    assert Engine(model).max_length == window
    assert "the base's window" in Engine(model).context_line()
    tight = Engine(model, kv_budget_mb=per_token * 100 / 2**20)  # room for 100 tokens' keys and values
    assert tight.max_length == 100 < window and "--kv-budget-mb" in tight.context_line()
    assert Engine(model, max_length=64).max_length == 64 and "--max-length" in Engine(model, max_length=64).context_line()


def test_the_figures_say_how_much_of_the_context_a_conversation_fills():
    from app.stats import figures_html

    shown = figures_html({"mode": "eagle", "context_tokens": 1234, "context_limit": 8192})
    assert "context used" in shown and "1,234 of 8,192 tokens (15%)" in shown
    assert "context used</td><td>–" in figures_html({"mode": "eagle"})


def test_a_sessions_next_turn_reads_its_last_turns_rows_and_answers_as_a_cold_start(engine):
    s = Settings(max_new_tokens=12)
    first = list(respond(engine, "w7 w8 w9", [], s, conversation="session-a"))[-1]
    assert first.figures["prompt_tokens_cached"] == 0 and first.figures["time_to_first_token_s"] > 0
    turns = [("w7 w8 w9", first.text)]
    warm = list(respond(engine, "w3 w4", turns, s, conversation="session-a"))[-1]
    cold = list(respond(engine, "w3 w4", turns, s))[-1]
    assert warm.text == cold.text == greedy_reply(engine, [*turns, ("w3 w4", None)], 12)
    f = warm.figures
    assert 0 < f["prompt_tokens_cached"] < f["prompt_tokens"] and cold.figures["prompt_tokens_cached"] == 0
    assert "prompt tokens cached" in figures_html(f) and "tokens/s after the first" in figures_html(f)
    kept = engine.model.prefix_store.get("session-a")  # the vanilla check read the rows and left them as they were
    assert kept.tokens[: f["prompt_tokens"]] == engine.fit([*turns, ("w3 w4", None)], "", 12).ids
    assert len(kept.tokens) == f["prompt_tokens"] + f["new_tokens"]


def test_the_vanilla_check_times_a_long_reply_at_its_start_and_at_its_end(engine, monkeypatch):
    import app.session as session

    monkeypatch.setattr(session, "CHECK_TOKENS", 4)  # a reply of 12 tokens is longer than two windows of 4
    s = Settings(max_new_tokens=12)
    calls = []
    run = session._vanilla_rounds
    monkeypatch.setattr(session, "_vanilla_rounds", lambda e, ids, *a: calls.append(list(ids)) or run(e, ids, *a))
    final = list(respond(engine, "w5 w6", [], s, conversation="session-b"))[-1]
    if final.figures["new_tokens"] <= 8:
        pytest.skip("the tiny model ended its reply early")
    prompt = engine.fit([("w5 w6", None)], "", 12).ids
    reply_ids = engine.model.prefix_store.get("session-b").tokens[len(prompt):]
    assert calls == [prompt, prompt + reply_ids[:-4]]
    assert "at the reply's start" in final.figures["vanilla_source"] and final.figures["speedup"]
    calls.clear()
    list(respond(engine, "w5 w6", [], s))  # no kept caches: the end's prefill would be the whole reply again
    assert calls == [prompt]
