"""The app's compiled rounds: compiled by child processes that are stopped whenever the model works, brought in by
idle work between replies (never under one), measured only while idle, and the replies stay what they were."""

import json
import os
import time
from dataclasses import replace

import pytest
from app_fixtures import tiny_engine

from app import idle_work
from app.engine import EngineBusy
from app.idle_work import VanillaReference, Wait, compiled_rounds, first_stage, saved_verdict, vanilla_reference
from app.precompile import ChildCompile, CompileSpec, compiled_before
from eagle.chat.model_types import forwards_description
from eagle.decoding.verify import SamplingParams, TokenPicker
from eagle.runtime.round_graphs import CompiledRound


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(idle_work, "REFERENCE_PROMPTS", idle_work.REFERENCE_PROMPTS[:2])
    monkeypatch.setattr(idle_work, "REFERENCE_TOKENS", 12)


def spec_of(engine, folder) -> CompileSpec:
    """One graph each (seconds to compile) for the tiny model saved in `folder`."""
    from eagle.kernels import few_rows

    model = engine.model
    return CompileSpec(base_path=os.path.join(folder, "base"), head_path=os.path.join(folder, "draft"),
                       dtype="float32", draft_dtype="float32", few_row_plan=few_rows.plan_of(model.base_model),
                       base_buckets=(16,), draft_buckets=(4,), threads=1)  # fmt: skip


def process_state(pid: int) -> str:
    """The kernel's state letter of a process: "T" = stopped."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def all_stopped(processes, timeout: float = 2.0) -> bool:
    """Whether every live process reaches the stopped state within `timeout`: SIGSTOP takes effect when the kernel
    next schedules the process, moments after the signal."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(process_state(p.pid) == "T" for p in processes if p.poll() is None):
            return True
        time.sleep(0.01)
    return False


def tokens(engine, ids, **kw):
    return [t for r in engine.rounds(ids, max_new_tokens=24, **kw) for t in r.tokens]


def test_a_tuned_tree_starts_compiled_rounds_on_the_small_first_tree_and_a_given_tree_on_itself(tmp_path):
    """The tree tuned at load timed eager forwards (big trees win there): the first compiled round is FIRST_TREE's,
    which the tree tuned on the graphs' costs replaces later; a tree not tuned (no acceptance profile) is its own."""
    engine = tiny_engine(str(tmp_path))
    model, spec = engine.model, spec_of(engine, str(tmp_path))
    model.tree = replace(model.tree, total_token=8, depth=1, top_k=3)  # as the eager timings picked on a Zen 3
    assert model.acceptance is None and idle_work.first_tree(model) == model.tree
    model.acceptance = [[0.6, 0.2, 0.1]] * 3
    first = idle_work.first_tree(model)
    assert (first.total_token, first.depth, first.top_k) == idle_work.FIRST_TREE != (8, 1, 3)
    assert first_stage(spec, first).round_tree == idle_work.FIRST_TREE
    model.tree = static = replace(model.tree, choices=((0,), (0, 0)))  # an EAGLE-1 static tree: no round steps
    assert idle_work.first_tree(model) == static


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states from /proc")
def test_children_compile_only_while_the_model_is_idle_and_the_graphs_change_no_reply(own_cache, tmp_path,
                                                                                     monkeypatch):
    from eagle.runtime import aot_store

    compiled_here = []  # graphs this process compiled itself: none, every one comes from a child's files
    compile_and_save = aot_store.compile_and_save
    monkeypatch.setattr(aot_store, "compile_and_save",
                        lambda fn, *args: compiled_here.append(fn.__qualname__) or compile_and_save(fn, *args))
    engine = tiny_engine(str(tmp_path))
    model, spec = engine.model, spec_of(engine, str(tmp_path))
    ids = engine.prompt_ids([("w7 w8 w9", None)])
    reference, vanilla = tokens(engine, ids), tokens(engine, ids, eagle=False)

    # first what compiled rounds need (the one-row step, the round's two steps for the tree in use), the rest after
    engine.child = child = ChildCompile(first_stage(spec, model.tree))
    assert len(child.processes) == 2 and len(child.spec.graphs()) == 3
    lines = []
    engine.add_job(compiled_rounds(engine, child, spec, "on", lines.append))
    reply = engine.rounds(ids, max_new_tokens=24)
    got = list(next(reply).tokens)  # a reply holds the model: the children are stopped
    assert child.paused and all_stopped(child.processes)
    assert engine.idle_step() is False  # no idle work under a reply
    got += [t for r in reply for t in r.tokens]
    assert not child.paused and got == reference
    assert all(process_state(p.pid) != "T" for p in child.processes if p.poll() is None)

    engine.run_idle_work(timeout=900)
    assert child.ok, child.error
    assert engine.path == "compiled" and model.compiled_draft is not None, engine.status
    assert engine.reference("compiled").step_s > 0 and "compiled rounds in use" in lines
    # a child compiles the greedy round's two steps for the tree in use, and they come in with the forwards' graphs
    # (EAGLE never runs the general loop on compiled forwards against a compiled vanilla); then the same round with a
    # context chain, and only then do replies on compiled rounds ask for context drafts
    two_steps = lines.index("rounds in two compiled steps in use (draft, verify)")
    assert two_steps < lines.index("compiled rounds in use"), lines
    assert lines[-1] == "rounds with context drafts in compiled steps in use (draft, verify, verify with a chain)"
    assert any("verify step with a context chain" in line for line in lines[two_steps:]), lines
    assert isinstance(model.round_runner(model.tree, TokenPicker(SamplingParams())), CompiledRound)
    assert engine.context_drafts_served()
    assert "greedy rounds in two compiled steps" in forwards_description(model)
    assert tokens(engine, ids) == reference and tokens(engine, ids, eagle=False) == vanilla
    assert tokens(engine, ids, context_drafts=True) == reference  # lossless on the compiled context round too
    assert compiled_here == [] or not model.base.compiled.graphs.aot, compiled_here
    assert compiled_before(spec)  # a second start loads the graphs without compiling
    tree = model.tree
    rounds = replace(spec, base_buckets=(), draft_buckets=(), round_tree=(tree.total_token, tree.depth, tree.top_k))
    assert compiled_before(first_stage(spec, tree))
    assert compiled_before(replace(rounds, round_chains=(model.context_chain,)))
    # and measures no verdict again, unless this one was taken while another process used the CPU or never held
    unsaved = any("another process used the CPU" in line or "no steady timing" in line for line in lines)
    assert saved_verdict(spec.key()) is not None or unsaved, lines


