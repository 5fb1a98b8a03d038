"""One OpenAI API request's generation, without HTTP: its prompt built as the page builds it (`prepare`), then the
engine's rounds in the model's one queue, the text cut at its stop strings, and the speculative figures of the
reply (`generate`, events `Delta` ... `Done`).

The figures (`Done.timings`) follow llama.cpp server's `timings` object and keep its names (prompt_n, prompt_ms,
prompt_per_second, predicted_n, predicted_ms, predicted_per_second, cache_n, draft_n, draft_n_accepted), with this
engine's own beside them: rounds (base forwards), tokens_per_forward, tokens_per_second (the page's tokens/s),
draft_n_accepted_head + draft_n_accepted_context = draft_n_accepted, predicted_n_base (the base's own tokens; with
draft_n_accepted it adds up to predicted_n, the reply's tokens), and the vanilla reference and speedup as the page
gives them while a reply streams. docs/openai-api.md defines each.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Iterator

from eagle.chat.templates import PromptTooLong
from eagle.decoding.generate import Round
from eagle.decoding.round_steps import TreeShape

from .engine import EngineBusy
from .highlight import Detokenizer
from .openai_schema import APIError, Request
from .session import clean_text, conversation_key, reference_figures
from .stats import RunStats, with_vanilla
from .stop_text import StopText

FINISH = {"eos": "stop", "max_new_tokens": "length", "max_length": "length"}
COMPLETION_KEY_TOKENS = 64  # a completion's caches are kept under its prompt's first ids (a growing text resent)


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish_reason: str | None  # "stop" (end of reply or a stop string), "length", None (stopped: the client left)
    usage: dict
    timings: dict


@dataclass
class Prepared:
    ids: list[int]
    max_tokens: int
    conversation: tuple | None = None  # the key its caches are kept under between requests (session.conversation_key)


# the prompt ---------------------------------------------------------------------------------------------
def too_long(engine, tokens: int, max_tokens: int, param: str) -> APIError:
    room = engine.prompt_room(max_tokens)
    return APIError(400, f"This model's maximum context length is {engine.max_length} tokens, of which "
                    f"{engine.max_length - room} are kept for the reply (max_tokens {max_tokens}, at most half the "
                    f"context): the prompt may have {room} tokens, but it has {tokens}. Shorten the {param} or lower "
                    "max_tokens.", param, "context_length_exceeded")  # fmt: skip


def prepare(engine, req: Request, default_max_tokens: int) -> Prepared:
    """The prompt's token ids: a chat's built with the model's chat template by `Engine.fit`, as the page builds
    them (the same cleaning, the app's default system prompt where the messages give none); a completion's prompt
    read as it is. A prompt that leaves no room for the reply is refused with the counts (the page would drop the
    oldest turns; an API caller is told instead, as OpenAI does)."""
    max_tokens = req.max_tokens or default_max_tokens
    if req.kind == "chat":
        turns = [(clean_text(u), None if r is None else clean_text(r)) for u, r in req.turns]
        system = engine.default_system if req.system is None else clean_text(req.system)
        try:
            fit = engine.fit(turns, system, max_tokens)
        except PromptTooLong:
            raise too_long(engine, len(engine.prompt_ids(turns, system)), max_tokens, "messages") from None
        except Exception as e:  # a template that rejects this conversation
            raise APIError(400, f"the model's chat template cannot build this conversation: {type(e).__name__}: {e}",
                           "messages", "invalid_prompt") from None  # fmt: skip
        if fit.dropped:
            raise too_long(engine, len(engine.prompt_ids(turns, system)), max_tokens, "messages")
        # a client resends the whole conversation each turn: the next request reads this one's rows
        return Prepared(fit.ids, max_tokens, conversation_key("api", system, turns, turns[-1][0]))
    if isinstance(req.prompt, tuple):
        ids = list(req.prompt)
    else:
        ids = list(engine.tokenizer(clean_text(req.prompt), add_special_tokens=True)["input_ids"])
    if not ids:
        raise APIError(400, "prompt is empty: give at least one token of text", "prompt", "invalid_value")
    if len(ids) > engine.prompt_room(max_tokens):
        raise too_long(engine, len(ids), max_tokens, "prompt")
    return Prepared(ids, max_tokens, ("completion", tuple(ids[:COMPLETION_KEY_TOKENS])))


# the reply ----------------------------------------------------------------------------------------------
def head_nodes(model) -> int:
    """Draft tokens the head proposes in a round: its tree's nodes, the root (the base's token) left out."""
    tree = model.tree
    if tree.choices:
        return len(tree.choices)
    return TreeShape.of(tree.total_token, tree.depth, tree.top_k).nodes - 1


def cut_round(r: Round, kept: int) -> Round:
    """`r` with its first `kept` tokens only (a stop string ended the reply inside it): the head's accepted tokens
    come first in a round, then the context copies, then the base's own (highlight.token_sources)."""
    if kept >= len(r.tokens):
        return r
    accepted = min(r.accepted, kept)
    head = min(max(0, r.accepted - r.context), kept)
    return replace(r, tokens=r.tokens[:kept], accepted=accepted, context=accepted - head)


