"""Figures of a generation run (tokens/s, tokens per base forward, ...) and their HTML panel.

Definitions (also shown on the page):
- tokens/s = new tokens / decoding time, where decoding time is the sum of the rounds' wall times
  (prefill included; the time the page spends rendering between rounds is not);
- time to first token = from the generation's start to its first token (the prompt's prefill, of the tokens past
  those the conversation's kept cache held: "from the cache"); decoding tokens/s = the tokens after the first over
  the rounds after the first (the prefill excluded);
- mean accepted tokens per base forward = new tokens / rounds (one round = one forward pass of the base
  model; vanilla decoding gives exactly 1);
- speedup = EAGLE tokens/s / vanilla tokens/s, each decoder timed on its own;
- shares of the new tokens by source: the base's own token of each forward, drafts of the head accepted, context
  copies accepted (context drafts: earlier text offered beside the head's drafts); they add up to 1.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from eagle.decoding.generate import Round

STOP_WORDS = {
    "eos": "end of reply", "max_new_tokens": "max new tokens reached", "max_length": "context full",
    "stopped": "stopped by you", "error": "error",
}  # fmt: skip


SHARES = ("share_from_base", "share_from_head", "share_from_context")  # the figures' keys of the shares by source


@dataclass
class RunStats:
    eagle: bool = True
    new_tokens: int = 0
    rounds: int = 0
    accepted: int = 0  # draft tokens accepted, over all rounds (the head's and context copies)
    context: int = 0  # of those, context copies
    seconds: float = 0.0
    first_round_s: float = 0.0  # the prefill's round: the same base pass whichever the decoder
    first_token_s: float = 0.0  # from the generation's start to its first token (leasing and kept rows included)
    cached: int = 0  # prompt tokens read from the conversation's kept cache, not prefilled
    stop: str | None = None

    def add(self, r: Round) -> None:
        if not self.rounds:
            self.first_round_s, self.first_token_s, self.cached = r.seconds, r.prefill_s or r.seconds, r.cached
        self.new_tokens += len(r.tokens)
        self.rounds += 1
        self.accepted += r.accepted
        self.context += r.context
        self.seconds += r.seconds
        self.stop = r.stop or self.stop

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the rounds after the first: decoding without the prefill."""
        after = self.seconds - self.first_round_s
        return (self.new_tokens - 1) / after if self.rounds > 1 and after > 0 else None

    @property
    def mean_accepted(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    def shares(self) -> dict[str, float | None]:
        """The new tokens' shares by source (base, head, context: they add up to 1); None before any token."""
        n = self.new_tokens
        if not n:
            return dict.fromkeys(SHARES)
        counts = (n - self.accepted, self.accepted - self.context, self.context)
        return {k: round(c / n, 4) for k, c in zip(SHARES, counts)}

    def as_dict(self) -> dict:
        return {
            "mode": "eagle" if self.eagle else "vanilla",
            "tokens_per_s": round(self.tokens_per_s, 2),
            "mean_accepted_tokens_per_forward": round(self.mean_accepted, 3),
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "draft_tokens_accepted": self.accepted,
            "context_tokens_accepted": self.context,
            **self.shares(),
            "elapsed_s": round(self.seconds, 3),
            "time_to_first_token_s": round(self.first_token_s, 4) if self.rounds else None,
            "prompt_tokens_cached": self.cached,
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2) if self.decode_tokens_per_s else None,
            "stop": self.stop,
        }


def with_vanilla(figures: dict, vanilla_tps: float | None, source: str | None) -> dict:
    """Add the vanilla reference and the speedup (EAGLE runs only) to a figures dict."""
    out = dict(figures)
    out["vanilla_tokens_per_s"] = round(vanilla_tps, 2) if vanilla_tps else None
    out["vanilla_source"] = source
    eagle_tps = figures.get("tokens_per_s") or 0.0
    ok = vanilla_tps and figures.get("mode") == "eagle" and eagle_tps > 0
    out["speedup"] = round(eagle_tps / vanilla_tps, 2) if ok else None
    return out


# ---------------------------------------------------------------------------------------------------------
def _num(v, fmt="{:.2f}", unit=""):
    return "–" if v is None else fmt.format(v) + unit