def test_idle_work_waits_for_a_reply_and_a_waiting_reply_goes_first(own_cache, tmp_path):
    engine = tiny_engine(str(tmp_path))
    ran = []

    def job():
        for i in range(3):
            yield f"unit {i}"
            ran.append(i)
            time.sleep(0.05)

    engine.add_job(job())
    reply = engine.rounds(engine.prompt_ids([("w7", None)]), max_new_tokens=8)
    next(reply)
    assert engine.idle_step() is False and ran == []
    reply.close()
    assert engine.idle_step() is True and ran == [0]
    with engine.wanted():  # a message waits for the model: no unit starts
        assert engine.idle_step() is False and ran == [0]
    engine.run_idle_work()
    assert ran == [0, 1, 2] and engine.jobs == []


def test_a_message_behind_a_unit_of_idle_work_hears_what_it_waits_for(own_cache, tmp_path):
    engine = tiny_engine(str(tmp_path))
    with engine._model("loading the compiled graphs: 2 of 6", timeout=0):
        lines = engine.waiting_lines(poll_s=0.01)
        assert next(lines).startswith("waiting for the model: loading the compiled graphs: 2 of 6")
        with pytest.raises(EngineBusy):  # and no other unit starts meanwhile
            with engine._model("another unit", timeout=0):
                pass
    assert list(lines) == []


def test_a_job_that_waits_lets_the_next_job_run_and_reports_its_progress(own_cache, tmp_path):
    engine = tiny_engine(str(tmp_path))
    ready = []

    def waiting():
        while not ready:
            yield Wait("compiling: 1 of 2 graphs done")
        yield "loading"

    engine.add_job(waiting())
    engine.add_job(vanilla_reference(engine, "eager"))
    assert engine.idle_step() is True  # the reference's first unit, past the waiting job
    assert engine.status.startswith("timing vanilla decoding")
    engine.run_idle_work(timeout=5)
    assert engine.reference("eager") is not None and engine.jobs and engine.status.startswith("compiling: 1 of 2")
    ready.append(True)
    engine.run_idle_work()
    assert engine.jobs == []


@pytest.fixture
def nothing_compiled(monkeypatch):
    """Graphs that are never built: loading them does nothing (the tests around them time no graph)."""
    from eagle.runtime import compiled, compiled_draft

    def warm(self, log=None, context=64, rows=None):
        return {r: 0.0 for r in rows}

    def warm_steps(self, log=None, context=64, steps=None):
        return dict.fromkeys(steps, 0.0)

    monkeypatch.setattr(compiled.CompiledDecode, "warm", warm)
    monkeypatch.setattr(compiled_draft.CompiledDraft, "warm", warm)
    monkeypatch.setattr(CompiledRound, "warm", warm_steps)


