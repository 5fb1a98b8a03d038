"""The chat app's live speed against the bench's, on the same prompts in one run.

    python -m app.speed_check                                # 6 MT-bench first turns, 128 new tokens
    python -m app.speed_check --prompts 8 --max-new-tokens 256 --json out/app_speed.json
    python -m app.speed_check --update-every 0.05,0.25       # two page update rates, in the same run

One process: the model is loaded once as `launch.py` loads it (app.cli: the app's default tree, dtype, draft
dtype, compile mode and warm-up), the real app is served on it in-process, and a headless Chromium page chats
with it. For every prompt (MT-bench first turns with the app's chat template and system prompt, context cleared
before each) and each method (`eagle`, then `vanilla` = the page's "EAGLE on" box unticked), the bench's runner
(eagle/evaluation/methods.py) and the page answer the same prompt ids with the same max_new_tokens, interleaved
(who goes first rotates per prompt), after one untimed warm-up each. Every model call runs on the main thread, as
in launch.py (`Engine.serve_model_calls`).

- bench tokens/s = Σ new tokens / Σ wall time of the runner's call (prefill included), as the bench counts;
- page tokens/s = Σ new tokens / Σ (the reply's last change on the page − the click on Send), timed in the page
  (`performance.now()` in a MutationObserver; the figures of an EAGLE reply come a moment later, after its vanilla
  check, and are not counted), so it pays for everything between the model and the pixels:
  the queue, the handlers' rendering, the server's threads, Gradio's streaming and the browser's own work
  (on this machine: Chromium renders on the same cores as the model);
- shown tokens/s = Σ new tokens / Σ decoding time the page's figures panel shows (the app's own figure).

At T=0 the app's token ids (taken from the engine as it runs) must equal the bench's, and the reply's text in the
page (whitespace aside) must equal the bench's text rendered by the app: both are checked and counted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000", "--force-device-scale-factor=1"]  # fmt: skip
METHODS = ("eagle", "vanilla")
SETTLE_MS = 400  # after the final figures appear, the page's last changes within this window still count
WAIT_S = 30  # one WebDriver call waits this long at most (its HTTP client gives up at 120 s)
BUSY_CORES = 0.2  # other programs using more than this (in cores, on average) disturb a measurement

# Sends the message already in the box and times the page until the figures panel shows a final status: every
# change of #chat and #figures is timed (performance.now()); `end` = the reply's last change on the page. The
# result waits in window.__appSpeed for WAIT_JS.
SEND_JS = r"""
const settleMs = arguments[0];
const chat = document.querySelector('#chat'), figs = document.querySelector('#figures');
const status = () => (figs.querySelector('.fig-status') || {}).textContent || '';
const bots = () => chat.querySelectorAll('.message.bot .eagle-tokens, .bot .eagle-tokens');
const reply = () => { const b = bots(); return b.length ? b[b.length - 1].textContent : ''; };
const run = window.__appSpeed = {updates: 0, shown: '', textAt: 0, finalAt: 0, result: null, waiter: null};
const finish = () => {
  obs.disconnect();
  const b = bots();
  const row = (name) => Array.from(figs.querySelectorAll('tr')).map(tr => tr.innerText.split('\t'))
      .find(c => c[0].trim() === name);
  run.result = {start: run.t0, end: run.textAt, final_at: run.finalAt, updates: run.updates,
                text: b.length ? b[b.length - 1].innerText : '', bots: b.length,
                shown_tokens_per_s: (figs.querySelector('.fig-big') || {}).innerText || '',
                new_tokens: (row('new tokens') || [])[1] || '', status: status(), figures: figs.innerText};
  if (run.waiter) run.waiter(run.result);
};
const obs = new MutationObserver(() => {
  const now = performance.now(), text = reply();
  if (text !== run.shown) { run.updates += 1; run.shown = text; run.textAt = now; }  // a new state of the reply
  const s = status();
  if (!run.finalAt && s && !s.includes('generating')) {
    run.finalAt = now;
    setTimeout(finish, settleMs);
  }
});
obs.observe(chat, {subtree: true, childList: true, characterData: true});
obs.observe(figs, {subtree: true, childList: true, characterData: true});
run.t0 = performance.now();
document.querySelector('#send').click();
"""

# Resolves with the run's result once there is one, or with null after arguments[0] ms (then ask again).
WAIT_JS = r"""
const [waitMs, done] = [arguments[0], arguments[arguments.length - 1]];
const run = window.__appSpeed;
if (run.result) { done(run.result); } else {
  run.waiter = done;
  setTimeout(() => { if (run.waiter === done) { run.waiter = null; done(null); } }, waitMs);
}
"""

SET_MESSAGE_JS = r"""
const box = document.querySelector('#msg textarea');
Object.getOwnPropertyDescriptor(HTMLTextAreaElement.prototype, 'value').set.call(box, arguments[0]);
box.dispatchEvent(new Event('input', {bubbles: true}));
"""


# ---------------------------------------------------------------------------------------------------------
def number(text: str) -> float | None:
    m = re.search(r"-?\d+(?:\.\d+)?", text or "")
    return float(m.group()) if m else None


def squeeze(text: str) -> str:
    """`text` without whitespace: the page's innerText lays blocks out with its own line breaks."""
    return re.sub(r"\s+", "", text)


