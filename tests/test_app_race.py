"""The side-by-side race (app/race.py): each run's timeline recorded by `compare`, the playback frames, and the
handlers that play and replay it without the model."""

from __future__ import annotations

import time

import pytest
from app_fixtures import ScriptedEngine, greedy_reply, one_thread, tiny_engine

from app.handlers import make_handlers, new_state
from app.highlight import plain_text, render
from app.race import Lane, Race, pane_html, parse_speed
from app.session import Settings, compare

RAW = (0.0, 1.0, 0, 16, True, True, False, "")  # the page's settings: temperature .. system prompt


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with one_thread():
        yield tiny_engine(str(tmp_path_factory.mktemp("app_race")), max_length=96)


def toy_race() -> Race:
    """Vanilla: 10 tokens, one a round, 0.1 s apart. EAGLE: the same reply in 3 rounds, done at 0.45 s."""
    text = "".join(f"w{i} " for i in range(10))  # 3 characters a token
    vanilla = Lane(text, [], [[0.1 * (i + 1), 3 * (i + 1), i + 1] for i in range(10)], 10.0)
    eagle = Lane(text, [[0, 6], [12, 18], [21, 27]], [[0.15, 9, 3], [0.3, 18, 6], [0.45, 30, 10]], 22.22)
    return Race(vanilla, eagle, {"speedup": 2.22, "same_text": True})


# the timeline that compare records ------------------------------------------------------------------------
def test_compare_records_each_runs_timeline(engine):
    last = list(compare(engine, "w10 w11", Settings(max_new_tokens=16)))[-1]
    assert last.done and last.summary["same_text"] is True
    for pane in (last.vanilla, last.eagle):
        times = [p[0] for p in pane.timeline]
        chars = [p[1] for p in pane.timeline]
        assert len(pane.timeline) == pane.figures["rounds"]  # a point per round
        assert times == sorted(times) and chars == sorted(chars)
        assert pane.timeline[-1] == [pane.figures["elapsed_s"], len(pane.text), pane.figures["new_tokens"]]
        assert pane.text == greedy_reply(engine, [("w10 w11", None)], 16)


def test_timeline_points_are_the_rounds_summed_seconds():
    engine = ScriptedEngine([["Hello", " there", ","], [" friend", "."]])  # 0.05 s a round
    last = list(compare(engine, "hi", Settings()))[-1]
    assert last.vanilla.timeline == [[0.05, 5, 1], [0.1, 11, 2], [0.15, 12, 3], [0.2, 19, 4], [0.25, 20, 5]]
    assert last.eagle.timeline == [[0.05, 12, 3], [0.1, 20, 5]]  # a round's tokens appear together
    race = Race.from_comparison(last)
    assert race.eagle.marks == [[0, 11], [12, 19]] and race.summary["speedup"] == 2.5
    assert race.frames()[-1].speedup == 2.5 and race.frames()[-1].at == 0.25


def test_a_stopped_comparison_leaves_no_race(engine):
    calls = []
    stop = lambda: calls.append(1) or len(calls) > 3  # noqa: E731
    steps = list(compare(engine, "w10 w11", Settings(max_new_tokens=16), stop=stop))
    assert Race.from_comparison(steps[-1]) is None


# the frames ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("speed", [1.0, 2.0, 0.5])
def test_frames_show_prefixes_in_time_order_and_finish_at_the_measured_times(speed):
    race = toy_race()
    frames = race.frames(fps=8, speed=speed)
    assert frames[0].at == 0 and frames[0].vanilla.chars == frames[0].eagle.chars == 0
    assert [f.at for f in frames] == sorted(f.at for f in frames)
    for lane, name in ((race.vanilla, "vanilla"), (race.eagle, "eagle")):
        states = [getattr(f, name) for f in frames]
        assert [s.chars for s in states] == sorted(s.chars for s in states)  # the reply only grows
        assert all((s.chars, s.tokens) in {(p[1], p[2]) for p in lane.timeline} | {(0, 0)} for s in states)
        finish = next(f for f in frames if getattr(f, name).done)
        assert finish.at == pytest.approx(lane.elapsed / speed)  # its own measured time, scaled
        assert getattr(finish, name).chars == len(lane.text) and getattr(finish, name).tokens_per_s == lane.tokens_per_s
        before = [s for f, s in zip(frames, states) if f.at < finish.at]
        assert all(s.t <= f.at * speed for f, s in zip(frames, states))  # nothing shown before it was produced
        assert not any(s.done for s in before)
    assert all(f.speedup is None for f in frames[:-1])
    assert frames[-1].finished and frames[-1].speedup == race.summary["speedup"]  # the final ratio
    seconds = [int(f.at) for f in frames]
    assert max(seconds.count(s) for s in set(seconds)) <= 8 + 2  # at most fps a second, plus the two finishes


