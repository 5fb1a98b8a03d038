"""Model work done while no reply runs: the vanilla reference of each path (timed again after a reply when it is
stale), and compiled rounds in stages, each compiled by a child and brought in the same way: first what compiled
rounds need with the tree in use (`first_stage`: the base's one-row step, the greedy round's two steps), measured
against eager and put in use; then the base's wider buckets and the head's steps, the tree tuned on them and its
round's steps where it changed (`tuned_rounds`); then the same round's shape with context chains (`context_rounds`:
context drafts on compiled rounds).

Work comes as jobs: generators whose every step is one unit of model work (seconds; a graph loaded from the cache
takes up to a minute on a 2-core CPU). Each yields, before a unit, a line that says what the unit does (a `Loading`
when it times nothing, so that the compiling children go on beside it), or a `Wait` when it has nothing to do yet
(the graph it needs next is still being compiled). `Engine.idle_step` runs one unit while no reply holds the model,
so a message waits for one unit at most, and a reply never shares the model thread with a measurement. Measurements
whose results are kept across starts are taken with the compiling children stopped, repeated until two agree, and
never saved if another process used the CPU meanwhile (`OthersCpu`).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Iterator

REFERENCE_PROMPTS = (
    "Write a detailed guide, in several sections, on how to plant and care for a vegetable garden.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe, step by step, how to make a good cup of tea.",
)
REFERENCE_TOKENS = 128  # new tokens per reference prompt
# a path's reference older than this is timed again after the next reply on it: the machine's speed drifts (a VM's
# by a fifth within minutes), and a reply's speedup is against vanilla under the conditions it met
REFRESH_S = 90.0
BUSY_SHARE = 0.25  # others' CPU use, in cores, above which a measurement is not kept
STABLE = 0.10  # two measurements agree when they differ by at most this share
MAX_TRIES = 4


@dataclass(frozen=True)
class Wait:
    """Nothing to run now (the child compiles); `line` says what is awaited."""

    line: str


@dataclass(frozen=True)
class Loading:
    """A unit that times nothing (loading graphs): the compiling children may go on beside it."""

    line: str


@dataclass(frozen=True)
class VanillaReference:
    """Vanilla decoding on one path, timed while idle: the median seconds of one decode step (a base forward for
    one token after the prompt's prefill)."""

    path: str  # "eager" or "compiled"
    step_s: float
    source: str
    timed_at: float = 0.0  # time.monotonic() when it was timed

    def seconds(self, first_round_s: float, new_tokens: int) -> float:
        """What vanilla decoding would take for a reply of `new_tokens` whose prefill (its first round, the same
        base pass for both decoders) took `first_round_s`."""
        return first_round_s + max(0, new_tokens - 1) * self.step_s


# ---------------------------------------------------------------------------------------------------------
def _proc_busy_ticks() -> tuple[int, int] | None:
    """(ticks all CPUs spent busy, ticks this process spent), from /proc; None where there is no /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system [idle iowait] irq softirq steal
    return busy, int(own[11]) + int(own[12])  # utime + stime of all threads


class OthersCpu:
    """`with OthersCpu() as load:` then `load.cores`: the CPU other processes used meanwhile, in cores."""

    cores = 0.0

    def __enter__(self) -> "OthersCpu":
        self._t0, self._ticks0 = time.monotonic(), _proc_busy_ticks()
        return self

    def __exit__(self, *exc) -> None:
        ticks = _proc_busy_ticks()
        wall = time.monotonic() - self._t0
        if ticks is None or self._ticks0 is None or wall <= 0:
            return
        others = (ticks[0] - self._ticks0[0]) - (ticks[1] - self._ticks0[1])
        self.cores = max(0.0, others / os.sysconf("SC_CLK_TCK") / wall)

    @property
    def busy(self) -> bool:
        return self.cores > BUSY_SHARE


def stable(values: list[float]) -> bool:
    """The last two measurements agree."""
    return len(values) >= 2 and abs(values[-1] - values[-2]) <= STABLE * max(values[-1], values[-2])


# ---------------------------------------------------------------------------------------------------------
def vanilla_reference(engine, path: str, within=contextlib.nullcontext) -> Iterator[str]:
    """Time vanilla decoding on REFERENCE_PROMPTS (a unit each, inside `within()`: the path's forwards in use) and
    set it as the engine's reference for `path`: the median of the runs' median step times. Timed again while another
    process used the CPU meanwhile, up to MAX_TRIES times (then kept, and said so)."""
    for attempt in range(MAX_TRIES):
        steps, busy = [], False
        for i, prompt in enumerate(REFERENCE_PROMPTS):
            yield f"timing vanilla decoding ({path} forwards), prompt {i + 1} of {len(REFERENCE_PROMPTS)}"
            ids = engine.prompt_ids([(prompt, None)], engine.default_system)
            with within(), OthersCpu() as load:
                seconds = [r.seconds for r in engine.decode(ids, eagle=False, max_new_tokens=REFERENCE_TOKENS)]
            busy = load.busy or busy
            if len(seconds) > 1:
                steps.append(statistics.median(seconds[1:]))  # the first round is the prefill
        if not busy:
            break  # else timed again: replies show no speedup meanwhile rather than one against a slowed vanilla
    if steps:
        source = (f"vanilla decoding on {path} forwards, timed while idle ({len(steps)} prompts, "
                  f"{REFERENCE_TOKENS} tokens each{'; another process used the CPU meanwhile' if busy else ''})")
        engine.set_reference(VanillaReference(path, statistics.median(steps), source, time.monotonic()))


def refresh_reference(engine, path: str) -> Iterator[str]:
    """`vanilla_reference` of `path` timed again, if it is still the path in use when the job starts."""
    if engine.path == path:
        yield from vanilla_reference(engine, path)


@contextlib.contextmanager
def rounds_in_use(model, base_graphs, head, draft_graphs):
    """The model with these compiled rounds (base graphs, a head and its draft graphs; None = eager), as it was
    after the block."""
    saved = (model.base.compiled, model.ea_layer, model.compiled_draft, model.tree, model.tree_choice)
    model.base.compiled = base_graphs
    if head is not None:
        model.ea_layer, model.compiled_draft = head, draft_graphs
    try:
        yield model
    finally:
        model.base.compiled, model.ea_layer, model.compiled_draft, model.tree, model.tree_choice = saved


def compiled_vs_eager(model, base_graphs) -> tuple[dict, float]:
    """ms per forward over each bucket's rows, compiled and eager (compiling.compiled_vs_eager); (result, other
    processes' CPU meanwhile in cores)."""
    from eagle.model.compiling import compiled_vs_eager as measure

    with OthersCpu() as load, rounds_in_use(model, base_graphs, None, None):
        ms = measure(model.base)["ms"]
    return ms, load.cores


def _verdict_path(spec_key: str):
    from eagle.fetch import cache_dir

    return cache_dir() / "compiled" / f"{spec_key}-verdict.json"


def saved_verdict(spec_key: str) -> dict | None:
    try:
        return json.loads(_verdict_path(spec_key).read_text())
    except (OSError, ValueError):
        return None


def awaiting(child, graph: str | None = None) -> Iterator[Wait]:
    """Waits while `child` (a ChildCompile, or None: nothing to wait for) has not compiled `graph` (None: all of its
    graphs) and has not finished."""
    while child is not None and (graph is None or graph not in child.compiled) and not child.finished:
        yield Wait(child.progress())


def _load_each(child, graphs, load, log, purpose: str = "") -> Iterator[Loading | Wait]:
    """Each of `graphs` ((kind, rows) as `CompileSpec.graphs` lists them) loaded by `load(kind, rows)` (returns
    seconds), a unit each, as soon as `child` (a ChildCompile, or None: compiled before) has compiled it; then waits
    for the child to end. Stops at the child's error (the caller reads `child.error`)."""
    from .precompile import ROUND_STEPS, graph_name

    for i, (kind, rows) in enumerate(graphs):
        yield from awaiting(child, graph_name(kind, rows))
        if child is not None and child.error:
            break
        what = ROUND_STEPS.get(kind, f"{rows}-row {kind}")
        yield Loading(f"loading the compiled graphs{purpose}: {i + 1} of {len(graphs)} ({what})")
        seconds = load(kind, rows)
        log(f"loaded the round's {what} in {seconds:.1f} s" if kind in ROUND_STEPS
            else f"loaded the {rows}-row {kind} graph in {seconds:.1f} s")  # fmt: skip
    yield from awaiting(child)


# The first compiled rounds' tree where the tree is tuned (the head has an acceptance profile): the tree in use was
# tuned on eager forwards, whose per-forward constant (the graphs take it away) favours big trees. Before any compiled
# cost is known, the smallest tree: the root's best child, no expansion. Its verify pass of two rows costs about one
# step wherever a one-row step streams the weights (the second row's products hide behind the stream: docs/history,
# sessions 57 and 59), so it pays where rows are dear too; it serves until the tree tuned on the graphs' own costs
# comes in (`tuned_rounds`).
FIRST_TREE = (2, 1, 1)  # (total_token, depth, top_k)


def first_tree(model):
    """The tree of the first compiled rounds for `model`: FIRST_TREE where its tree is tuned later, else its own."""
    tree = model.tree
    if model.acceptance is None or tree.choices:
        return tree
    return replace(tree, total_token=FIRST_TREE[0], depth=FIRST_TREE[1], top_k=FIRST_TREE[2])


def first_stage(spec, tree):
    """The graphs compiled first: what replies need to run on compiled rounds with `tree` (`first_tree`), the base's
    one-row step and the greedy round's two steps; the base's wider buckets, the head's steps and the tree tuned on
    their costs come after (`tuned_rounds`). A static tree (no round steps) or a spec that names its round: the whole
    spec."""
    if tree.choices or spec.round_tree is not None:
        return spec
    return replace(spec, base_buckets=spec.base_buckets[:1], draft_buckets=(),
                   round_tree=(tree.total_token, tree.depth, tree.top_k))  # fmt: skip


def compiled_rounds(engine, child, spec, mode: str, log) -> Iterator[str | Loading | Wait]:
    """Wait for `child` (a ChildCompile of `first_stage(spec, first_tree(model))`, or None when those graphs are in the
    cache already), load its graphs from the cache a graph a unit, decide (mode "auto": only where compiled forwards
    measure faster, idle and stable), time vanilla decoding with them and put them in use together; then the rest of
    `spec` and the tree tuned on it (`tuned_rounds`), and the round with context chains (`context_rounds`)."""

    from .precompile import ROUND_STEPS, load_compiled_head, round_graphs

    model = engine.model
    tree = first_tree(model)
    first = first_stage(spec, tree)
    made = {}  # the graphs' runners and the head, made at the first load, in its unit (it reads the checkpoint)

    def load(kind: str, rows: int) -> float:
        if not made:
            head = load_compiled_head(model.base_model, spec.head_path, spec.draft_dtype)
            made.update(base=model.compile_base(first.base_buckets), head=head,
                        draft=model.compile_draft(first.draft_buckets, head=head) if first.draft_buckets else None,
                        round=round_graphs(model, head, first.round_tree) if first.round_tree is not None else None)
        if kind in ROUND_STEPS:
            step = kind.removeprefix("round_")
            return made["round"].warm(steps=(step,))[step]
        return made[kind].warm(rows=[rows])[rows]

    yield from _load_each(child, first.graphs(), load, log)
    base_graphs, head, draft_graphs, rounds = (made.get(k) for k in ("base", "head", "draft", "round"))
    engine.child = None  # nothing left to stop while the model works
    if child is not None and child.error:
        if base_graphs is not None:
            yield "back to eager forwards"
            model.base.decompile()
        log(f"compiling stopped ({child.error}); still decoding eagerly")
        engine.status = f"compiling failed ({child.error}): decoding eagerly"
        return
    if child is not None:
        log(f"compiled {len(child.compiled)} graphs in {time.monotonic() - child.started:.0f} s")

    verdict, tries, ratio = saved_verdict(spec.key()), [], None
    for attempt in range(MAX_TRIES if verdict is None else 0):
        yield f"timing compiled against eager forwards (try {attempt + 1})"
        ms, others = compiled_vs_eager(model, base_graphs)
        ratio = sum(ms["compiled"].values()) / sum(ms["eager"].values())
        if others > BUSY_SHARE:
            log(f"compiled vs eager: another process used the CPU meanwhile ({others:.2f} cores); timing again")
            continue
        tries.append(ratio)
        if stable(tries):
            verdict = {"ms": ms, "compiled_over_eager": round(tries[-1], 3), "compiled_pays": tries[-1] < 1.0}
            _verdict_path(spec.key()).parent.mkdir(parents=True, exist_ok=True)
            _verdict_path(spec.key()).write_text(json.dumps(verdict))
            log("compiled vs eager, ms per forward over " + "/".join(map(str, first.base_buckets)) + " rows: "
                + "/".join(f"{ms['compiled'][n]:.1f}" for n in first.base_buckets) + " vs "
                + "/".join(f"{ms['eager'][n]:.1f}" for n in first.base_buckets))  # fmt: skip
            break
    if verdict is None:  # never stable or never idle: decided for this run only, from the last try
        verdict = {"compiled_pays": ratio is not None and ratio < 1.0}
        if tries:
            log(f"compiled vs eager: no steady timing in {MAX_TRIES} tries (compiled / eager "
                f"{', '.join(f'{t:.2f}' for t in tries)}); decided for this start only")  # fmt: skip
    if not verdict["compiled_pays"] and mode == "auto":
        model.base.decompile()
        log("compiled forwards measured slower than eager here: decoding eagerly")
        engine.status = "compiled forwards measured slower than eager here: decoding eagerly"
        return

    # timed the moment before the replies it is the reference of (EAGLE in use then runs the round's two steps:
    # on the forwards' graphs alone, the general loop, it is about level with compiled vanilla on a small base)
    yield from vanilla_reference(engine, "compiled", lambda: rounds_in_use(model, base_graphs, head, draft_graphs))
    yield "putting the compiled rounds in use"
    model.base.compiled, model.ea_layer, model.compiled_draft = base_graphs, head, draft_graphs
    if first.round_tree == (tree.total_token, tree.depth, tree.top_k) and tree != model.tree:
        model.tree, model.tree_choice = tree, None  # no prediction for it: the tuned tree brings its own
    came = _said(_put_in_use(engine, rounds), log)
    engine.compiled_in_use()
    log("compiled rounds in use")
    if first is not spec:
        yield from tuned_rounds(engine, spec, head, log)
    elif came:
        yield from context_rounds(engine, spec, log)


def tuned_rounds(engine, spec, head, log) -> Iterator[str | Loading | Wait]:
    """With the first stage's compiled rounds in use: the rest of `spec` (the base's wider buckets, the head's steps:
    sampling rounds run on them, the tuner times them) compiled by a child and put in use, then the tree tuned on
    their costs, and where it differs from the tree in use, its round's two steps compiled and put in use with it;
    then the round with context chains (`context_rounds`)."""
    from eagle.tuning.tuner import forget_costs

    from .precompile import ChildCompile, compiled_before

    model = engine.model
    child = None if compiled_before(spec) else ChildCompile(spec)
    engine.child = child
    made = {}  # the graphs' runners, made at the first load, in its unit

    def load(kind: str, rows: int) -> float:
        if not made:
            made.update(base=model.compile_base(spec.base_buckets),
                        draft=model.compile_draft(spec.draft_buckets, head=head))
        return made[kind].warm(rows=[rows])[rows]

    try:
        yield from _load_each(child, spec.graphs(), load, log, " for tuning")
    finally:
        engine.child = None
    if child is not None and child.error:
        log(f"compiling the other graphs stopped ({child.error}); rounds go on with the tree in use")
        return
    yield "putting the other compiled graphs in use"
    base_graphs, draft_graphs = made["base"], made["draft"]
    model.base.compiled, model.compiled_draft = base_graphs, draft_graphs
    if model.acceptance is not None:
        yield "tuning the draft tree for compiled rounds"
        with rounds_in_use(model, base_graphs, head, draft_graphs), OthersCpu() as load:
            model.tune_tree(log)
            tuned = (model.tree, model.tree_choice, model.context_chains)
        if load.busy:  # measured costs are cached for later starts: not these
            with rounds_in_use(model, base_graphs, head, draft_graphs):
                forget_costs(model)
        if model.shape_of(tuned[0]) == model.shape_of(model.tree):
            model.tree, model.tree_choice, model.context_chains = tuned  # the same rounds: their graphs stay
        else:
            steps = yield from _load_round_steps(engine, spec, head, tuned[0], (), log)
            if steps is None or isinstance(steps, str):
                log(f"compiling the tuned tree's round stopped ({steps}); rounds go on with the tree in use")
            else:
                yield "putting the tuned tree's compiled rounds in use"
                model.tree, model.tree_choice, model.context_chains = tuned
                _said(_put_in_use(engine, steps), log)
                log(f"the tuned tree in use: {tuned[0].total_token} nodes, depth {tuned[0].depth}, "
                    f"top_k {tuned[0].top_k}")  # fmt: skip
        engine.info.update(engine.describe(model))
    yield from context_rounds(engine, spec, log)


def compiled_round_steps(engine, spec, log) -> Iterator[str | Loading | Wait]:
    """With compiled forwards in use: the greedy round's draft and verify steps, one graph each for the tree in use
    (round_graphs.py), compiled by a child (the same low priority, stopped while the model works), loaded a graph a
    unit and put in use; then (only once they are in) the same round with context chains. If they fail, rounds go
    on with the forwards' graphs, said in the log."""
    model = engine.model
    if not _serves_round_steps(model):
        return
    steps = yield from _load_round_steps(engine, spec, model.ea_layer, model.tree, (), log)
    if _said(_put_in_use(engine, steps), log):
        yield from context_rounds(engine, spec, log)


def _said(came, log) -> bool:
    """The log's line on the two-step round's graphs (`_put_in_use`'s answer); whether they came in."""
    if came is True:
        log("rounds in two compiled steps in use (draft, verify)")
    elif came:
        log(f"compiling the round's steps stopped ({came}); rounds go on with the forwards' graphs")
    return came is True


def context_rounds(engine, spec, log) -> Iterator[str | Loading | Wait]:
    """After the two-step round: the same tree's round with context chains (`model.context_chains`' sizes: draft,
    verify, and verify with a chain of each size), compiled by a child and brought in the same way. Until it is in,
    replies on compiled rounds go without context drafts (`Engine.context_drafts_served`), so that none leaves the
    compiled graphs for them; if it fails they stay without, said in the log. Returns whether it came in."""
    model = engine.model
    if not _serves_round_steps(model):
        return False
    chains = tuple(sorted(set(model.context_chains)))
    rounds = yield from _load_round_steps(engine, spec, model.ea_layer, model.tree, chains, log)
    came = _put_in_use(engine, rounds)
    if came is True:
        engine.describe_context()
        log("rounds with context drafts in compiled steps in use (draft, verify, verify with a chain)")
    elif came:
        log(f"compiling the round with context drafts stopped ({came}); replies on compiled rounds go without them")
    return came is True


def _serves_round_steps(model) -> bool:
    """Whether the forwards in use are CPU graphs, beside which a round's compiled steps run (not eager forwards,
    not CUDA graphs, which run their own rounds)."""
    from eagle.runtime import runners

    return model.base.compiled is not None and not runners.graphed_on_cuda(model.base)


def _put_in_use(engine, rounds):
    """`rounds` from `_load_round_steps` put in `model.compiled_rounds` where they still serve the model (its head,
    its tree's shape and chains unchanged meanwhile). Returns True when put in use, else what `_load_round_steps`
    returned (the child's error, or None), or None where they no longer serve."""
    model = engine.model
    if rounds is None or isinstance(rounds, str):
        return rounds
    chained = replace(model.tree, chain=rounds.shape.chain)  # model.shape_of adds the chains' sizes
    if rounds.step.head is not model.ea_layer or model.shape_of(chained) != rounds.shape:
        return None  # the head, the tree or the chains changed meanwhile: these graphs serve none of them
    model.compiled_rounds[rounds.shape] = rounds
    engine.info.update(engine.describe(model))
    return True


def _load_round_steps(engine, spec, head, tree, chains: tuple[int, ...], log) -> Iterator[str | Loading | Wait]:
    """The CompiledRound of `head` for `tree` with context chains of the sizes `chains` (): a child compiles its
    graphs (unless a manifest says they are compiled already), loaded here a graph a unit. Returns it, not in use;
    the child's error (a string) when compiling failed; None for a static tree."""
    from .precompile import ROUND_STEPS, ChildCompile, compiled_before, graph_name, round_graphs

    if tree.choices:
        return None
    spec = replace(spec, base_buckets=(), draft_buckets=(), round_tree=(tree.total_token, tree.depth, tree.top_k),
                   round_chains=chains)  # fmt: skip
    child = None if compiled_before(spec) else ChildCompile(spec)
    engine.child = child
    rounds = round_graphs(engine.model, head, spec.round_tree, chains)
    try:
        for kind, nodes in spec.graphs():
            yield from awaiting(child, graph_name(kind, nodes, chains))
            if child is not None and child.error:
                return child.error
            yield Loading(f"loading the compiled graphs: the round's {ROUND_STEPS[kind]}"
                          + (" (context drafts)" if chains else ""))  # fmt: skip
            step = kind.removeprefix("round_")
            log(f"loaded the round's {ROUND_STEPS[kind]} in {rounds.warm(steps=(step,))[step]:.1f} s")
        yield from awaiting(child)
    finally:
        engine.child = None
    return child.error if child is not None and child.error else rounds
