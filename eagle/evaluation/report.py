"""Aggregate per-question records into the benchmark result, and write it as JSON, a markdown table and a plot.

A record is one (question, turn, method) run: {"question_id", "category", "method", "turn" (1-based; 1 where
absent), "new_tokens", "seconds", "forwards" (base forward passes, prefill included, or None), "identical_to_hf"
(bool, or None where not checked)}, and where measured "prompt_tokens", "cached_tokens" (prompt tokens read from a
conversation's kept cache), "prefill_s" (seconds to the first token), "not_comparable_to_hf" /
"not_comparable_to_vanilla" (a later turn whose prompt ids differ from hf's / vanilla's: not checked).

Definitions (per method, over all its records, or those of one category):
- tokens_per_s          = sum(new_tokens) / sum(seconds)
- speedup_vs_hf         = tokens_per_s / tokens_per_s of `hf` on the same questions
- mean_accepted_tokens  = sum(new_tokens) / sum(forwards): tokens per base forward, the base's own token included
                          (the reference's tau, vLLM's mean acceptance length); null where forwards are unknown
- share_from_head       = Σ drafted tokens accepted from the head's tree / Σ new tokens (our EAGLE methods)
- share_from_context    = Σ accepted context drafts (copies of earlier text) / Σ new tokens; the rest of the tokens
                          are the base's own (one per forward)
- identical_to_hf       = "k/n": questions whose generated ids equal hf's (checked at temperature 0 only)
- identical_to_vanilla  = "k/n": questions whose generated ids equal our vanilla's (same weights and kernels;
                          temperature 0, where vanilla ran): EAGLE's losslessness at the precision in use
- agreement_with_hf     = Σ tokens before the first difference from hf / Σ hf's new tokens, over the checked
                          questions (1.0 when all are identical; for llama.cpp, whose arithmetic differs)
- speedup_vs_hf_reference_style = mean over questions of tokens/s, divided by hf's (the reference's speed.py)
- mean_prompt_tokens, mean_cached_tokens = means over the answers (cached: prompt tokens whose cache rows came from
                          the conversation's last turn, not prefilled); null where a record does not give them
- mean_prefill_ms       = mean time to the first token (the prefill of the uncached prompt and the first pick), ms
- decode_tokens_per_s   = Σ (new_tokens - 1) / Σ (seconds - prefill_s): decoding apart from the prefill
- not_comparable_to_hf, not_comparable_to_vanilla = answers not checked because their prompt differed (a later turn
                          after earlier answers that differed)
Each figure is given over all answers, per category, and per turn ("turns": [{"turn", "methods"}]); at --turns all a
question counts once per turn in the identical counts.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

BASELINE = "hf"
# other engines or precisions (eagle/evaluation/llamacpp.py): compared with hf, but left out of the overall
# "identical to hf" verdict, which is the losslessness check of our own decoders
PEERS = ("llama_cpp", "llama_cpp_f16", "llama_cpp_q4_1")


def _ratio(k: int, n: int) -> str | None:
    return f"{k}/{n}" if n else None


def _key(r: dict) -> tuple:
    """What a record answers: (question, turn)."""
    return r["question_id"], r.get("turn", 1)


def _mean(records: list[dict], key: str, scale: float = 1.0) -> float | None:
    """The mean of `key` over `records`; None unless every record gives it."""
    values = [r.get(key) for r in records]
    return scale * sum(values) / len(values) if values and None not in values else None


def _decode_rate(records: list[dict]) -> float | None:
    timed = [r for r in records if r.get("prefill_s") is not None and r["new_tokens"] >= 1]
    if not records or len(timed) < len(records):
        return None
    seconds = sum(r["seconds"] - r["prefill_s"] for r in timed)
    return sum(r["new_tokens"] - 1 for r in timed) / seconds if seconds > 0 else None


def _agreement(records: list[dict], hf_new: dict | None) -> float | None:
    """Σ tokens before the first difference / Σ hf's new tokens, over the records checked against hf."""
    checked = [r for r in records if r.get("identical_to_hf") is not None and hf_new and _key(r) in hf_new]
    total = sum(hf_new[_key(r)] for r in checked)
    same = [r["new_tokens"] if r["identical_to_hf"] else r.get("first_difference") for r in checked]
    return sum(same) / total if total and None not in same else None


