"""The OpenAI-compatible API (app/openai_api.py) on the app's own server, a tiny real model behind it and its model
calls on a thread of their own (as launch.py runs them), driven with the official `openai` package and, for the
wire format, raw HTTP (httpx): replies streamed and not, equal to the page's; stop strings; the figures; bad input;
the key; the one queue (in order, bounded, a dropped stream or a dropped waiting request)."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import openai
import pytest
import torch
from app_fixtures import greedy_reply, one_thread, serve, tiny_engine
from gradio_client import Client

from app.cli import parser
from app.highlight import Detokenizer
from app.openai_api import OpenAIServer
from app.stop_text import StopText, first_stop

pytestmark = pytest.mark.filterwarnings("ignore:.*no_silent_downcasting", "ignore:The copy keyword")
CONTEXT = 512


class RoundLog:
    """Every generation the model runs (its prompt) and the (start, end) times of its rounds."""

    def __init__(self, model):
        self.calls: list[tuple[list[int], list[tuple[float, float]]]] = []
        stream = model.stream

        def logged(input_ids, **kw):
            entry = (list(input_ids), [])
            self.calls.append(entry)
            return self._timed(stream(input_ids, **kw), entry[1])

        model.stream = logged

    @staticmethod
    def _timed(rounds, times):
        try:
            while True:
                t0 = time.monotonic()
                try:
                    r = next(rounds)
                except StopIteration:
                    return
                times.append((t0, time.monotonic()))
                yield r
        finally:
            rounds.close()

    def prompts(self) -> list[list[int]]:
        return [ids for ids, _ in self.calls]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with one_thread():
        engine = tiny_engine(str(tmp_path_factory.mktemp("openai_api")), max_length=CONTEXT)
        log = RoundLog(engine.model)
        model_thread = threading.Thread(target=engine.serve_model_calls, kwargs={"poll_s": 0.05}, daemon=True)
        model_thread.start()
        while engine._calls is None:
            time.sleep(0.01)
        api = OpenAIServer(engine, max_new_tokens=32)
        try:
            with serve(engine, max_new_tokens=32, app_kwargs=api.app_kwargs()) as demo:
                yield engine, api, demo.local_url.rstrip("/"), log
        finally:
            engine.stop_serving()
            model_thread.join(timeout=30)


def client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, **kw)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def idle(engine) -> bool:
    return not engine.queue.locked() and engine.queue.waiting() == 0


class Gate:
    """`close()`: the model's next base forwards wait until `open()` (opened at the end of the test whatever)."""

    def __init__(self, model, monkeypatch):
        self.model, self.monkeypatch, self.opened = model, monkeypatch, threading.Event()

    def close(self) -> None:
        forward = self.model.base.forward
        self.monkeypatch.setattr(self.model.base, "forward", lambda *a, **k: self.opened.wait(60) and forward(*a, **k))

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(server, monkeypatch):
    g = Gate(server[0].model, monkeypatch)
    yield g
    g.open()
    wait_for(lambda: idle(server[0]), what="the model to be free")


def chat_ids(engine, text: str) -> list[int]:
    return engine.prompt_ids([(text, None)], engine.default_system)


def stream_text(stream) -> tuple[str, list]:
    chunks = list(stream)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


