"""The EAGLE-2 tree tuned on the machine at hand (`total_token=-1` when the head ships an acceptance profile).

Expected tokens per second of a tree (total_token n, depth D, top_k K) = expected tokens per round / seconds per
round, where
- tokens per round (tau) come from the head's acceptance profile (`eagle/train/acceptance.py`: accept[d][r], the
  chance that the base takes the draft's rank-r candidate at depth d given the path so far was taken), following
  `Drafter.dynamic_tree`: level 1 holds the K best children of the root, each deeper level the K best of the
  K x K children of the level above (min(D, n - 2) expansions), and the n - 1 best nodes of all levels are verified.
  A node's chance of being accepted is the product of accept[d][r] along its path, so the expected accepted
  drafts are the sum of the chosen nodes' chances (nodes are ranked by that chance, as the drafter ranks them by
  its own probabilities);
- seconds per round are measured here: one verify pass over n rows (`BaseModel.pass_seconds`; with compiled
  forwards, sizes between their graphs' row counts interpolated: `verify_sizes`) plus one draft phase of depth D
  and width K (commit the accepted tokens, grow the tree: `draft_seconds`; the 2-node tree's without expansion).
Measurements are cached per machine, threads, model and head (cost_cache.py), so a second start is instant. The same
module times the few-row kernels (`few_row_plan`), the panel kernel's tilings (`panel_tiling`) and the head's dtype
(`faster_draft_dtype`). Everything here measures and returns a choice; the model's runners are put in use by its
caller (`EaModel.tune_tree`, compiling.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass, replace

import torch

from eagle.decoding.context_draft import CHAINS, pick_chains
from eagle.kernels import few_rows, quant_panels
from eagle.timing import repeated_seconds

from . import cost_cache

SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 60)
TOP_KS = (1, 2, 3, 4, 6, 8, 10)


@dataclass(frozen=True)
class TreeChoice:
    total_token: int
    depth: int
    top_k: int
    tau: float  # expected tokens per round (accepted drafts + the base's own token)
    seconds: float  # expected seconds per round
    tokens_per_s: float
    draft_dtype: str = ""  # the head's dtype the costs were measured in
    chains: tuple[int, ...] = ()  # context-chain nodes (M) per match bucket picked for this tree on these costs
    option: int = 0  # which of the model's draft options (head, compiled draft steps) the costs were measured with


def expected_tau(accept: list[list[float]], total_token: int, depth: int, top_k: int) -> float:
    """1 + expected accepted draft tokens per round of the dynamic tree, from the acceptance profile."""
    levels = min(depth, total_token - 2) + 1
    chosen: list[float] = []
    frontier = [1.0]
    for level in range(min(levels, len(accept))):
        row = accept[level][:top_k]
        candidates = sorted((f * p for f in frontier for p in row), reverse=True)
        chosen += candidates
        frontier = candidates[:top_k]
    return 1.0 + sum(sorted(chosen, reverse=True)[: total_token - 1])


def pick_tree(
    accept: list[list[float]], verify_s: dict[int, float], draft_s: dict[tuple[int, int], float]
) -> TreeChoice:
    """The tree of the best expected tokens/s over the measured sizes, depths and widths. draft_s[(d, k)]: a draft
    phase of d expansion levels of width k; d = 0 (the root's best child alone, no expansion) prices the 2-node tree,
    and only it, where measured (a 2-node tree never expands, so the costs of deeper phases would overstate it)."""
    root_only = any(d == 0 for d, _ in draft_s)
    best = None
    for n, v in verify_s.items():
        for (depth, k), d in draft_s.items():
            if root_only and (depth == 0) != (n == 2):
                continue
            tau = expected_tau(accept, n, depth, k)
            choice = TreeChoice(n, max(depth, 1), k, tau, v + d, tau / (v + d))  # a TreeSpec's depth is >= 1
            if best is None or choice.tokens_per_s > best.tokens_per_s:
                best = choice
    return best


@torch.inference_mode()
def draft_seconds(
    model, depths, top_ks, context: int = 256, repeats: int = 5, head_and_graphs: tuple | None = None
) -> dict[tuple[int, int], float]:
    """Median seconds of one draft phase per (depth, top_k): commit two accepted tokens, then grow the tree (depth
    expansion levels; depth 0: the root's children alone, a 2-node tree's). head_and_graphs: a head and its
    `CompiledDraft` (or None) to time instead of the model's."""
    from eagle.decoding.draft import Drafter

    head, graphs = head_and_graphs or (model.ea_layer, model.compiled_draft)
    with Drafter(head, model.base.lm_head, context + 2 + max(depths) * max(top_ks), graphs) as drafter:
        features = torch.randn(context + 2, head.config.feature_size, dtype=drafter.dtype, device=drafter.device)
        tokens = torch.randint(0, model.vocab_size, (context + 2,)).tolist()
        drafter.commit(features[:context], tokens[:context])

        def phase(depth: int, k: int) -> None:
            drafter.commit(features[context:], tokens[context:])
            drafter.dynamic_tree(tokens[-1], 2 + depth * k, depth, k)

        def forget() -> None:  # back to the committed context
            drafter.cache.length = context

        return {(d, k): repeated_seconds(drafter.device, lambda: phase(d, k), repeats, after=forget)[repeats // 2]
                for d in depths for k in top_ks}  # fmt: skip


def verify_costs(model, log=None) -> dict[int, float]:
    """Verify seconds per tree size (SIZES), measured once per machine + base (whatever the head), cached."""
    path = cost_cache.path(model, "-verify", head=False)
    saved = cost_cache.load(path)
    if saved is not None and set(SIZES) <= set(map(int, saved["verify"])):
        return {int(n): s for n, s in saved["verify"].items()}
    t0 = time.perf_counter()
    compiled = model.base.compiled
    bucket = compiled.bucket if compiled else None
    # with compiled forwards, only the row counts a graph takes as they are (and 1, the line's start): the rest pad
    rows = [n for n in sorted({1, *SIZES}) if runs_as_is(bucket, n)] if bucket else list(SIZES)
    verify = verify_sizes(model.base.pass_seconds(rows), bucket)
    cost_cache.save(path, {"verify": verify})
    if log:
        log(f"tree tuner: measured {len(verify)} verify sizes in {time.perf_counter() - t0:.1f} s (cached in {path})")
    return verify


def runs_as_is(bucket, rows: int) -> bool:
    """Whether a base forward over `rows` runs at its own rows: eagerly (`bucket` None, or None for these rows: past
    the largest graph) or in a graph of exactly that many rows (`bucket`: compiled.bucket)."""
    return bucket is None or bucket(rows) in (None, rows)


def verify_sizes(measured: dict[int, float], bucket=None) -> dict[int, float]:
    """Seconds per tree size of SIZES from base passes timed at `measured`'s row counts (with compiled forwards, 1
    included: the interpolation's start). bucket: the compiled forwards' rows -> the graph's rows (None past the
    largest graph: eager), or None for eager forwards. Where a compiled forward pads the rows into a larger graph,
    the size's cost is linear between the nearest row counts timed at their own rows (`runs_as_is`): a compiled
    round verifies its N nodes in a graph of N rows (round_graphs.py)."""
    exact = {n: s for n, s in measured.items() if runs_as_is(bucket, n)}
    return {n: exact[n] if n in exact else interpolated(exact, n) for n in SIZES}


def draft_costs(model, options: list[tuple], depth_max: int, log=None) -> list[dict[tuple[int, int], float]]:
    """Draft seconds per (depth, top_k) for each (head, CompiledDraft or None) of `options`, cached per machine +
    base + the options' heads (their dtypes included). Heads of several dtypes are timed in one sitting, shape by
    shape in turn, so that a machine's drift between two measurements never decides between them."""
    path = _draft_cache_path(model, options)
    saved = cost_cache.load(path)
    if saved is not None and saved["depth_max"] >= depth_max and "0,1" in saved["heads"][0]:
        runs = saved["heads"]
    else:
        t0 = time.perf_counter()
        measured = [{} for _ in options]
        # (0, 1): the 2-node tree's phase (the commit and the root's best child, no expansion: pick_tree)
        for d, k in [(0, 1), *((d, k) for d in range(1, depth_max + 1) for k in TOP_KS)]:
            for costs, option in zip(measured, options):
                costs.update(draft_seconds(model, [d], [k], head_and_graphs=option))
        runs = [{f"{d},{k}": s for (d, k), s in costs.items()} for costs in measured]
        cost_cache.save(path, {"depth_max": depth_max, "heads": runs})
        if log:
            heads = " and ".join(head.dtype_name for head, _ in options)
            log(f"tree tuner: measured {len(runs[0])} draft shapes ({heads} head{'s' if len(options) > 1 else ''}) "
                f"in {time.perf_counter() - t0:.1f} s (cached in {path})")  # fmt: skip
    return [{tuple(map(int, key.split(","))): s for key, s in run.items() if int(key.split(",")[0]) <= depth_max}
            for run in runs]  # fmt: skip


def _draft_cache_path(model, options: list[tuple]):
    """The draft costs' cache of `options` (head, graphs): keyed on the machine, the base and every option's head."""
    keys = [cost_cache.key(model, draft=option) for option in options]
    return cost_cache.folder() / f"{hashlib.sha256('+'.join(keys).encode()).hexdigest()[:20]}-drafts.json"


def forget_costs(model) -> None:
    """Drop the cached costs of the model's forwards and draft steps as they run now (measured under load, say)."""
    options = model.draft_options or [(model.ea_layer, model.compiled_draft)]
    for path in (cost_cache.path(model, "-verify", head=False), _draft_cache_path(model, options)):
        path.unlink(missing_ok=True)


PLAN_ROWS = (1, 2, 4, 8, 16)  # row counts timed per kernel; a count in between takes the next one up's kernel


TILING_ROWS = (1, 4, 8)  # a decode step and the verify passes of the trees a CPU runs


def interleaved_ms(model, options, in_force, rows) -> dict:
    """{option: {n: ms}}: a base forward over each of `rows` new tokens timed under each option (put in force by the
    context manager `in_force(option)`), in three interleaved rounds; the fastest round counts (these machines are
    noisy)."""
    ms: dict = {o: {} for o in options}
    for _ in range(3):
        for o in options:
            with in_force(o):
                for n, s in model.base.pass_seconds(list(rows), repeats=3).items():
                    ms[o][n] = min(ms[o].get(n, float("inf")), 1e3 * s)
    return ms


def panel_tiling(model, log=None) -> quant_panels.Tiling:
    """The panel kernel's tiling (quant_panels.tilings()) under which the base's forwards run fastest on this machine,
    for a base whose linears read GGUF blocks: each tiling times a base forward over each of TILING_ROWS new tokens,
    in interleaved rounds (the fastest round counts), and the least total wins. Measured once per machine + model,
    cached; the tiling in force is left as it was."""
    with quant_panels.tiled(quant_panels.default_tiling()):  # the cache key names the tiling measuring starts from
        path = cost_cache.path(model, "-tiling", head=False)
        saved = cost_cache.load(path)
        if saved is None:
            ms = interleaved_ms(model, quant_panels.tilings(), quant_panels.tiled, TILING_ROWS)
            best = min(ms, key=lambda t: sum(ms[t].values()))
            saved = {"tiling": list(best), "ms": [[list(t), {str(n): v for n, v in ms[t].items()}] for t in ms]}
            cost_cache.save(path, saved)
            if log:
                log("panel kernel tilings (wide tiles up to rows, prefetch bytes, non-temporal), ms per base forward "
                    + "over " + "/".join(map(str, TILING_ROWS)) + " rows: "
                    + "; ".join(f"{_tiling_name(t)}: " + "/".join(f"{v:.1f}" for v in ms[t].values())
                                for t in ms) + f"; using {_tiling_name(best)}")  # fmt: skip
    return quant_panels.Tiling(*saved["tiling"])


def _tiling_name(t: quant_panels.Tiling) -> str:
    return f"{t.wide_rows}, {t.prefetch}" + (", nta" if t.stream_nta else "")


def few_row_plan(model, log=None) -> dict[int, str]:
    """The fastest few-row kernel (`few_rows.py`) for each row count of a decode step or verify pass on this
    machine: every kernel times a base forward over each of PLAN_ROWS new tokens, in interleaved rounds (these
    machines are noisy; the fastest round counts). Timed once per machine + model, cached. The kernels' rank
    differs between CPUs (W @ x^T won a 1-row step on an AMD EPYC and lost on an Intel Xeon), so the plan is a
    measurement, never a CPU flag."""

    base = model.base_model
    path = cost_cache.path(model, "-few-row-plan")
    saved = cost_cache.load(path)
    if saved is None:
        in_force = few_rows.plan_of(base) or few_rows.DEFAULT_PLAN

        @contextlib.contextmanager
        def uniform(kernel):  # the plan restored once all are timed
            few_rows.set_plan(base, few_rows.uniform_plan(kernel))
            yield

        try:
            ms = interleaved_ms(model, few_rows.usable_kernels(), uniform, PLAN_ROWS)
        finally:
            few_rows.set_plan(base, in_force)
        saved = {"ms": {k: {str(n): t for n, t in v.items()} for k, v in ms.items()}}
        cost_cache.save(path, saved)
        if log:
            log("few-row kernels, ms per base forward over " + "/".join(map(str, PLAN_ROWS)) + " rows: "
                + "; ".join(f"{k} " + "/".join(f"{t:.0f}" for t in v.values()) for k, v in ms.items()))  # fmt: skip
    ms = {k: {int(n): t for n, t in v.items()} for k, v in saved["ms"].items()}
    plan = {}
    for rows in range(1, max(PLAN_ROWS) + 1):
        bucket = min(n for n in PLAN_ROWS if n >= rows)
        plan[rows] = min(ms, key=lambda k: ms[k][bucket])
    return plan


def faster_draft_dtype(model, candidate: torch.dtype = torch.bfloat16, log=None) -> torch.dtype:
    """The head's own dtype or `candidate`, whichever drafts faster here (a depth-3, width-4 draft phase timed in
    each; cached like the costs). Lossless either way: the head only proposes, the base verifies."""
    import copy

    own = model.ea_layer.fc.weight.dtype
    path = cost_cache.path(model, f"-draft-{str(candidate).replace('torch.', '')}")
    seconds = cost_cache.load(path)
    if seconds is None:
        other = (copy.deepcopy(model.ea_layer).to(candidate), None)
        seconds = {"own": draft_seconds(model, [3], [4], repeats=9)[(3, 4)],
                   "candidate": draft_seconds(model, [3], [4], repeats=9, head_and_graphs=other)[(3, 4)]}  # fmt: skip
        cost_cache.save(path, seconds)
        if log:
            log(f"draft phase (depth 3, width 4): {1e3 * seconds['own']:.1f} ms in {own}, "
                f"{1e3 * seconds['candidate']:.1f} ms in {candidate}")  # fmt: skip
    return candidate if seconds["candidate"] < seconds["own"] else own


def interpolated(costs: dict[int, float], rows: int) -> float:
    """Seconds of a pass over `rows` from costs measured at some row counts: linear between the nearest two (beyond
    the largest: the last slope)."""
    sizes = sorted(costs)
    if rows in costs:
        return costs[rows]
    upper = next((n for n in sizes if n > rows), sizes[-1])
    lower = max((n for n in sizes if n < upper), default=sizes[0])
    if upper == lower:
        return costs[upper]
    return costs[lower] + (rows - lower) * (costs[upper] - costs[lower]) / (upper - lower)


def tune(model, accept: list[list[float]], log=None, context: dict | None = None) -> TreeChoice:
    """Measure (or read the cached) costs and pick the tree for `model` with acceptance profile `accept`; where
    compiling left draft heads in two dtypes (`model.draft_options`), the tree and the dtype together, on the same
    verify costs (the choice's `option` says which; the caller puts it in use). With a context profile
    (context_draft.py), also the context chains' sizes for that tree on the same verify costs (those of passes timed
    at their own rows: with compiled forwards, the graphs' rows; the rest pad to a graph's or run eagerly), for
    float32 linears up to the most rows timed."""
    widest = len(accept[0])
    options = model.draft_options or [(model.ea_layer, model.compiled_draft)]
    verify = verify_costs(model, log)
    best = None
    drafts = draft_costs(model, options, len(accept), log)
    for option, ((head, _), draft) in enumerate(zip(options, drafts)):
        choice = pick_tree(accept, verify, {key: s for key, s in draft.items() if key[1] <= widest})
        choice = replace(choice, draft_dtype=head.dtype_name, option=option)
        if best is None or choice.tokens_per_s > best.tokens_per_s:
            best = choice
    choice = best
    if context is not None:
        n, compiled = choice.total_token, model.base.compiled
        exact = {rows: s for rows, s in verify.items() if compiled is None or compiled.bucket(rows) == rows}
        exact = exact if len(exact) > 1 else verify
        # float32 linears: no size past the rows timed (the panel kernel stops at 16 rows, then a GEMM); GGUF blocks
        # run one kernel at every row count, so their costs extend past them
        most = None if few_rows.reads_gguf_blocks(model.base_model) else max(exact)
        sizes = tuple(m for m in CHAINS if most is None or n + m <= most) or CHAINS[:1]
        chains = pick_chains(context, choice.tau, choice.seconds,
                             lambda m: interpolated(exact, n + m) - interpolated(exact, n), sizes)  # fmt: skip
        choice = replace(choice, chains=chains)
    return choice
