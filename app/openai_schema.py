"""Requests of the OpenAI-compatible API, checked: what `/v1/chat/completions` and `/v1/completions` accept, and
the errors in OpenAI's shape for what they do not (docs/openai-api.md lists both).

Pure: a parsed JSON body in, a `Request` (or an `APIError` naming the parameter, the value and what is allowed)
out. Nothing a client sends raises anything else. Fields that this server cannot honour are refused by name (`n`
other than 1, tools, logprobs, penalties...); fields it does not know are ignored, as vLLM and llama.cpp's server
ignore them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_STOPS, MAX_STOP_CHARS = 4, 1000  # OpenAI's "up to 4 sequences"; a bound on each one's length
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions' default max_tokens, as OpenAI's
IGNORED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier",
           "prompt_cache_key", "reasoning_effort", "verbosity", "prediction", "web_search_options")  # fmt: skip


class APIError(Exception):
    """An error response: `status` and OpenAI's body {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
             503: "server_error"}  # fmt: skip

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


@dataclass(frozen=True)
class Request:
    """One checked request. Chat: `turns` ((user, reply) pairs, the last reply None) and `system` (None = the app's
    default system prompt). Completion: `prompt`, a text or token ids."""

    kind: str  # "chat" or "completion"
    model: str
    max_tokens: int | None  # None: the endpoint's default
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    use_eagle: bool = True
    context_drafts: bool = True
    turns: tuple = ()
    system: str | None = None
    prompt: str | tuple[int, ...] = ""