# replies -------------------------------------------------------------------------------------------------
def test_chat_streamed_and_not_is_the_page_reply_with_its_figures(server):
    engine, api, url, _ = server
    c = client(url)
    want = greedy_reply(engine, [("w7 w8 w9", None)], 24)
    out = c.chat.completions.create(model="tiny", messages=user("w7 w8 w9"), temperature=0, max_tokens=24)
    assert out.object == "chat.completion" and out.model == "tiny" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want and out.choices[0].finish_reason == "length"
    u, t = out.usage, out.timings
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(chat_ids(engine, "w7 w8 w9")), 24,
                                                                      u.prompt_tokens + 24)  # fmt: skip
    # llama.cpp's timings names, and ours; the accepted counts add up to the reply's tokens
    assert t["predicted_n"] == 24 and t["prompt_n"] == u.prompt_tokens and t["cache_n"] == 0
    assert t["predicted_n_base"] + t["draft_n_accepted"] == 24
    assert t["draft_n_accepted_head"] + t["draft_n_accepted_context"] == t["draft_n_accepted"] > 0
    assert t["tokens_per_forward"] == pytest.approx(24 / t["rounds"], abs=1e-3) and t["rounds"] < 24
    assert t["draft_n"] >= t["draft_n_accepted_head"] and t["draft_n"] == (t["rounds"] - 1) * 11  # 12-node tree
    for key in ("prompt_ms", "predicted_ms", "predicted_per_second", "tokens_per_second", "prompt_per_second"):
        assert t[key] > 0, key
    assert t["use_eagle"] is True and t["forwards"] == "eager"

    text, chunks = stream_text(c.chat.completions.create(model="tiny", messages=user("w7 w8 w9"), temperature=0,
                                                         max_tokens=24, stream=True,
                                                         stream_options={"include_usage": True}))  # fmt: skip
    assert text == want and len(chunks) > 3  # streamed: the role, a chunk per round, the end, the usage
    assert chunks[0].choices[0].delta.role == "assistant"
    end, last = chunks[-2], chunks[-1]
    assert end.choices[0].finish_reason == "length" and end.timings["predicted_n"] == 24
    assert last.choices == [] and last.usage.completion_tokens == 24 and last.timings == end.timings
    assert all(ch.usage is None for ch in chunks[:-1])

    vanilla = c.chat.completions.create(model="tiny", messages=user("w7 w8 w9"), temperature=0, max_tokens=24,
                                        extra_body={"use_eagle": False, "context_drafts": False})  # fmt: skip
    assert vanilla.choices[0].message.content == want  # lossless
    assert vanilla.timings["rounds"] == 24 and vanilla.timings["draft_n"] == vanilla.timings["draft_n_accepted"] == 0


def test_at_temperature_0_the_api_answers_what_the_page_answers(server):
    engine, api, url, _ = server
    history = [["w7 w8", "w9 w10 w11"], ["w12", "w13 w14"]]
    page = Client(url, verbose=False).predict("w15 w16", max_new_tokens=20, history=history, api_name="/chat")[1]
    msgs = [m for u, a in history for m in ({"role": "user", "content": u}, {"role": "assistant", "content": a})]
    msgs.append({"role": "user", "content": [{"type": "text", "text": "w15 w16"}]})  # content as text parts
    out = client(url).chat.completions.create(model="tiny", messages=msgs, temperature=0, max_tokens=20)
    assert out.choices[0].message.content == page
    assert page == greedy_reply(engine, [*map(tuple, history), ("w15 w16", None)], 20)


def test_finish_reason_stop_at_the_end_of_the_reply_and_a_seed_repeats_a_sampled_reply(server, monkeypatch):
    engine, api, url, _ = server
    c = client(url)
    ids = greedy_tokens(engine, chat_ids(engine, "w20 w21"), 12)
    monkeypatch.setattr(engine.model, "stop_token_ids", {ids[4]})  # the reply's 5th token ends it (as an eos would)
    first = ids.index(ids[4]) + 1
    out = c.chat.completions.create(model="tiny", messages=user("w20 w21"), temperature=0, max_tokens=12)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == first
    monkeypatch.undo()
    sampled = [c.chat.completions.create(model="tiny", messages=user("w20 w21"), temperature=1.0, max_tokens=16,
                                         seed=1234).choices[0].message.content for _ in range(2)]  # fmt: skip
    assert sampled[0] == sampled[1] and sampled[0]


def greedy_tokens(engine, ids: list[int], n: int) -> list[int]:
    out = engine.model.eagenerate(torch.tensor([ids]), temperature=0.0, max_new_tokens=n, max_length=CONTEXT)
    return out[0, len(ids) :].tolist()


def test_completions_streamed_and_not(server):
    engine, api, url, _ = server
    c = client(url)
    ids = list(engine.tokenizer("w30 w31 w32", add_special_tokens=True)["input_ids"])
    want = engine.tokenizer.decode(greedy_tokens(engine, ids, 16), skip_special_tokens=True)
    out = c.completions.create(model="tiny", prompt="w30 w31 w32", temperature=0)  # max_tokens: 16, as OpenAI's
    assert out.object == "text_completion" and out.choices[0].text == want and out.usage.completion_tokens == 16
    assert out.choices[0].finish_reason == "length" and out.timings["predicted_n"] == 16
    chunks = list(c.completions.create(model="tiny", prompt=ids, temperature=0, stream=True))  # token ids too
    assert "".join(ch.choices[0].text for ch in chunks) == want and chunks[-1].choices[0].finish_reason == "length"


