"""What keeps the app's UI from costing the model speed (issue #13: the app's live speed equals the bench's), and
the tool that measures it, `python -m app.speed_check`.

- a reply's page updates are bounded by time (at most ~4 per second), not one per round of the model;
- an update renders only the reply's new piece: the markdown parsed per update does not grow with the reply
  or with the conversation before it;
- the tool's table (rates, ratios, same-text counts, a busy machine named), and the tool itself on a tiny model
  in headless Chromium (skipped without chromium / selenium).

No speed figure is asserted here: docs/benchmarks.md has the measurement.
"""

from __future__ import annotations

import os
import time

import pytest
from app_fixtures import ModelFreeEngine, one_thread, tiny_engine

from app import markdown_render, speed_check
from app.handlers import UPDATE_EVERY_S, chat_messages, make_handlers, new_state, new_turn
from eagle.chat.templates import FittedPrompt
from eagle.decoding.generate import Round

pytestmark = pytest.mark.filterwarnings("ignore:.*no_silent_downcasting", "ignore:The copy keyword")
MAX_UPDATES_PER_S = 5  # the bound pinned here; the handlers' own is 1 / UPDATE_EVERY_S = 4


class WordsTokenizer:
    """Token i decodes to word i of a long markdown text."""

    def __init__(self, words: list[str]):
        self.words = words

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(self.words[i] for i in ids)


def markdown_words(n: int) -> list[str]:
    para = "Some **bold** words and `code` in a sentence that goes on for a while, then a list:\n\n- one\n- two\n\n"
    words = []
    while len(words) < n:
        words += [w + " " for w in para.split(" ")]
    return words[:n]


class FastEngine(ModelFreeEngine):
    """An Engine without a model: `rounds` rounds of 3 tokens (2 of them drafted), `round_s` seconds each."""

    name, template, max_length = "fast", "fast", 1 << 20

    def __init__(self, rounds: int, round_s: float):
        super().__init__()
        self.info = {"model_type": "fast"}
        self.n, self.round_s = rounds, round_s
        self.tokenizer = WordsTokenizer(markdown_words(3 * rounds))

    def fit(self, turns, system, max_new_tokens):
        return FittedPrompt(ids=[0], dropped=0)

    def rounds(self, ids, eagle=True, max_new_tokens=512, **_):
        for i in range(self.n):
            time.sleep(self.round_s)
            yield Round([3 * i, 3 * i + 1, 3 * i + 2], 2, self.round_s, "max_new_tokens" if i == self.n - 1 else None)


SETTINGS = (0.0, 1.0, 0, 4096, True, True, False, "")  # temperature .. system_prompt, as the page sends them


def test_page_updates_are_bounded_by_time_not_rounds():
    rounds = 400  # ~0.8 s of 2 ms rounds: 400 rounds, but only a few page updates
    h = make_handlers(FastEngine(rounds, 0.002))
    state = new_state()
    state["turns"].append(new_turn("hi", state["epoch"]))
    start = time.monotonic()
    updates = list(h["bot"](state, *SETTINGS))
    elapsed = time.monotonic() - start
    assert len(updates) <= elapsed * MAX_UPDATES_PER_S + 2  # + the first and the last
    assert len(updates) <= elapsed / UPDATE_EVERY_S + 2
    assert len(updates) >= 2  # the first tokens show at once, the last update is never dropped
    assert state["turns"][-1]["reply"] == "".join(markdown_words(3 * rounds))
    assert "generating" not in updates[-1][1]  # the final figures

    start = time.monotonic()
    compare = list(h["run_compare"]("hi", state, *SETTINGS))  # the side-by-side tab: two runs, same bound
    assert 2 <= len(compare) <= (time.monotonic() - start) * MAX_UPDATES_PER_S + 2


def test_an_update_parses_only_the_new_piece_of_the_reply(monkeypatch):
    """chat_messages on every update of a long reply after a long conversation: the markdown parsed per update
    stays bounded (the last piece), whatever the length of the reply and of the turns before it."""
    parsed: list[int] = []
    parse = markdown_render.MD.parse
    monkeypatch.setattr(markdown_render.MD, "parse", lambda text, *a: parsed.append(len(text)) or parse(text, *a))
    words = markdown_words(4000)  # ~20k characters
    text = "".join(words)
    state = new_state()
    for i in range(6):  # earlier turns, whole replies
        state["turns"].append({**new_turn(f"q{i}", 0), "reply": text[i:], "marks": [[0, 40]]})
    chat_messages(state)
    turn = new_turn("last", 0)
    state["turns"].append(turn)
    per_update = []
    for n in range(50, len(words), 50):  # the reply grows as it streams
        turn["reply"] = "".join(words[:n])
        turn["marks"] = [[k, k + 3] for k in range(0, len(turn["reply"]), 7)]
        parsed.clear()
        chat_messages(state)
        per_update.append(sum(parsed))
    bound = 2 * markdown_render.MIN_PIECE + 400  # a piece: at least MIN_PIECE, cut at the next blank line
    assert max(per_update) <= bound, per_update
    assert len(turn["reply"]) > 10 * bound  # the whole reply would be far more