def summarize(records: list[dict], hf_new: dict | None = None) -> dict:
    """Totals and rates of one method's records; `hf_new`: {(question_id, turn): hf's new tokens} for the
    agreement."""
    new = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    forwards = None if any(r["forwards"] is None for r in records) else sum(r["forwards"] for r in records)
    checked = [r["identical_to_hf"] for r in records if r.get("identical_to_hf") is not None]
    as_vanilla = [r["identical_to_vanilla"] for r in records if r.get("identical_to_vanilla") is not None]
    per_question = [r["new_tokens"] / r["seconds"] for r in records if r["seconds"] > 0]
    known = new and all(r.get("drafted_tokens") is not None for r in records)
    copied = sum(r["copied_tokens"] for r in records) if known else 0
    return {
        "questions": len(records),
        "new_tokens": new,
        "seconds": round(seconds, 6),
        "tokens_per_s": new / seconds if seconds > 0 else None,
        "mean_tokens_per_s_per_question": sum(per_question) / len(per_question) if per_question else None,
        "forwards": forwards,
        "mean_accepted_tokens": new / forwards if forwards else None,
        "identical_to_hf": _ratio(sum(checked), len(checked)),
        "identical_to_vanilla": _ratio(sum(as_vanilla), len(as_vanilla)),
        "agreement_with_hf": _agreement(records, hf_new),
        "share_from_head": (sum(r["drafted_tokens"] for r in records) - copied) / new if known else None,
        "share_from_context": copied / new if known else None,
        "mean_prompt_tokens": _mean(records, "prompt_tokens"),
        "mean_cached_tokens": _mean(records, "cached_tokens"),
        "mean_prefill_ms": _mean(records, "prefill_s", 1000.0),
        "decode_tokens_per_s": _decode_rate(records),
        "not_comparable_to_hf": sum(bool(r.get("not_comparable_to_hf")) for r in records),
        "not_comparable_to_vanilla": sum(bool(r.get("not_comparable_to_vanilla")) for r in records),
    }


def _add_speedups(stats: dict[str, dict]) -> None:
    for ref_name, key in ((BASELINE, "speedup_vs_hf"), ("vanilla", "speedup_vs_vanilla")):
        ref = stats.get(ref_name)
        for s in stats.values():
            ok = ref and ref["tokens_per_s"] and s["tokens_per_s"] is not None
            s[key] = s["tokens_per_s"] / ref["tokens_per_s"] if ok else None
            if key == "speedup_vs_hf":
                ok = ref and ref["mean_tokens_per_s_per_question"] and s["mean_tokens_per_s_per_question"]
                ratio = s["mean_tokens_per_s_per_question"] / ref["mean_tokens_per_s_per_question"] if ok else None
                s["speedup_vs_hf_reference_style"] = ratio


def aggregate(records: list[dict], methods: list[str]) -> dict:
    """{"methods": {name: stats, with "categories": {cat: stats}}, "identical_to_hf": "k/n" or None,
    "categories": [names in first-seen order], "turns": [{"turn": t, "methods": {name: stats}}, in turn order]}."""
    by_method: dict[str, list[dict]] = defaultdict(list)
    categories: list[str] = []
    for r in records:
        by_method[r["method"]].append(r)
        if r["category"] not in categories:
            categories.append(r["category"])
    hf_new = {_key(r): r["new_tokens"] for r in by_method.get(BASELINE, [])}
    stats = {m: summarize(by_method[m], hf_new) for m in methods if by_method[m]}
    _add_speedups(stats)
    for cat in categories:
        per_cat = {m: summarize([r for r in by_method[m] if r["category"] == cat], hf_new) for m in stats}
        per_cat = {m: s for m, s in per_cat.items() if s["questions"]}
        _add_speedups(per_cat)
        for m, s in per_cat.items():
            stats[m].setdefault("categories", {})[cat] = s
    turns = []
    for t in sorted({r.get("turn", 1) for r in records}):
        per_turn = {m: summarize([r for r in by_method[m] if r.get("turn", 1) == t], hf_new) for m in stats}
        per_turn = {m: s for m, s in per_turn.items() if s["questions"]}
        _add_speedups(per_turn)
        turns.append({"turn": t, "methods": per_turn})
    # overall: a question's turn counts as identical when every checked method (peers aside) reproduced hf's ids
    verdicts: dict[object, list[bool]] = defaultdict(list)
    for r in records:
        if r.get("identical_to_hf") is not None and r["method"] not in PEERS:
            verdicts[_key(r)].append(bool(r["identical_to_hf"]))
    overall = _ratio(sum(all(v) for v in verdicts.values()), len(verdicts))
    return {"identical_to_hf": overall, "methods": stats, "categories": categories, "turns": turns}


# ---------------------------------------------------------------------------------------------------------
def _fmt(x, digits=2, suffix="") -> str:
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def _floor_line(fl: dict | None) -> list[str]:
    if not fl:  # results from before the floor was measured
        return []
    return [f"**Bandwidth floor:** {fl['tokens_per_s']:.1f} tokens/s ({fl['weight_mb']:.0f} MB of weights per token "
            f"at {fl['bandwidth_gb_s']:.1f} GB/s measured); x floor = tokens/s ÷ that  "]  # fmt: skip