# stop strings -------------------------------------------------------------------------------------------
def test_stop_text_cuts_as_the_whole_text_would_however_it_is_split():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 16)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        st = StopText(stops)
        sent = [st.add(p) for p in pieces] + [st.finish()]
        cut = first_stop(text, stops)
        assert "".join(sent) == (text if cut is None else text[:cut]), (text, stops, pieces)
    st = StopText(["abc", "b"])  # the stop completed first wins: "b" ends before "abc" does
    assert st.add("a") == "" and st.add("bc") == "a" and st.hit == "b"


def test_stop_strings_cut_exactly_even_across_rounds(server):
    engine, api, url, _ = server
    c = client(url)
    prompt = "w33 w34"
    detok, texts = Detokenizer(engine.tokenizer), []
    for r in engine.rounds(chat_ids(engine, prompt), max_new_tokens=40):
        texts.append("".join(detok.push(t) for t in r.tokens))
    full = "".join(texts)
    k = next(i for i in range(1, len(texts) - 1) if texts[i] and len(texts[i + 1]) >= 2)
    stop = texts[k][-1] + texts[k + 1][:2]  # from the end of one round into the next
    want = full[: first_stop(full, [stop])]
    kw = dict(model="tiny", messages=user(prompt), temperature=0, max_tokens=40)
    out = c.chat.completions.create(**kw, stop=["w999", stop])
    assert out.choices[0].message.content == want and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 40
    assert out.timings["predicted_n_base"] + out.timings["draft_n_accepted"] == out.usage.completion_tokens
    text, chunks = stream_text(c.chat.completions.create(**kw, stop=stop, stream=True))
    assert text == want and chunks[-1].choices[0].finish_reason == "stop"
    assert not any(stop in (ch.choices[0].delta.content or "") for ch in chunks)
    out = c.chat.completions.create(**kw, stop="w999")  # never written: the whole reply
    assert out.choices[0].message.content == full and out.choices[0].finish_reason == "length"