# values -------------------------------------------------------------------------------------------------
def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def number(body: dict, key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad(key, f"{key} must be a number from {lo:g} to {hi:g}; got {_show(v)}")
    return float(v)


def integer(body: dict, key: str, lo: int, hi: int | None, default: int | None, what: str = "") -> int | None:
    v = body.get(key)
    if v is None:
        return default
    whole = isinstance(v, int) or isinstance(v, float) and math.isfinite(v) and v == int(v)
    if isinstance(v, bool) or not whole or int(v) < lo or (hi is not None and int(v) > hi):
        allowed = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
        raise bad(key, f"{key} must be an integer {allowed}{what}; got {_show(v)}")
    return int(v)


def flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(key, f"{key} must be true or false; got {_show(v)}")
    return v


def stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("stop", f"stop must be a string or a list of strings; got {_show(v)}")
    if len(items) > MAX_STOPS:
        raise bad("stop", f"stop takes at most {MAX_STOPS} strings; got {len(items)}")
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters; got {_show(s)}")
    return tuple(items)


def refuse_unsupported(body: dict, extra: dict) -> None:
    """Fields that would change the reply in ways this server cannot: refused unless at their neutral value."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad("n", f"n={_show(n)} is not supported: this server returns one choice per request (n must be 1)",
                  "unsupported_value")  # fmt: skip
    neutral = {"logprobs": (None, False), "top_logprobs": (None,), "frequency_penalty": (None, 0),
               "presence_penalty": (None, 0), "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
               "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"), "audio": (None,),
               "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]), **extra}  # fmt: skip
    for key, ok in neutral.items():
        v = body.get(key)
        if not any(_same(v, x) for x in ok):
            allowed = " or ".join("null" if x is None else _show(x) for x in ok)
            raise bad(key, f"{key}={_show(v)} is not supported by this server (allowed: {allowed})",
                      "unsupported_parameter")  # fmt: skip


def _same(v, x) -> bool:
    """v is the neutral value x (0 and 0.0 alike; false is not 0)."""
    if x is None or isinstance(x, bool) or isinstance(v, bool):
        return v is x
    if isinstance(x, (int, float)):
        return isinstance(v, (int, float)) and v == x
    return v == x


def _model(body: dict) -> str:
    m = body.get("model")
    if not isinstance(m, str) or not m:
        raise bad("model", "you must give a model: a string, one of GET /v1/models' ids", "missing_model")
    return m


def _common(body, kind: str, max_context: int) -> dict:
    refuse_unsupported(body, {"echo": (None, False), "suffix": (None,), "best_of": (None, 1)}
                       if kind == "completion" else {})  # fmt: skip
    tokens = integer(body, "max_tokens", 1, max_context, None, " (the model's context)")
    if kind == "chat":
        newer = integer(body, "max_completion_tokens", 1, max_context, None, " (the model's context)")
        if tokens is not None and newer is not None and tokens != newer:
            raise bad("max_completion_tokens", f"max_tokens ({tokens}) and max_completion_tokens ({newer}) differ: "
                      "give one of them")  # fmt: skip
        tokens = newer if newer is not None else tokens
    stream = flag(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not stream:
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", f"stream_options must be an object; got {_show(options)}")
    temperature, top_p = number(body, "temperature", 0, 2, 1.0), number(body, "top_p", 0, 1, 1.0)
    if top_p == 0:  # keeps only the most likely token (this engine reads top_p 0 as "off")
        temperature, top_p = 0.0, 1.0
    return dict(
        model=_model(body), kind=kind, max_tokens=tokens, temperature=temperature, top_p=top_p,
        top_k=integer(body, "top_k", 0, None, 0), seed=integer(body, "seed", -(2**63), 2**64 - 1, None),
        stop=stops(body), stream=stream, include_usage=flag(options or {}, "include_usage", False),
        use_eagle=flag(body, "use_eagle", True), context_drafts=flag(body, "context_drafts", True),
    )  # fmt: skip


def model_of(body) -> str:
    """The model a request names (checked first: an unknown one is a 404 whatever else is wrong)."""
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object; got {type(body).__name__}", "invalid_body")
    return _model(body)


# chat ---------------------------------------------------------------------------------------------------
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def content_text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined with newlines, as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad(where, f"{where} must be a string or a non-empty list of text parts; got {_show(content)}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            got = f"type {_show(kind)}" if isinstance(part, dict) else _show(part)
            raise bad(f"{where}[{j}]", f"{where}[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}} "
                      f"(this model reads text only); got {got}", "unsupported_content")  # fmt: skip
        texts.append(part["text"])
    return "\n".join(texts)


def conversation(msgs) -> tuple[tuple, str | None]:
    """(turns, system) from OpenAI messages. System (and developer) messages make the system prompt, joined by blank
    lines, wherever they stand; consecutive messages of one role are joined by blank lines; the rest must alternate
    user, assistant, ..., and end with the user's message to answer."""
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", f"messages must be a non-empty list of messages; got {_show(msgs)}")
    system, said = [], []  # said: [role, text] of the user and assistant messages, merged
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object with a role and a content; got {_show(m)}")
        role = ROLES.get(m.get("role")) if isinstance(m.get("role"), str) else None
        if role is None:
            raise bad(f"{where}.role", f"{where}.role must be one of system, developer, user, assistant (this "
                      f"server has no tools); got {_show(m.get('role'))}", "unsupported_role")  # fmt: skip
        if m.get("tool_calls") or m.get("function_call"):
            raise bad(f"{where}.tool_calls", f"{where} has tool calls: this server has no tools", "unsupported_role")
        text = content_text(m.get("content"), f"{where}.content")
        if role == "system":
            system.append(text)
        elif said and said[-1][0] == role:
            said[-1][1] += "\n\n" + text
        else:
            said.append([role, text])
    if not said or said[0][0] != "user":
        raise bad("messages", "the conversation must start with a user message (after any system messages)")
    if said[-1][0] != "user":
        raise bad("messages", "the last message must be the user's (role user): this server answers it; it does "
                  "not continue an assistant message")  # fmt: skip
    turns = tuple((said[i][1], said[i + 1][1] if i + 1 < len(said) else None) for i in range(0, len(said), 2))
    return turns, "\n\n".join(system) if system else None


def chat_request(body: dict, max_context: int) -> Request:
    common = _common(body, "chat", max_context)
    turns, system = conversation(body.get("messages"))
    return Request(**common, turns=turns, system=system)


# completions --------------------------------------------------------------------------------------------
def completion_request(body: dict, max_context: int, vocab: int) -> Request:
    common = _common(body, "completion", max_context)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab for t in prompt):
            raise bad("prompt", f"prompt token ids must be from 0 to {vocab - 1} (the model's vocabulary)")
        return Request(**common, prompt=tuple(prompt))
    if not isinstance(prompt, str):
        raise bad("prompt", "prompt must be a string, a list of token ids, or a list of one of either (this server "
                  f"completes one prompt per request); got {_show(prompt)}")  # fmt: skip
    return Request(**common, prompt=prompt)