def _own_floor_lines(result: dict) -> list[str]:
    """Methods whose weights have another precision (llama.cpp F16, Q4_1) read fewer bytes per token: their own
    floor, from their weight bytes at the same measured bandwidth."""
    lines = []
    for name, m in result["methods"].items():
        if m.get("own_floor_tokens_per_s"):
            lines.append(f"- {name}: {m['weight_mb']:.0f} MB per token, its own floor "
                         f"{m['own_floor_tokens_per_s']:.1f} tokens/s, x own floor {_fmt(m.get('x_own_floor'))}")
    return ["", "x floor above is against the fp32 floor; at their own precision:", "", *lines] if lines else []


def _weights(result: dict) -> str:
    return result["model"].get("weights") or "fp32"


def _unchecked(result: dict) -> str:
    peers = [n for n, m in result["methods"].items() if n in PEERS and m.get("identical_to_hf")]
    return f"only the peers {', '.join(peers)} were compared (per row below)" if peers else "not checked"


def markdown(result: dict) -> str:
    """A self-contained markdown report: settings, the overall table, the per-category table."""
    s, m = result["settings"], result["model"]
    dtypes = m["dtype"] if m.get("draft_dtype", m["dtype"]) == m["dtype"] else f"{m['dtype']}, head {m['draft_dtype']}"
    if m.get("weights") not in (None, "fp32"):
        dtypes += f", weights {m['weights']}"
    lines = [f"**{result['label']}**", ""] if result.get("label") else []
    lines += [
        f"**Machine:** {result['device']}  ",
        f"**Date:** {result['date']}  ",
        f"**Model:** base `{m['base']}`, head `{m['head']}` "
        f"({'EAGLE-3' if m.get('eagle3') else 'EAGLE-1/2'} head, {dtypes})  ",
        f"**Questions:** {result['questions']} from {s['questions_from']} ({_turns_note(result)}), "
        f"max_new_tokens={s['max_new_tokens']}, temperature={s['temperature']}, "
        f"EAGLE-2 tree total_token={s['total_token']} depth={s['depth']} top_k={s['top_k']}  ",
        f"**Identical to hf (T=0):** {result['identical_to_hf'] or _unchecked(result)}  ",
        *_floor_line(result.get("floor")),
        f"**Command:** `{result['command']}`",
        "",
        "| method | tokens/s | x floor | speedup vs hf | mean accepted tokens / base forward | identical to hf "
        "| agreement with hf | new tokens | seconds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    labels = result.get("method_labels") or {}
    for name, m in result["methods"].items():
        agree = m.get("agreement_with_hf")
        lines.append(
            f"| {name}{f' ({labels[name]})' if name in labels else ''} | {_fmt(m['tokens_per_s'], 1)} | "
            f"{_fmt(m.get('x_floor'))} | {_fmt(m['speedup_vs_hf'], 2, 'x')} | "
            f"{_fmt(m['mean_accepted_tokens'])} | {m['identical_to_hf'] or '–'} | "
            f"{'–' if agree is None else f'{100 * agree:.1f}%'} | {m['new_tokens']} | {_fmt(m['seconds'], 2)} |"
        )
    lines += _own_floor_lines(result)
    same = [f"{n} {m['identical_to_vanilla']}" for n, m in result["methods"].items() if m.get("identical_to_vanilla")]
    if same:
        lines += ["", f"Identical to our vanilla (T=0, weights {_weights(result)}): {', '.join(same)}"]
    sources = [f"{n} {100 * m['share_from_head']:.0f}% head drafts, {100 * m['share_from_context']:.0f}% context "
               "copies" for n, m in result["methods"].items() if m.get("share_from_head") is not None
               and m.get("mean_accepted_tokens") and m["mean_accepted_tokens"] > 1]  # fmt: skip
    if sources:
        lines += ["", f"Tokens by source (the rest: the base's own): {'; '.join(sources)}"]
    cats = result.get("categories") or []
    if cats:
        names = list(result["methods"])
        lines += ["", "Per category: speedup vs hf (mean accepted tokens per base forward)", ""]
        lines.append("| category | " + " | ".join(names) + " |")
        lines.append("|---|" + "---:|" * len(names))
        for cat in cats:
            cells = []
            for name in names:
                c = result["methods"][name].get("categories", {}).get(cat)
                if c is None:
                    cells.append("–")
                    continue
                tau = f" ({_fmt(c['mean_accepted_tokens'])})" if c["mean_accepted_tokens"] is not None else ""
                cells.append(_fmt(c["speedup_vs_hf"], 2, "x") + tau)
            lines.append(f"| {cat} | " + " | ".join(cells) + " |")
    lines += _turn_table(result)
    return "\n".join(lines) + "\n"


def _turns_note(result: dict) -> str:
    if result["settings"].get("turns") != "all":
        return "first turns"
    answers = max((m["questions"] for m in result["methods"].values()), default=0)
    return f"every turn, each method after its own earlier answers: {answers} answers per method"


def _identical_cell(m: dict) -> str:
    cell = m.get("identical_to_vanilla") or "–"
    if m.get("not_comparable_to_vanilla"):
        cell += f" ({m['not_comparable_to_vanilla']} not comparable)"
    return cell


def _turn_table(result: dict) -> list[str]:
    """Per turn and method: rates, tokens per forward, prompt and cached tokens, time to the first token."""
    turns = result.get("turns") or []
    if not turns:  # results from before the per-turn figures
        return []
    lines = ["", "Per turn: prompt and cached tokens are means per answer (cached: read from the conversation's kept "
             "cache, not prefilled); time to first token = the prefill of the rest and the first pick; decode "
             "tokens/s = the tokens after the first over the time after it", "",
             "| turn | method | answers | tokens/s | speedup vs vanilla | tokens / forward | prompt tokens "
             "| cached tokens | time to first token (ms) | decode tokens/s | identical to vanilla |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for entry in turns:
        for name, m in entry["methods"].items():
            lines.append(
                f"| {entry['turn']} | {name} | {m['questions']} | {_fmt(m['tokens_per_s'], 1)} | "
                f"{_fmt(m.get('speedup_vs_vanilla'), 2, 'x')} | {_fmt(m['mean_accepted_tokens'])} | "
                f"{_fmt(m.get('mean_prompt_tokens'), 0)} | {_fmt(m.get('mean_cached_tokens'), 0)} | "
                f"{_fmt(m.get('mean_prefill_ms'), 1)} | {_fmt(m.get('decode_tokens_per_s'), 1)} | "
                f"{_identical_cell(m)} |"
            )
    return lines


def plot(result: dict, path: str) -> None:
    """PNG: speedup vs hf and mean accepted length, per method (top) and per category (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result["methods"]
    names = list(methods)
    cats = result.get("categories") or []
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), squeeze=False, layout="constrained")
    panels = [("speedup_vs_hf", "speedup vs hf (x)"), ("mean_accepted_tokens", "mean accepted tokens / base forward")]
    for col, (key, label) in enumerate(panels):
        ax = axes[0][col]
        values = [methods[n][key] or 0.0 for n in names]
        bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
        for bar, n in zip(bars, names):
            value = methods[n][key]
            ax.annotate("n/a" if value is None else f"{value:.2f}", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{label}, all questions")
        ax.tick_params(axis="x", rotation=20)
        ax = axes[1][col]
        width = 0.8 / max(len(names), 1)
        for i, n in enumerate(names):
            per = methods[n].get("categories", {})
            ys = [(per.get(c) or {}).get(key) or 0.0 for c in cats]
            ax.bar([j + i * width for j in range(len(cats))], ys, width, label=n, color=f"C{i}")
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(cats))], cats, rotation=20)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{label}, per category")
        ax.legend(fontsize=7)
    model = result["model"]
    title = (f"{os.path.basename(model['base'].rstrip('/'))} + head {os.path.basename(model['head'].rstrip('/'))}: "
             f"{result['questions']} questions, max_new_tokens={result['settings']['max_new_tokens']}, "
             f"T={result['settings']['temperature']}\n{result['device']}")  # fmt: skip
    if result.get("label"):
        title = f"{result['label']}\n{title}"
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, out_dir: str, json_path: str | None = None) -> dict[str, str]:
    """bench.json (or json_path), bench.md and bench.png under out_dir; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": json_path or os.path.join(out_dir, "bench.json"),
        "markdown": os.path.join(out_dir, "bench.md"),
        "plot": os.path.join(out_dir, "bench.png"),
    }
    if os.path.dirname(paths["json"]):
        os.makedirs(os.path.dirname(paths["json"]), exist_ok=True)
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=2)
    with open(paths["markdown"], "w") as f:
        f.write(markdown(result))
    plot(result, paths["plot"])
    return paths


def main(argv: list[str] | None = None) -> None:
    """Re-render bench.md and bench.png from a bench JSON: python -m eagle.evaluation.report out/bench/bench.json"""
    import argparse

    p = argparse.ArgumentParser(prog="python -m eagle.evaluation.report", description=main.__doc__)
    p.add_argument("json_path")
    p.add_argument("--out", default=None, help="folder for bench.md and bench.png (default: the JSON's folder)")
    args = p.parse_args(argv)
    with open(args.json_path) as f:
        result = json.load(f)
    out = args.out or os.path.dirname(os.path.abspath(args.json_path))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(markdown(result))
    plot(result, os.path.join(out, "bench.png"))
    print(markdown(result))


if __name__ == "__main__":
    main()