# bad input ----------------------------------------------------------------------------------------------
GOOD = {"model": "tiny", "messages": user("w7"), "max_tokens": 2, "temperature": 0}
TEXT_PART_IMAGE = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
BAD = [  # (changes to GOOD (None = left out), status, param, words of the message)
    ({"temperature": 3}, 400, "temperature", "from 0 to 2"),
    ({"temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"top_p": 1.5}, 400, "top_p", "from 0 to 1"),
    ({"max_tokens": 0}, 400, "max_tokens", f"from 1 to {CONTEXT}"),
    ({"max_tokens": 10**9}, 400, "max_tokens", f"from 1 to {CONTEXT}"),
    ({"max_tokens": 2.5}, 400, "max_tokens", "integer"),
    ({"max_completion_tokens": 3}, 400, "max_completion_tokens", "differ"),
    ({"n": 2}, 400, "n", "n must be 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ({"stop": [""]}, 400, "stop", "1 to 1000 characters"),
    ({"stop": 3}, 400, "stop", "a string or a list of strings"),
    ({"seed": "x"}, 400, "seed", "integer"),
    ({"top_k": -1}, 400, "top_k", "at least 0"),
    ({"use_eagle": "yes"}, 400, "use_eagle", "true or false"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed when stream is true"),
    ({"logprobs": True}, 400, "logprobs", "not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", "not supported"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty", "not supported"),
    ({"messages": None}, 400, "messages", "non-empty list"),
    ({"messages": []}, 400, "messages", "non-empty list"),
    ({"messages": ["hi"]}, 400, "messages[0]", "an object"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "no tools"),
    ({"messages": [{"role": "user", "content": TEXT_PART_IMAGE}]}, 400, "messages[0].content[0]", "text only"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "a string or"),
    ({"messages": user("a") + [{"role": "assistant", "content": "b"}]}, 400, "messages", "last message"),
    ({"messages": [{"role": "assistant", "content": "b"}, *user("a")]}, 400, "messages", "start with a user"),
    ({"model": None}, 400, "model", "you must give a model"),
    ({"model": "gpt-4o"}, 404, "model", "does not exist"),
    ({"messages": user("w9 " * 600)}, 400, "messages", f"maximum context length is {CONTEXT} tokens"),
    ({"messages": user("w9 " * 300), "max_tokens": 300}, 400, "messages", "may have 256 tokens, but it has 30"),
]  # fmt: skip
RAW_BAD = [  # (method, path, body bytes, status, words)
    ("POST", "/v1/chat/completions", b"{not json", 400, "could not parse the JSON body"),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "w7"}], '
     b'"temperature": NaN}', 400, "temperature must be a number"),
    ("POST", "/v1/chat/completions", b"x" * (8 * 2**20 + 1), 413, "over 8 MiB"),
    ("POST", "/v1/completions", b'{"model": "tiny"}', 400, "prompt must be a string"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": [99999]}', 400, "from 0 to 47"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "w7", "echo": true}', 400, "echo=True is not supported"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ["w7", "w8"]}', 400, "one prompt per request"),
    ("GET", "/v1/chat/completions", b"", 405, "GET is not allowed"),
    ("POST", "/v1/embeddings", b"{}", 404, "Unknown endpoint /v1/embeddings"),
    ("GET", "/v1/models/gpt-4o", b"", 404, "does not exist"),
]  # fmt: skip


def served(url: str) -> bool:
    r = httpx.post(url + "/v1/chat/completions", json=GOOD, timeout=60)
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_each_bad_input_gets_its_status_and_message_and_the_next_request_is_served(server):
    engine, api, url, log = server
    before = len(log.calls)
    for change, status, param, words in BAD:
        body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (status, param), (change, err)
        assert words in err["message"] and err["type"] == "invalid_request_error" and err["code"], (change, err)
        assert served(url), change
    for method, path, data, status, words in RAW_BAD:
        r = httpx.request(method, url + path, content=data, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == status and words in r.json()["error"]["message"], (path, data[:60], r.text[:300])
        assert served(url), (path, data[:60])
    assert len(log.calls) == before + len(BAD) + len(RAW_BAD)  # none of the bad ones reached the model
    c = client(url)  # the SDK's own errors
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        c.chat.completions.create(model="tiny", messages=user("w7"), n=3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.chat.completions.create(model="nope", messages=user("w7"))


def test_models_health_and_the_api_key(server, monkeypatch):
    engine, api, url, _ = server
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    assert client(url).models.retrieve("tiny").id == "tiny"
    monkeypatch.setattr(api, "api_key", "s3cret")
    r = httpx.get(url + "/v1/models")  # no key at all
    assert r.status_code == 401 and "didn't provide an API key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        client(url).chat.completions.create(model="tiny", messages=user("w7"), max_tokens=2)
    r = httpx.post(url + "/v1/chat/completions", json=GOOD)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    keyed = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
    assert keyed.chat.completions.create(model="tiny", messages=user("w7"), max_tokens=2).usage.completion_tokens == 2
    health = httpx.get(url + "/health").json()  # open without the key
    assert health["status"] == "ok" and health["queue"] == {"running": False, "waiting": 0, "max_waiting": 32}
    monkeypatch.setattr(api, "locked", "start it with --api-key KEY")  # --auth without --api-key
    with pytest.raises(openai.AuthenticationError, match="--api-key KEY"):
        keyed.models.list()
    assert httpx.get(url).status_code == 200  # the page is served as before
    assert parser().parse_args(["--api-key", "k", "--queue-size", "4"]).api_key == "k"


# the wire format ----------------------------------------------------------------------------------------
def test_server_sent_events_as_curl_sees_them(server):
    engine, api, url, _ = server
    body = {**GOOD, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") and "\n" not in e for e in events[:-2])
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and "timings" in chunks[-2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == greedy_reply(engine, [("w7", None)], 12)
    body = {"model": "tiny", "prompt": "w7 w8", "max_tokens": 4, "stream": True}
    raw = httpx.post(url + "/v1/completions", json=body, timeout=60).text
    chunks = [json.loads(e.removeprefix("data: ")) for e in raw.split("\n\n")[:-2]]
    assert raw.endswith("data: [DONE]\n\n") and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks) and "timings" in chunks[-1]


# the queue ----------------------------------------------------------------------------------------------
def test_sixteen_concurrent_streams_are_all_answered_in_arrival_order(server, gate):
    engine, api, url, log = server
    prompts = [f"w{10 + i} w{40 - i}" for i in range(16)]
    want = [greedy_reply(engine, [(p, None)], 8) for p in prompts]
    c, results, errors = client(url, timeout=120), [None] * 16, []
    gate.close()

    def ask(i):
        try:
            results[i] = stream_text(c.chat.completions.create(model="tiny", messages=user(prompts[i]),
                                                               temperature=0, max_tokens=8, stream=True))  # fmt: skip
        except Exception as e:  # reported below
            errors.append((i, e))

    start = len(log.calls)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for i, t in enumerate(threads):
        t.start()  # one after the other: the first holds the model at the gate, the others queue in this order
        wait_for(lambda i=i: engine.queue.waiting() == i and engine.queue.locked(), what=f"request {i}")
    gate.open()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [text for text, _ in results] == want  # none lost, each its own
    assert all(chunks[-1].choices[0].finish_reason in ("length", "stop") for _, chunks in results)
    assert log.prompts()[start:] == [chat_ids(engine, p) for p in prompts]  # served in arrival order


def test_a_dropped_stream_frees_the_model_within_one_round(server, monkeypatch):
    engine, api, url, log = server
    forward = engine.model.base.forward
    monkeypatch.setattr(engine.model.base, "forward", lambda *a, **k: time.sleep(0.02) or forward(*a, **k))
    stream = client(url).chat.completions.create(model="tiny", messages=user("w36 w37 w38"), temperature=0,
                                                  max_tokens=400, stream=True)  # fmt: skip
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 3:
            break
    dropped = time.monotonic()
    stream.close()
    wait_for(lambda: idle(engine), timeout=10, what="the model to be freed")
    freed = time.monotonic()
    record, (_, rounds) = api.runs[-1], log.calls[-1]
    wait_for(lambda: "ended" in record, timeout=10, what="the request's end")
    assert record["status"] == "dropped" and record["timings"]["predicted_n"] < 400
    noticed = record["cancelled"]
    started_after = [t0 for t0, _ in rounds if t0 > dropped]
    assert not [t0 for t0, _ in rounds if t0 > noticed]  # no round began once the server saw the client go
    assert len(started_after) <= 1 and freed - dropped < 1.0, (len(started_after), freed - dropped)
    print(f"\ndropped stream: server noticed after {1000 * (noticed - dropped):.1f} ms, {len(started_after)} round "
          f"begun after the drop, model free {1000 * (freed - dropped):.0f} ms after it "
          f"({len(rounds)} rounds run)")  # fmt: skip
    with pytest.raises(openai.APITimeoutError):  # a non-streamed one whose client gives up mid-reply
        client(url, timeout=0.3).chat.completions.create(model="tiny", messages=user("w36 w37 w38"), temperature=0,
                                                         max_tokens=400)  # fmt: skip
    wait_for(lambda: idle(engine) and "ended" in api.runs[-1], timeout=10, what="the model to be freed")
    assert api.runs[-1]["status"] == "dropped" and api.runs[-1]["timings"]["predicted_n"] < 400
    monkeypatch.undo()
    assert served(url)


def test_a_queued_request_dropped_before_its_turn_never_runs(server, gate):
    engine, api, url, log = server
    c = client(url, timeout=120)
    gate.close()
    holder = threading.Thread(target=lambda: c.chat.completions.create(model="tiny", messages=user("w41"),
                                                                       max_tokens=4))  # fmt: skip
    holder.start()
    wait_for(engine.queue.locked, what="the first request to hold the model")
    stream = c.chat.completions.create(model="tiny", messages=user("w42 w43"), max_tokens=4, stream=True)
    next(iter(stream))  # the role chunk: the request is in the queue
    assert engine.queue.waiting() == 1
    stream.close()
    wait_for(lambda: engine.queue.waiting() == 0, timeout=5, what="the stream's place to be given up")
    with pytest.raises(openai.APITimeoutError):  # a non-streamed one whose client gives up waiting
        client(url, timeout=0.5).chat.completions.create(model="tiny", messages=user("w44 w45"), max_tokens=4)
    wait_for(lambda: engine.queue.waiting() == 0, timeout=5, what="the timed-out request's place to be given up")
    gate.open()
    holder.join(timeout=60)
    wait_for(lambda: idle(engine), what="the model to be free")
    assert [r["status"] for r in list(api.runs)[-3:]] == ["done", "withdrawn", "withdrawn"]
    prompts = log.prompts()
    assert chat_ids(engine, "w41") in prompts
    assert chat_ids(engine, "w42 w43") not in prompts and chat_ids(engine, "w44 w45") not in prompts
    assert served(url)


def test_a_full_queue_answers_503_with_retry_after(server, gate, monkeypatch):
    engine, api, url, _ = server
    monkeypatch.setattr(engine.queue, "max_waiting", 1)
    c = client(url, timeout=120)
    gate.close()

    def ask(m):
        c.chat.completions.create(model="tiny", messages=user(m), max_tokens=2)

    asks = [threading.Thread(target=ask, args=(m,)) for m in ("w1", "w2")]
    asks[0].start()
    wait_for(engine.queue.locked, what="the first request to hold the model")
    asks[1].start()
    wait_for(lambda: engine.queue.waiting() == 1, what="the second request to wait")
    r = httpx.post(url + "/v1/chat/completions", json=GOOD, timeout=60)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "queue_full" and "queue is full" in r.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError) as e:
        c.chat.completions.create(model="tiny", messages=user("w3"), max_tokens=2)
    assert e.value.status_code == 503
    gate.open()
    for t in asks:
        t.join(timeout=60)
    wait_for(lambda: idle(engine), what="the model to be free")
    assert served(url)


def test_the_page_and_the_api_share_one_queue_in_arrival_order(server, gate):
    engine, api, url, log = server
    c, start = client(url, timeout=120), len(log.calls)
    gate.close()
    first = threading.Thread(target=lambda: c.chat.completions.create(model="tiny", messages=user("w46"),
                                                                      temperature=0, max_tokens=4))  # fmt: skip
    first.start()
    wait_for(engine.queue.locked, what="the API request to hold the model")
    page = Client(url, verbose=False).submit("w47 w46", max_new_tokens=6, api_name="/chat")
    wait_for(lambda: engine.queue.waiting() == 1, what="the page's reply to queue")
    last: list = []
    after = threading.Thread(target=lambda: last.append(c.chat.completions.create(
        model="tiny", messages=user("w45"), temperature=0, max_tokens=4)))  # fmt: skip
    after.start()
    wait_for(lambda: engine.queue.waiting() == 2, what="the second API request to queue")
    gate.open()
    first.join(timeout=60)
    after.join(timeout=60)
    assert page.result(timeout=60)[1] == greedy_reply(engine, [("w47 w46", None)], 6)
    order = log.prompts()[start : start + 3]
    assert order == [chat_ids(engine, p) for p in ("w46", "w47 w46", "w45")]
    assert last[0].choices[0].message.content == greedy_reply(engine, [("w45", None)], 4)


def test_a_conversations_next_request_reads_the_last_ones_rows_and_answers_as_a_cold_start(server):
    engine, api, url, _ = server
    c = client(url)
    first = c.chat.completions.create(model="tiny", messages=user("w4 w9 w2"), temperature=0, max_tokens=12)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    follow = [*user("w4 w9 w2"), {"role": "assistant", "content": first.choices[0].message.content},
              *user("w5 w5")]  # fmt: skip
    second = c.chat.completions.create(model="tiny", messages=follow, temperature=0, max_tokens=12)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and second.timings["cache_n"] == cached
    assert second.timings["prompt_n"] == second.usage.prompt_tokens - cached
    turns = [("w4 w9 w2", first.choices[0].message.content), ("w5 w5", None)]
    assert second.choices[0].message.content == greedy_reply(engine, turns, 12, engine.default_system)