def _percent(share) -> str | None:
    return f"{100 * share:.0f}%" if isinstance(share, (int, float)) and not isinstance(share, bool) else None


def _first_token(fig: dict) -> str:
    """The time to the first token and the prompt tokens the kept cache gave ("0.04 s (1,962 of 1,990 cached)")."""
    seconds = fig.get("time_to_first_token_s")
    if not isinstance(seconds, (int, float)):
        return "–"
    cached, prompt = fig.get("prompt_tokens_cached") or 0, fig.get("prompt_tokens")
    of = f" ({cached:,} of {prompt:,} prompt tokens cached)" if cached and isinstance(prompt, int) else ""
    return f"{seconds:.2f} s{of}"


def _context(fig: dict) -> str:
    """How much of the model's context the conversation fills with this reply ("1,234 of 8,192 tokens (15%)")."""
    used, limit = fig.get("context_tokens"), fig.get("context_limit")
    if not isinstance(used, int) or not isinstance(limit, int) or limit <= 0:
        return "–"
    return f"{used:,} of {limit:,} tokens ({100 * used / limit:.0f}%)"


def shares_text(fig: dict) -> str:
    """The new tokens by source in words ("62% base, 28% head drafts, 10% context copies"), or "" when `fig` has no
    shares."""
    parts = [_percent(fig.get(k)) for k in SHARES]
    if None in parts:
        return ""
    return f"{parts[0]} base, {parts[1]} head drafts, {parts[2]} context copies"


def shares_html(fig: dict) -> str:
    """`shares_text` with each accepted source in its highlight's shade (the legend's), or "" without shares."""
    parts = [_percent(fig.get(k)) for k in SHARES]
    if None in parts or fig.get("mode") != "eagle":
        return ""
    head = f'<span class="acc">{parts[1]} head drafts</span>'
    context = f'<span class="ctx">{parts[2]} context copies</span>'
    return f'<div class="fig-shares">new tokens: {parts[0]} base · {head} · {context}</div>'


def figures_html(fig: dict | None, running: bool = False) -> str:
    """The live figures panel."""
    fig = fig or {}
    mode = fig.get("mode")
    title = {"eagle": "EAGLE", "vanilla": "Vanilla (EAGLE off)"}.get(mode, "No reply yet")
    status = "generating…" if running else STOP_WORDS.get(fig.get("stop") or "", "")
    rows = [
        ("mean accepted tokens / base forward", _num(fig.get("mean_accepted_tokens_per_forward"), "{:.2f}")),
        ("rounds (base forwards)", _num(fig.get("rounds"), "{:d}")),
        ("new tokens", _num(fig.get("new_tokens"), "{:d}")),
        ("elapsed (decoding)", _num(fig.get("elapsed_s"), "{:.2f}", " s")),
        ("time to first token", _first_token(fig)),
        ("tokens/s after the first", _num(fig.get("decode_tokens_per_s"))),
        ("vanilla tokens/s", _num(fig.get("vanilla_tokens_per_s"))),
        ("forwards", {"compiled": "compiled rounds", "eager": "eager"}.get(fig.get("forwards") or "", "–")),
        ("context used", _context(fig)),
    ]
    body = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    speedup = fig.get("speedup")
    source = fig.get("vanilla_source") or (
        "no vanilla figure yet: run the side-by-side tab, or tick “time vanilla too”" if mode == "eagle" else ""
    )
    notice = fig.get("notice")
    parts = [
        f'<div class="eagle-figures"><div class="fig-title">{html.escape(title)}'
        f'<span class="fig-status">{html.escape(status)}</span></div>',
        f'<div class="fig-big">{_num(fig.get("tokens_per_s"))}<small> tokens/s</small></div>',
        f'<div class="fig-speedup{" slower" if speedup < 1 else ""}">speedup {_num(speedup, "{:.2f}", "×")}</div>'
        if speedup else "",
        f"<table>{body}</table>",
        shares_html(fig),
        f'<div class="fig-note">vanilla: {html.escape(source)}</div>' if source else "",
        f'<div class="fig-notice">{html.escape(notice)}</div>' if notice else "",
        "</div>",
    ]
    return "".join(parts)