def test_a_verdict_measured_under_load_is_not_saved(own_cache, nothing_compiled, tmp_path, monkeypatch):
    engine = tiny_engine(str(tmp_path))
    spec = spec_of(engine, str(tmp_path))
    slower = {"compiled": {16: 2.0}, "eager": {16: 1.0}}  # and always under load
    monkeypatch.setattr(idle_work, "compiled_vs_eager", lambda model, graphs: (slower, 1.0))
    lines = []
    engine.add_job(compiled_rounds(engine, None, spec, "auto", lines.append))  # None: compiled before
    engine.run_idle_work(timeout=600)
    assert saved_verdict(spec.key()) is None and engine.path == "eager"  # decided for this run only
    assert sum("another process used the CPU" in line for line in lines) == idle_work.MAX_TRIES


def test_a_verdict_that_never_holds_steady_is_not_saved_and_says_so(own_cache, nothing_compiled, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    engine = tiny_engine(str(tmp_path))
    spec = spec_of(engine, str(tmp_path))
    ratios = iter([0.8, 1.2, 0.8, 1.2])  # compiled / eager: each try a third off the last, nothing else running
    monkeypatch.setattr(idle_work, "compiled_vs_eager",
                        lambda model, graphs: ({"compiled": {16: next(ratios)}, "eager": {16: 1.0}}, 0.0))
    lines = []
    engine.add_job(compiled_rounds(engine, None, spec, "auto", lines.append))
    engine.run_idle_work(timeout=600)
    assert saved_verdict(spec.key()) is None and engine.path == "eager"  # from the last try, for this start only
    assert [line for line in lines if "no steady timing" in line] == [
        "compiled vs eager: no steady timing in 4 tries (compiled / eager 0.80, 1.20, 0.80, 1.20); decided for this "
        "start only"]  # fmt: skip


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads CPU times from /proc")
def test_others_cpu_counts_another_process_not_this_one():
    import subprocess
    import sys

    with idle_work.OthersCpu() as alone:
        sum(i * i for i in range(3_000_000))  # this process only
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        with idle_work.OthersCpu() as shared:
            time.sleep(1.0)
    finally:
        spin.kill()
    assert not alone.busy and shared.busy, (alone.cores, shared.cores)


def test_auto_keeps_eager_where_compiled_measured_slower(own_cache, nothing_compiled, tmp_path, monkeypatch):
    engine = tiny_engine(str(tmp_path))
    spec = spec_of(engine, str(tmp_path))
    slower = {"compiled": {16: 2.0}, "eager": {16: 1.0}}
    monkeypatch.setattr(idle_work, "compiled_vs_eager", lambda model, graphs: (slower, 0.0))
    lines = []
    engine.add_job(compiled_rounds(engine, None, spec, "auto", lines.append))
    engine.run_idle_work(timeout=600)
    assert engine.path == "eager" and engine.model.compiled_draft is None
    assert lines[-1] == "compiled forwards measured slower than eager here: decoding eagerly"
    saved = saved_verdict(spec.key())
    assert saved["compiled_pays"] is False and json.dumps(saved)


def test_the_reference_projects_vanilla_onto_the_replys_own_length_and_prefill():
    ref = VanillaReference("eager", step_s=0.02, source="test")
    assert ref.seconds(first_round_s=0.5, new_tokens=101) == pytest.approx(0.5 + 100 * 0.02)
    assert idle_work.stable([1.0, 1.05]) and not idle_work.stable([1.0, 1.3]) and not idle_work.stable([1.0])


def test_a_vanilla_reference_timed_under_load_is_timed_again(own_cache, tmp_path, monkeypatch):
    engine = tiny_engine(str(tmp_path))
    loads = iter([True, True, False, False])  # the first attempt's two prompts under load, then idle
    monkeypatch.setattr(idle_work.OthersCpu, "busy", property(lambda self: next(loads)))
    lines = list(vanilla_reference(engine, "eager"))
    assert len(lines) == 4 and engine.reference("eager") is not None  # two prompts, twice
    assert "another process" not in engine.reference("eager").source


def test_a_stale_reference_is_timed_again_after_a_reply_on_its_path_only(own_cache, tmp_path):
    engine = tiny_engine(str(tmp_path))
    list(vanilla_reference(engine, "eager"))
    fresh = engine.reference("eager")
    engine.record_reply("eager", 10, 5, 0.1)
    assert engine.jobs == []  # timed moments ago
    engine.set_reference(replace(fresh, timed_at=fresh.timed_at - idle_work.REFRESH_S - 1))
    engine.record_reply("eager", 10, 5, 0.1)
    engine.record_reply("eager", 10, 5, 0.1)
    assert len(engine.jobs) == 1  # one timing queued, after the reply, however many replies come meanwhile
    engine.run_idle_work(timeout=120)
    assert engine.jobs == [] and engine.reference("eager").timed_at > fresh.timed_at
    # a stale reference of a path no longer in use is not timed on the forwards in use
    engine.set_reference(replace(fresh, path="compiled", timed_at=0.0))
    engine.record_reply("compiled", 10, 5, 0.1)
    engine.run_idle_work(timeout=120)
    assert engine.reference("compiled").timed_at == 0.0
