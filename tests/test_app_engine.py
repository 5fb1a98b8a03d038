"""The engine's model thread (`Engine.serve_model_calls`, as launch.py runs it): a reply's rounds are produced there
without waiting for the reader, idle work runs between replies, and a reply goes first."""

import threading
import time

import pytest
from app_fixtures import tiny_engine


@pytest.fixture
def served(tmp_path):
    """A tiny engine whose model calls run on a thread of their own, as launch.py's main thread runs them."""
    engine = tiny_engine(str(tmp_path))
    thread = threading.Thread(target=engine.serve_model_calls, kwargs={"poll_s": 0.05}, daemon=True)
    thread.start()
    while engine._calls is None:
        time.sleep(0.01)
    yield engine
    engine.stop_serving()
    thread.join(timeout=30)


def test_a_reply_from_the_model_thread_is_the_reply_made_here(served, tmp_path):
    ids = served.prompt_ids([("w7 w8 w9", None)])
    here = tiny_engine(str(tmp_path / "here"))  # the same weights (the same seeds), no model thread
    for eagle in (True, False):
        got = [(r.tokens, r.accepted) for r in served.rounds(ids, eagle=eagle, max_new_tokens=24)]
        want = [(r.tokens, r.accepted) for r in here.rounds(ids, eagle=eagle, max_new_tokens=24)]
        assert got == want


def test_closing_a_reply_early_frees_the_model_after_the_round_in_progress(served):
    ids = served.prompt_ids([("w7 w8 w9", None)])
    reply = served.rounds(ids, eagle=False, max_new_tokens=200)
    first = next(reply)
    reply.close()
    assert first.tokens and not served._lock.locked()
    assert len([r for r in served.rounds(ids, eagle=False, max_new_tokens=3)]) == 3  # the model is free again


def test_idle_work_runs_between_replies_on_the_model_thread_and_a_reply_goes_first(served):
    ran, threads = [], set()

    def job():
        for i in range(20):
            yield f"unit {i}"
            threads.add(threading.current_thread())
            ran.append(i)
            time.sleep(0.05)

    served.add_job(job())
    while not ran:
        time.sleep(0.01)
    assert threads == {served._server_thread}
    before = len(ran)
    t0 = time.monotonic()
    tokens = [t for r in served.rounds(served.prompt_ids([("w7", None)]), max_new_tokens=8) for t in r.tokens]
    assert tokens and time.monotonic() - t0 < 5  # waited for one unit at most, not for the job's 20
    assert len(ran) < 20 and len(ran) - before <= 2
    deadline = time.monotonic() + 30
    while served.jobs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ran == list(range(20))