def summarize(records: list[dict]) -> dict:
    """Per method, over the records (one per prompt and method: bench_tokens, bench_s, app_tokens, page_s,
    shown_s, same_ids, same_text): the rates and the ratios app / bench."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in records):
        every = [r for r in records if r["method"] == method]
        rs = [r for r in every if not r.get("busy")] or every  # replies disturbed by other programs: left out
        bench = sum(r["bench_tokens"] for r in rs) / sum(r["bench_s"] for r in rs)
        page = sum(r["app_tokens"] for r in rs) / sum(r["page_s"] for r in rs)
        shown_s = [r["shown_s"] for r in rs]
        shown = sum(r["app_tokens"] for r in rs) / sum(shown_s) if all(shown_s) else None
        out[method] = {
            "prompts": len(rs), "busy_left_out": len(every) - len(rs), "new_tokens": sum(r["app_tokens"] for r in rs),
            "bench_tokens_per_s": bench, "page_tokens_per_s": page, "shown_tokens_per_s": shown,
            "page_vs_bench": page / bench, "shown_vs_bench": shown / bench if shown else None,
            "updates_per_reply": sum(r["updates"] for r in rs) / len(rs),
            "same_ids": sum(bool(r["same_ids"]) for r in rs), "same_text": sum(bool(r["same_text"]) for r in rs),
        }  # fmt: skip
        if all("cpu_s" in r for r in rs):  # CPU seconds per reply beside the model's thread: the UI's cost
            for part in ("server", "browser"):
                out[method][f"{part}_cpu_s_per_reply"] = sum(r["cpu_s"][part] for r in rs) / len(rs)
            # other programs' CPU (cores, on average) while the page and the bench ran: > 0.1 = a busy machine
            others = sum(r["cpu_s"]["others"] + r["bench_cpu_s"]["others"] for r in rs)
            out[method]["others_cores"] = others / sum(r["cpu_s"]["wall"] + r["bench_cpu_s"]["wall"] for r in rs)
    if "eagle" in out and "vanilla" in out:
        for key in ("bench", "page"):
            out["eagle"][f"{key}_speedup"] = out["eagle"][f"{key}_tokens_per_s"] / out["vanilla"][f"{key}_tokens_per_s"]
    return out


def table(summary: dict) -> str:
    """The summary as a markdown table."""
    f = lambda v, fmt="{:.1f}": "–" if v is None else fmt.format(v)  # noqa: E731
    head = ("| method | bench tokens/s | app tokens/s (page) | app's shown tokens/s | page / bench | shown / bench "
            "| page updates / reply | UI CPU s / reply (server, browser) | same ids / text |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method, m in summary.items():
        lines.append(f"| {method} | {f(m['bench_tokens_per_s'])} | {f(m['page_tokens_per_s'])} | "
                     f"{f(m['shown_tokens_per_s'])} | {f(m['page_vs_bench'], '{:.2f}x')} | "
                     f"{f(m['shown_vs_bench'], '{:.2f}x')} | {f(m['updates_per_reply'], '{:.0f}')} | "
                     f"{f(m.get('server_cpu_s_per_reply'), '{:.2f}')}, "
                     f"{f(m.get('browser_cpu_s_per_reply'), '{:.2f}')} | "
                     f"{m['same_ids']}/{m['prompts']}, {m['same_text']}/{m['prompts']} |")  # fmt: skip
    others = [m["others_cores"] for m in summary.values() if m.get("others_cores") is not None]
    if others:
        lines.append(f"\nOther programs on the machine meanwhile: {max(others):.2f} cores on average"
                     + (" (a busy machine: the figures are disturbed)" if max(others) > BUSY_CORES else " (quiet)"))
    left_out = sum(m.get("busy_left_out", 0) for m in summary.values())
    if left_out:
        lines.append(f"{left_out} replies measured while other programs used more than {BUSY_CORES} cores: left out")
    e = summary.get("eagle", {})
    if "bench_speedup" in e:
        lines.append(f"\nEAGLE / vanilla: bench {e['bench_speedup']:.2f}x, app (page) {e['page_speedup']:.2f}x")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
def _ticks(stat_path: str) -> int:
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0


def threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def cpu_seconds(model_threads: set[int]) -> dict:
    """CPU seconds so far: this process's model threads (the one serving model calls and torch's OpenMP
    workers: those that ran before the server started), its other threads (the server's), and each of the
    browser's processes (by pid: they come and go)."""
    hz = os.sysconf("SC_CLK_TCK")
    model = server = 0
    for tid in threads():
        t = _ticks(f"/proc/self/task/{tid}/stat")
        model, server = (model + t, server) if tid in model_threads else (model, server + t)
    browser = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                exe = f.read().replace(b"\0", b" ").split(b" ", 1)[0]  # Chromium rewrites its argv
        except OSError:
            continue
        if exe.endswith((b"chromium", b"chromedriver")):
            browser[pid] = _ticks(f"/proc/{pid}/stat") / hz
    with open("/proc/stat") as f:  # the machine's busy time: user nice system idle iowait irq softirq steal
        ticks = [int(x) for x in f.readline().split()[1:9]]
    machine = sum(ticks) - ticks[3] - ticks[4]
    return {"model": model / hz, "server": server / hz, "browser": browser, "machine": machine / hz,
            "wall": time.monotonic()}  # fmt: skip


def cpu_used(before: dict, after: dict) -> dict:
    """CPU seconds between two `cpu_seconds` (a browser process that ended in between is not counted);
    others = the rest of the machine's busy time: other programs (a busy machine)."""
    d = {k: after[k] - before[k] for k in ("model", "server", "machine", "wall")}
    d["browser"] = sum(t - before["browser"].get(pid, 0.0) for pid, t in after["browser"].items())
    d["others"] = max(0.0, d.pop("machine") - d["model"] - d["server"] - d["browser"])
    return d


def others_cores(cpu: dict) -> float:
    """Other programs' CPU use during a `cpu_used` window, in cores."""
    return cpu["others"] / cpu["wall"] if cpu["wall"] > 0 else 0.0


def wait_quiet(model_threads: set[int], log, limit_s: float, probe_s: float = 5.0) -> None:
    """Until other programs use at most BUSY_CORES over `probe_s` (or `limit_s` has passed)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = cpu_seconds(model_threads)
        time.sleep(probe_s)
        busy = others_cores(cpu_used(before, cpu_seconds(model_threads)))
        if busy <= BUSY_CORES:
            return
        log(f"  waiting for a quiet machine (other programs: {busy:.2f} cores)")


class Recorder:
    """Wraps `engine.rounds` to keep each generation's prompt ids and new token ids, as the app ran them."""

    def __init__(self, engine):
        self.runs: list[dict] = []
        inner = engine.rounds

        def rounds(ids, **kw):
            run = {"ids": list(ids), "eagle": kw.get("eagle", True), "tokens": [], "seconds": 0.0}
            self.runs.append(run)
            for r in inner(ids, **kw):
                run["tokens"] += r.tokens
                run["seconds"] += r.seconds
                yield r

        engine.rounds = rounds


class Page:
    """Headless Chromium on the app's page."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        from selenium import webdriver

        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        for flag in [*FLAGS, f"--user-data-dir={self.profile}"]:
            options.add_argument(flag)
        self.driver = webdriver.Chrome(service=webdriver.ChromeService(DRIVER), options=options)
        self.driver.set_script_timeout(WAIT_S + 30)
        self.timeout_s = timeout_s
        self.driver.get(url)
        self.wait("document.querySelector('#msg textarea') && document.querySelector('#send')")

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait(self, expr: str, timeout: float = 60.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if value := self.js(f"return ({expr});"):
                return value
            time.sleep(0.1)
        raise TimeoutError(f"the page did not get to: {expr}")

    def clear(self) -> None:
        self.js("document.querySelector('#clear').click();")
        self.wait("document.querySelectorAll('#chat .message').length == 0 "
                  "&& document.querySelector('#figures').innerText.includes('No reply yet')")  # fmt: skip

    def set_eagle(self, on: bool) -> None:
        box = "document.querySelector('#eagle input')"
        if self.js(f"return {box}.checked;") != on:
            self.js(f"{box}.click();")
        self.wait(f"{box}.checked == {str(on).lower()}")

    def ask(self, message: str) -> dict:
        """Send `message` in a cleared chat; the page's timings and what it shows once the reply is done."""
        self.clear()
        self.js(SET_MESSAGE_JS, message)
        time.sleep(0.3)  # the box's value reaches the page's state
        self.js(SEND_JS, SETTLE_MS)
        deadline = time.time() + self.timeout_s
        while time.time() < deadline:  # one call per WAIT_S: no polling next to the model
            if out := self.driver.execute_async_script(WAIT_JS, WAIT_S * 1000):
                return out
        figures = self.js("return document.querySelector('#figures').innerText;")
        raise TimeoutError(f"the reply did not finish in the page within {self.timeout_s:.0f} s: {figures!r}")

    def close(self) -> None:
        self.driver.quit()
        shutil.rmtree(self.profile, ignore_errors=True)


def load_app_engine(args, log):
    """The model and Engine exactly as `launch.py` builds them with these options (warm-up included)."""
    from app.cli import load_engine, parser

    argv = ["--model-type", args.model_type, "--compile", args.compile, "--draft-dtype", args.draft_dtype,
            "--dtype", args.dtype, "--weights", args.weights, "--max-new-tokens", str(args.max_new_tokens)]  # fmt: skip
    for key in ("total_token", "depth", "top_k", "base_model_path", "ea_model_path"):
        if getattr(args, key) is not None:
            argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    log("loading as: python launch.py " + " ".join(argv))
    return load_engine(parser().parse_args(argv))


def measure(engine, questions: list[dict], max_new_tokens: int, log, warmup: int = 1, methods=METHODS,
            update_every: list[float] | None = None, retries: int = 3, quiet_wait_s: float = 900.0,
            timeout_s: float = 600.0) -> dict:  # fmt: skip
    """Run the page and the bench's runners on `questions` (call from a thread other than the one that serves
    the model's calls, see `main`). `update_every`: the page's update intervals to measure (default: the app's,
    app.handlers.UPDATE_EVERY_S), each a row of its own. A prompt's measurements during which other programs
    used more than BUSY_CORES are taken again (up to `retries` times, each once the machine is quiet, waiting
    `quiet_wait_s` at most); still disturbed, they are marked busy and left out of the summary.
    Returns {"records": [...], "summary": {...}}."""
    import torch

    from app import handlers
    from app.highlight import plain_text, render
    from app.ui import build, launch_options
    from eagle.evaluation.methods import Settings, make_runners

    default_every = handlers.UPDATE_EVERY_S
    rates = list(update_every or [default_every])
    runners = make_runners(list(methods), engine.model, Settings(max_new_tokens, 0.0))
    on_model = engine._on_model_thread  # the thread that runs every model call (Engine.serve_model_calls)
    recorder = Recorder(engine)
    model_threads = threads() - {threading.get_native_id()}  # the model's, before the server adds its own
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    demo = build(engine, max_new_tokens=max_new_tokens)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **launch_options())
    page = None
    try:
        page = Page(demo.local_url, timeout_s)
        prompts = [(q["question_id"], q["turns"][0]) for q in questions]
        ids = {qid: engine.prompt_ids([(text, None)], engine.default_system) for qid, text in prompts}

        def bench(method, qid):
            torch.manual_seed(0)
            before = cpu_seconds(model_threads)
            out = on_model(runners[method], ids[qid])
            out.cpu = cpu_used(before, cpu_seconds(model_threads))
            return out

        def app(method, text):
            page.set_eagle(method == "eagle")
            n = len(recorder.runs)
            before = cpu_seconds(model_threads)
            seen = page.ask(text)
            after = cpu_seconds(model_threads)
            seen["cpu"] = cpu_used(before, after)
            runs = recorder.runs[n:]  # the reply, then for EAGLE its vanilla check (app.session.vanilla_check)
            if not runs or len(runs) > 1 + (method == "eagle") or any(r["eagle"] for r in runs[1:]):
                raise RuntimeError(f"expected one generation per reply (and an EAGLE reply's vanilla check), the app "
                                   f"ran {len(runs)}")  # fmt: skip
            return seen, runs[0]

        for method in methods:
            for _ in range(warmup):
                bench(method, prompts[0][0])
                app(method, prompts[0][1])
        records = []
        for i, (qid, text) in enumerate(prompts):
            for method in methods:
                sides = ["bench", *rates]
                order = sides[i % len(sides) :] + sides[: i % len(sides)]  # who goes first rotates per prompt
                for attempt in range(retries + 1):
                    got = {}
                    for who in order:
                        if who == "bench":
                            got[who] = bench(method, qid)
                        else:
                            handlers.UPDATE_EVERY_S = who
                            got[who] = app(method, text)
                    handlers.UPDATE_EVERY_S = default_every
                    busy = max(others_cores(got["bench"].cpu), *(others_cores(got[r][0]["cpu"]) for r in rates))
                    if busy <= BUSY_CORES:
                        break
                    log(f"[{i + 1}/{len(prompts)}] {qid} {method}: other programs used {busy:.2f} cores meanwhile"
                        + (", measuring again once the machine is quiet" if attempt < retries else ""))
                    if attempt < retries:
                        wait_quiet(model_threads, log, quiet_wait_s)
                out = got["bench"]
                bench_text = engine.tokenizer.decode(out.tokens, skip_special_tokens=True)
                expected = plain_text(render(bench_text, [], False))
                for every in rates:
                    seen, run = got[every]
                    shown_tps = number(seen["shown_tokens_per_s"])
                    label = method if len(rates) == 1 else f"{method}, updates every {every:g} s"
                    rec = {
                        "question_id": qid, "method": label, "update_every_s": every,
                        "order": "/".join(map(str, order)), "bench_tokens": len(out.tokens), "bench_s": out.seconds,
                        "app_tokens": len(run["tokens"]), "app_rounds_s": run["seconds"],
                        "page_s": (seen["end"] - seen["start"]) / 1000,
                        "final_at_s": (seen["final_at"] - seen["start"]) / 1000,
                        "shown_tokens_per_s": shown_tps,
                        "shown_s": len(run["tokens"]) / shown_tps if shown_tps else None,
                        "shown_new_tokens": number(seen["new_tokens"]), "updates": seen["updates"],
                        "cpu_s": seen["cpu"], "bench_cpu_s": out.cpu,
                        "same_prompt": run["ids"] == ids[qid], "same_ids": run["tokens"] == out.tokens,
                        "same_text": squeeze(seen["text"]) == squeeze(expected), "busy": busy > BUSY_CORES,
                    }  # fmt: skip
                    records.append(rec)
                    log(f"[{i + 1}/{len(prompts)}] {qid} {label}: bench {rec['bench_tokens'] / rec['bench_s']:.1f}, "
                        f"page {rec['app_tokens'] / rec['page_s']:.1f}, shown {rec['shown_tokens_per_s'] or 0:.1f} "
                        f"tokens/s; {rec['app_tokens']} tokens, {rec['updates']} updates, same ids "
                        f"{rec['same_ids']}, same text {rec['same_text']}; CPU s during the reply: "
                        + ", ".join(f"{k} {v:.2f}" for k, v in seen["cpu"].items() if k != "wall"))  # fmt: skip
        return {"records": records, "summary": summarize(records)}
    finally:
        if page is not None:
            page.close()
        demo.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m app.speed_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=6, help="the first N MT-bench questions (first turns; default 6)")
    p.add_argument("--question-file", default=None, help="an MT-bench-format jsonl (default: MT-bench)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per reply, page and bench alike (default 128)")
    p.add_argument("--warmup", type=int, default=1, help="untimed replies per method and side first (default 1)")
    p.add_argument("--update-every", default=None, metavar="S[,S...]",
                   help="the page's update interval(s) in seconds, each measured in the same run (default: the "
                   "app's, app.handlers.UPDATE_EVERY_S); e.g. 0.05,0.25 compares two")  # fmt: skip
    p.add_argument("--retries", type=int, default=3,
                   help=f"measure a prompt again when other programs used more than {BUSY_CORES} cores meanwhile, "
                   "at most this many times, each once the machine is quiet (default 3)")  # fmt: skip
    p.add_argument("--json", default=None, help="also write the records and summary here")
    g = p.add_argument_group("model (as launch.py's options; default: the app's defaults)")
    g.add_argument("--model-type", default="smollm2")
    g.add_argument("--base-model-path", default=None)
    g.add_argument("--ea-model-path", default=None)
    g.add_argument("--total-token", type=int, default=None)
    g.add_argument("--depth", type=int, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--draft-dtype", default="auto")
    g.add_argument("--compile", default="auto")
    g.add_argument("--weights", default="auto", help="as launch.py's --weights (auto: q4_1 for the default)")
    return p


def main(argv: list[str] | None = None) -> dict:
    from eagle.evaluation.models import log
    from eagle.evaluation.questions import load_mtbench_questions
    from eagle.tuning.cost_cache import cpu_description

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    for path in (CHROMIUM, DRIVER):
        if not os.path.exists(path):
            raise SystemExit(f"error: {path} is missing (apt-get install -y chromium chromium-driver)")
    questions = load_mtbench_questions(args.question_file)[: args.prompts]
    every = [float(x) for x in args.update_every.split(",")] if args.update_every else None
    load_before = os.getloadavg()
    from eagle.chat.model_types import ModelLoadError

    try:
        engine = load_app_engine(args, log)
    except ModelLoadError as e:
        raise SystemExit(f"error: {e}") from None
    import torch

    result: dict = {}

    def work():
        try:
            if engine.jobs:  # the app's compiled rounds come in first: timed as a user gets them
                log("waiting for the work the app does while idle (compiled rounds, vanilla timing)")
                while engine.jobs:
                    time.sleep(1)
            result.update(measure(engine, questions, args.max_new_tokens, log, args.warmup, update_every=every,
                                  retries=args.retries))  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            result["error"] = e
        finally:
            engine.stop_serving()

    worker = threading.Thread(target=work, name="app-speed", daemon=True)
    worker.start()
    engine.serve_model_calls()  # every model call on this thread, as launch.py does
    worker.join()
    if "error" in result:
        raise result["error"]
    result.update(
        command="python -m app.speed_check " + " ".join(argv), cpu=cpu_description(),
        threads=torch.get_num_threads(), model=engine.info, max_new_tokens=args.max_new_tokens,
        load_average_before=load_before, load_average_after=os.getloadavg(),
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )  # fmt: skip
    print(table(result["summary"]))
    print(f"\nload average before {load_before[0]:.2f}, after {result['load_average_after'][0]:.2f} (1 min); "
          f"torch threads {result['threads']}; {engine.info.get('tree')}; {engine.info.get('forwards')}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        log(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
