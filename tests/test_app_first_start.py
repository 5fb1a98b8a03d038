"""The embedded default started fresh, as a new user meets it (minutes of CPU: marked slow): replies asked during the
compile and after it decode at idle speed, every default speedup is against vanilla on the same forwards and close
to the prompt's measured one, and the compiled rounds come in, decided on an idle machine. The times to compiled
rounds are printed (docs/benchmarks.md, "The app's first and second start"), not asserted: they are the machine's."""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short poem about the sea, then explain its imagery."
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class App:
    """`python launch.py` in a process of its own, its output collected."""

    def __init__(self, cache: Path, port: int):
        env = dict(os.environ, EAGLE_CACHE=str(cache), GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
        self.lines: list[tuple[float, str]] = []
        self.started = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "launch.py", "--port", str(port)], cwd=ROOT, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait_for(self, pattern: str, timeout: float) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for t, line in list(self.lines):
                if re.search(pattern, line):
                    return t
            assert self.process.poll() is None, "\n".join(line for _, line in self.lines[-30:])
            time.sleep(1)
        raise AssertionError(f"no {pattern!r} in {timeout} s:\n" + "\n".join(line for _, line in self.lines[-30:]))

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def ask(client, **kw) -> dict:
    """The reply's final figures, with `idle_vanilla_tokens_per_s`: the vanilla figure of the update that completed
    its text (vanilla timed while idle, over the reply's length and prefill), before the final one's."""
    job = client.submit(PROMPT, max_new_tokens=128, api_name="/chat", **kw)
    *_, figures = job.result()
    streamed = [out[2] for out in job.outputs()[:-1]]
    figures["idle_vanilla_tokens_per_s"] = streamed[-1]["vanilla_tokens_per_s"] if streamed else None
    return figures


def check_pairs(client, forwards: str, per_reply: bool = True, medians: float = 0.2, rerun: float = 0.9,
                pairs: int = 3) -> None:  # fmt: skip
    """The default figure (this prompt's vanilla timed for 32 tokens right after the reply), `pairs` times, against
    the prompt's measured speedup: the same prompt asked again with its whole reply decoded again without EAGLE, as
    many times, the median of those reruns. Each shown figure within 20% of it (`per_reply`), the shown figures'
    median within `medians`, and the reruns' vanilla at least `rerun` x the idle reference's. The measured side is a
    median because one rerun is a sample of the machine's speed as much as the shown figure is: on a 2-core VM the
    same prompt's measured speedup moves by a fifth between reruns minutes apart
    (docs/history/2026-11-28-session-60-zen3-two-node-round.md), which says nothing of the figure the page showed. Looser while a
    compile is under way: then replies swing by a fifth to a third between runs seconds apart, EAGLE's as much as
    vanilla's (docs/history/2026-11-27-session-47-reply-speedup-check.md), so one run's figure cannot match
    another run's that closely."""
    deadline = time.monotonic() + 300
    while not ask(client)["speedup"]:  # until a reply ends with a figure (its check on these forwards)
        assert time.monotonic() < deadline, "no vanilla reference after 300 s"
        time.sleep(5)
    shown, measured = [], []
    for _ in range(pairs):
        shown.append(ask(client))
        measured.append(ask(client, time_vanilla=True))
        print(f"{forwards}: shown {shown[-1]['speedup']}x (EAGLE {shown[-1]['tokens_per_s']}, vanilla checked "
              f"{shown[-1]['vanilla_tokens_per_s']} tokens/s, timed while idle "
              f"{shown[-1]['idle_vanilla_tokens_per_s']}), measured {measured[-1]['speedup']}x (EAGLE "
              f"{measured[-1]['tokens_per_s']}, vanilla rerun {measured[-1]['vanilla_tokens_per_s']})")  # fmt: skip
    assert {f["forwards"] for f in shown + measured} == {forwards}
    assert all(f["vanilla_source"].startswith("this prompt decoded without EAGLE for 32 tokens") for f in shown)
    x_shown = statistics.median(f["speedup"] for f in shown)
    x_measured = statistics.median(f["speedup"] for f in measured)  # the prompt's measured speedup
    for s in shown:
        assert s["speedup"] >= 1.0, s
        assert not per_reply or abs(s["speedup"] / x_measured - 1) <= 0.2, (s["speedup"], x_measured)
    assert x_shown >= 1.0 and abs(x_shown / x_measured - 1) <= medians, (x_shown, x_measured)
    # a vanilla run during a reply decodes as fast as the idle reference says: nothing runs beside a reply
    again = statistics.median(f["vanilla_tokens_per_s"] for f in measured)
    idle = statistics.median(f["idle_vanilla_tokens_per_s"] for f in shown if f["idle_vanilla_tokens_per_s"])
    assert again >= rerun * idle, (again, idle)


def test_first_and_second_start_of_the_default(tmp_path):
    from gradio_client import Client

    cache = tmp_path / "cache"
    cache.mkdir()
    models = Path(os.environ.get("EAGLE_CACHE") or Path.home() / ".cache" / "eagle") / "models"
    if models.is_dir():  # the converted base model only: every timing, kernel and graph starts fresh
        (cache / "models").symlink_to(models)
    port = free_port()
    app = App(cache, port)
    try:
        up = app.wait_for(r"EAGLE chat ready", 900)
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        assert any("compiling" in line for _, line in app.lines)
        check_pairs(client, "eager", per_reply=False, medians=0.3, rerun=0.75)  # during the compile
        in_use = app.wait_for(r"compiled rounds in use", 900)
        print(f"first start: page up {up - app.started:.0f} s after launch, compiled rounds in use "
              f"{in_use - up:.0f} s after that")  # fmt: skip
        check_pairs(client, "compiled", per_reply=False)  # the tuned tree and context rounds still compiling
        done = app.wait_for(r"rounds with context drafts in compiled steps in use", 900)
        print(f"first start: the last compiled rounds in use {done - up:.0f} s after the page")
        check_pairs(client, "compiled")  # nothing left to compile
        verdicts = list((cache / "compiled").glob("*-verdict.json"))
        unsaved = any("another process used the CPU" in line or "no steady timing" in line for _, line in app.lines)
        assert unsaved or (len(verdicts) == 1 and json.loads(verdicts[0].read_text())["compiled_pays"])
    finally:
        app.close()
        print("\n".join(line for _, line in app.lines if line.startswith("[compile]")))

    port = free_port()
    second = App(cache, port)  # everything cached: the graphs load from the cache, nothing is measured again
    try:
        up = second.wait_for(r"EAGLE chat ready", 300)
        in_use = second.wait_for(r"compiled rounds in use", 300)
        assert not any("compiling" in line for _, line in second.lines)
        print(f"second start: page up {up - second.started:.0f} s after launch, compiled rounds in use "
              f"{in_use - up:.0f} s after that")
        print("\n".join(line for _, line in second.lines if line.startswith("[compile]")))
    finally:
        second.close()