@dataclass
class Figures:
    """The counts of one reply, round by round."""

    prompt_tokens: int
    eagle: bool
    stats: RunStats = field(init=False)  # its first round's: the prompt tokens cached, the time to the first token
    drafted: int = 0
    path: str | None = None

    def __post_init__(self):
        self.stats = RunStats(eagle=self.eagle)

    def add(self, r: Round, kept: int, nodes: int) -> None:
        """Round `r`, of which the first `kept` tokens are the reply's; `nodes`: the head's draft tokens in it."""
        if self.stats.rounds and self.eagle:
            self.drafted += nodes
        self.stats.add(cut_round(r, kept))

    def usage(self) -> dict:
        n = self.stats.new_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": self.stats.cached}}  # fmt: skip

    def timings(self, engine) -> dict:
        s, n = self.stats, self.stats.new_tokens
        after = max(0.0, s.seconds - s.first_round_s)  # the rounds after the prefill
        prompt_n, prompt_s = self.prompt_tokens - s.cached, s.first_token_s
        page = with_vanilla(s.as_dict(), *reference_figures(engine, self.path, s))
        return {
            # llama.cpp server's names
            "prompt_n": prompt_n, "prompt_ms": _ms(prompt_s),
            "prompt_per_second": _rate(prompt_n, prompt_s), "predicted_n": n, "predicted_ms": _ms(after),
            "predicted_per_second": _rate(n, after), "cache_n": s.cached,
            "draft_n": self.drafted, "draft_n_accepted": s.accepted,
            # this engine's
            "draft_n_accepted_head": s.accepted - s.context, "draft_n_accepted_context": s.context,
            "predicted_n_base": n - s.accepted, "rounds": s.rounds,
            "tokens_per_forward": round(n / s.rounds, 3) if s.rounds else None,
            "tokens_per_second": _rate(n, s.seconds), "vanilla_tokens_per_second": page["vanilla_tokens_per_s"],
            "speedup": page["speedup"], "vanilla_source": page["vanilla_source"], "use_eagle": self.eagle,
            "forwards": self.path,
        }  # fmt: skip


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 3)


def _rate(count: int, seconds: float) -> float | None:
    return round(count / seconds, 2) if seconds > 0 and count else None


def generate(engine, req: Request, prep: Prepared, ticket=None,
             cancelled: threading.Event | None = None) -> Iterator[Delta | Done]:  # fmt: skip
    """The reply's text as it is decided (a `Delta` per round that adds any), then `Done`. The model is taken in
    the queue from `ticket`; when `cancelled` is set the reply ends after the round in progress (Done with
    finish_reason None). Raises model_queue.Withdrawn when the place was given up before its turn, APIError 503 when
    the model could not be had."""
    figures, detok, cut = Figures(len(prep.ids), req.use_eagle), Detokenizer(engine.tokenizer), StopText(req.stop)
    finish, nodes = None, None
    rounds = engine.rounds(prep.ids, eagle=req.use_eagle, temperature=req.temperature, top_p=req.top_p,
                           top_k=req.top_k, max_new_tokens=prep.max_tokens, context_drafts=req.context_drafts,
                           ticket=ticket, seed=req.seed, cancel=cancelled,
                           conversation=prep.conversation)  # fmt: skip
    try:
        for r in rounds:
            if figures.path is None:  # read after the first round, when it cannot change (Engine.path)
                figures.path, nodes = engine.path, head_nodes(engine.model) if req.use_eagle else 0
            text, kept = "", 0
            for token in r.tokens:
                kept += 1
                text += cut.add(detok.push(token))
                if cut.hit is not None:
                    break
            figures.add(r, kept, nodes)
            if text:
                yield Delta(text)
            if cut.hit is not None or r.stop:
                finish = "stop" if cut.hit is not None else FINISH.get(r.stop, "stop")
                break
            if cancelled is not None and cancelled.is_set():
                break
    except EngineBusy as e:
        headers = {"Retry-After": str(getattr(e, "retry_after_s", 5))}
        raise APIError(503, f"The model is busy: {e}", None, "model_busy", headers) from None
    finally:
        rounds.close()
    if tail := cut.finish():
        yield Delta(tail)
    yield Done(finish, figures.usage(), figures.timings(engine))