def test_running_counter_is_tokens_over_time_then_the_runs_figure():
    race = toy_race()
    s = race.eagle.at(0.35)  # after the second round
    assert (s.chars, s.tokens, s.t, s.done) == (18, 6, 0.3, False) and s.tokens_per_s == pytest.approx(20.0)
    assert race.eagle.at(0.1).tokens_per_s is None and race.eagle.at(1.0).tokens_per_s == 22.22


def test_pane_html_renders_the_prefix_with_its_highlights_and_a_counter():
    race = toy_race()
    s = race.eagle.at(0.3)
    out = pane_html(race.eagle, s)
    assert out.startswith(render(race.eagle.text[:18], [[0, 6], [12, 18]], True))
    assert plain_text(out).startswith(race.eagle.text[:18].strip())
    assert out.count('class="acc"') == 2 and "20.0</b> tokens/s · 6 tokens · 0.30 s" in out
    hostile = Lane("<img src=x onerror=alert(1)> **b**", [], [[0.1, 34, 5]], 50.0)
    assert "<img" not in pane_html(hostile, hostile.at(1.0))  # sanitised like the chat


def test_race_round_trips_as_plain_data_and_speed_is_parsed():
    race = toy_race()
    assert Race.from_dict(race.as_dict()) == race
    assert [parse_speed(v) for v in (2, "4", None, "x", float("nan"), 0, 100)] == [2.0, 4.0, 1.0, 1.0, 1.0, 0.1, 10.0]


# the handlers ----------------------------------------------------------------------------------------------
def test_race_plays_at_the_measured_pace_and_replay_needs_no_model(engine, monkeypatch):
    h = make_handlers(engine)
    state = h["start_compare"](new_state())
    outs = list(h["run_compare"]("w12 w13", state, *RAW))
    assert state["race"] and plain_text(outs[-1][0]) == plain_text(outs[-1][2])
    race = Race.from_dict(state["race"])

    def played(fn, speed):
        start, out = time.monotonic(), []
        for item in fn(state, speed):
            out.append((time.monotonic() - start, item))
        return out

    first = played(h["play_race"], 4.0)
    frames = race.frames(8, 4.0)
    assert len(first) == len(frames)
    assert all(when >= f.at - 1e-3 for (when, _), f in zip(first, frames))  # each frame no sooner than its time
    v_html, e_html, status = first[-1][1]
    assert plain_text(v_html).startswith(plain_text(outs[-1][0]))  # the whole replies at the end
    assert plain_text(e_html).startswith(plain_text(outs[-1][2]))
    assert f"{race.summary['speedup']:.2f}×" in status and "🏁" in status

    def no_model(*a, **k):
        raise AssertionError("Replay decoded again")

    monkeypatch.setattr(engine, "rounds", no_model)
    again = played(h["replay"], 4.0)
    assert [item for _, item in again] == [item for _, item in first]


def test_a_new_run_ends_the_race_playing(engine):
    h = make_handlers(engine)
    state = h["start_compare"](new_state())
    list(h["run_compare"]("w12 w13", state, *RAW))
    player = h["play_race"](state, 0.1)  # slow: many frames
    next(player)
    h["start_compare"](state)  # the next run's click
    assert list(player) == [] and state["race"] is None
    assert list(h["play_race"](state, 1.0)) == []  # nothing to play until that run finishes