def test_summary_and_table():
    def rec(method, bench_s, page_s, shown_tps, same_text=True, others=0.0):
        cpu = {"model": 1.0, "server": 0.1, "browser": 0.3, "others": others, "wall": page_s + 0.5}
        return {"method": method, "bench_tokens": 100, "bench_s": bench_s, "app_tokens": 100, "page_s": page_s,
                "shown_s": 100 / shown_tps, "updates": 20, "same_ids": True, "same_text": same_text,
                "cpu_s": cpu, "bench_cpu_s": {**cpu, "wall": bench_s}}  # fmt: skip

    records = [rec("eagle", 4.0, 5.0, 22.0), rec("eagle", 4.0, 4.0, 25.0, same_text=False),
               rec("vanilla", 5.0, 5.0, 20.0), rec("vanilla", 5.0, 6.0, 20.0)]  # fmt: skip
    s = speed_check.summarize(records)
    e, v = s["eagle"], s["vanilla"]
    assert e["bench_tokens_per_s"] == pytest.approx(25.0) and e["page_tokens_per_s"] == pytest.approx(200 / 9)
    assert e["page_vs_bench"] == pytest.approx(200 / 9 / 25) and v["page_vs_bench"] == pytest.approx(20 / 11 / 2)
    assert e["shown_tokens_per_s"] == pytest.approx(200 / (100 / 22 + 4))
    assert e["bench_speedup"] == pytest.approx(25 / 20) and e["same_text"] == 1 and v["same_text"] == 2
    assert e["browser_cpu_s_per_reply"] == pytest.approx(0.3) and e["others_cores"] == 0.0
    table = speed_check.table(s)
    assert "| eagle | 25.0 | 22.2 |" in table and "0.89x" in table and "1/2" in table and "(quiet)" in table
    busy = speed_check.table(speed_check.summarize([rec("eagle", 4.0, 5.0, 22.0, others=2.0)]))
    assert "busy machine" in busy
    disturbed = {**rec("eagle", 4.0, 40.0, 2.0, others=9.0), "busy": True}  # measured again, still disturbed
    s2 = speed_check.summarize([*records, disturbed])
    assert s2["eagle"]["page_tokens_per_s"] == pytest.approx(200 / 9) and s2["eagle"]["busy_left_out"] == 1
    assert "1 replies measured while other programs used more than" in speed_check.table(s2)
    assert speed_check.number("23.45 tokens/s") == 23.45 and speed_check.number("–") is None
    assert speed_check.squeeze("a b\n\nc") == "abc"


@pytest.mark.skipif(not (os.path.exists(speed_check.CHROMIUM) and os.path.exists(speed_check.DRIVER)),
                    reason="chromium / chromedriver absent: apt-get install -y chromium chromium-driver")  # fmt: skip
def test_the_tool_on_a_tiny_model_in_chromium(tmp_path):
    pytest.importorskip("selenium.webdriver", reason="selenium not installed")
    from app import handlers

    with one_thread():
        engine = tiny_engine(str(tmp_path), max_length=256)
        questions = [{"question_id": 7, "turns": ["w7 w8 w9"]}, {"question_id": 8, "turns": ["w20\nw21"]}]
        out = speed_check.measure(engine, questions, 24, lambda _: None, warmup=0, update_every=[0.25, 1.0],
                                retries=0)  # fmt: skip
    assert handlers.UPDATE_EVERY_S == UPDATE_EVERY_S  # put back
    records = out["records"]
    labels = ["eagle, updates every 0.25 s", "eagle, updates every 1 s", "vanilla, updates every 0.25 s",
              "vanilla, updates every 1 s"]  # fmt: skip
    assert [(r["question_id"], r["method"]) for r in records] == [(q, m) for q in (7, 8) for m in labels]
    for r in records:
        assert r["same_prompt"] and r["same_ids"] and r["same_text"], r  # greedy: the page shows the bench's text
        assert r["app_tokens"] == r["bench_tokens"] == r["shown_new_tokens"] and r["page_s"] > 0
        assert 1 <= r["updates"] and r["shown_tokens_per_s"] > 0
        assert r["cpu_s"]["browser"] > 0, r  # Chromium renders every reply: its processes are found and counted
    assert list(out["summary"]) == labels
