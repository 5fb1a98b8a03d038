"""The OpenAI-compatible API on the page's own server and port (and its --share link): `POST /v1/chat/completions`,
`POST /v1/completions` (each streamed as server-sent events, or not), `GET /v1/models`, `GET /health`.

The routes go into the FastAPI app that `demo.launch` builds (`app_kwargs`: routes given to the app come before
Gradio's own), so launching, --share and the page stay as they were. Each request is checked
(app/openai_schema.py), its prompt built as the page builds it, and it takes its place in the model's one queue
(app/model_queue.py) on arrival; its generation runs on a thread of its own (app/openai_run.py), which hands the
text to the response round by round. A client that leaves is noticed at once: a request still waiting gives up its
place and never runs; a running one stops after the round in progress. docs/openai-api.md is the reference.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import threading
import time
import traceback
import uuid
from collections import deque

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from .model_queue import QueueFull, Withdrawn
from .openai_run import Delta, Done, Prepared, generate, prepare
from .openai_schema import COMPLETIONS_MAX_TOKENS, APIError, Request, chat_request, completion_request, model_of

MAX_BODY_BYTES = 8 * 2**20
OWNER = "eagle-chat"
_END = object()  # the last event of a Job


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> Response:
    data = json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8", "replace")
    return Response(data, status, headers, media_type="application/json")


def error_response(e: APIError) -> Response:
    headers = dict(e.headers)
    if e.status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return json_response(e.body(), e.status, headers)


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, allow_nan=False)}\n\n"


class Job:
    """One request's generation on a thread of its own; its events (Delta, Done, APIError) reach the event loop
    through a queue. `cancel()`: the client left (its place in the queue is given up, or the reply stops after the
    round in progress)."""

    def __init__(self, engine, req: Request, prep: Prepared, ticket, record: dict):
        self.engine, self.req, self.prep, self.ticket, self.record = engine, req, prep, ticket, record
        self.loop, self.events = asyncio.get_running_loop(), asyncio.Queue()
        self.cancelled, self.finished = threading.Event(), False
        threading.Thread(target=self._work, name=f"openai-{record['id']}", daemon=True).start()

    def _work(self) -> None:
        try:
            for event in generate(self.engine, self.req, self.prep, self.ticket, self.cancelled):
                if isinstance(event, Done):
                    self.record.update(finish_reason=event.finish_reason, usage=event.usage, timings=event.timings,
                                       status="dropped" if self.cancelled.is_set() else "done")  # fmt: skip
                self._put(event)
        except Withdrawn:
            self.record["status"] = "withdrawn"
        except APIError as e:
            self.record["status"] = "error"
            self._put(e)
        except Exception as e:  # noqa: BLE001 - the server's fault, said to the client; the app goes on
            traceback.print_exc(file=sys.stderr)
            self.record["status"] = "error"
            self._put(APIError(500, f"Generation failed: {type(e).__name__}: {e}", None, "generation_failed"))
        finally:
            self.engine.queue.withdraw(self.ticket)  # a place never waited for is given up (no-op once it ran)
            self.record["ended"] = time.monotonic()
            self._put(_END)

    def _put(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the server's loop is gone
            self.cancelled.set()

    async def next(self):
        event = await self.events.get()
        self.finished = event is _END
        return event

    def cancel(self) -> None:
        if self.finished or self.cancelled.is_set():
            return
        self.record["cancelled"] = time.monotonic()
        self.cancelled.set()
        self.engine.queue.withdraw(self.ticket)

    async def watch(self, request: HTTPRequest) -> None:
        """Cancel when the client disconnects (read from the ASGI channel: the body was read already)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.cancel()
                return


class OpenAIServer:
    """The API's routes over one Engine. api_key: required as `Authorization: Bearer KEY` on /v1/*; locked: a reason
    to refuse /v1/* altogether (the page has a login and the API no key)."""

    def __init__(self, engine, max_new_tokens: int = 512, api_key: str | None = None, locked: str | None = None):
        self.engine, self.max_new_tokens, self.api_key, self.locked = engine, max_new_tokens, api_key, locked
        self.model_id = str(engine.info.get("model_type") or engine.name or "model")
        self.created = int(time.time())
        self.runs: deque[dict] = deque(maxlen=256)  # the last requests that reached the queue (tests read them)

    def app_kwargs(self) -> dict:
        """For `demo.launch(app_kwargs=...)`: the routes, ahead of Gradio's."""
        return {"routes": self.routes()}

    def routes(self) -> list[Route]:
        return [
            Route("/health", self._guard(self.health, auth=False), methods=["GET"]),
            Route("/v1/models", self._guard(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._guard(self.model), methods=["GET"]),
            Route("/v1/chat/completions", self._guard(lambda r: self.complete(r, "chat")), methods=["POST"]),
            Route("/v1/completions", self._guard(lambda r: self.complete(r, "completion")), methods=["POST"]),
            Route("/v1/{rest:path}", self._guard(self.unknown),
                  methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]),
        ]  # fmt: skip

    def _guard(self, endpoint, auth: bool = True):
        """The endpoint with the key checked first and every error in OpenAI's shape (never a bare 500)."""

        async def guarded(request: HTTPRequest) -> Response:
            try:
                if auth:
                    self._authorize(request)
                return await endpoint(request)
            except APIError as e:
                return error_response(e)
            except Exception as e:  # noqa: BLE001 - a fault of ours: said as one, and the server goes on
                traceback.print_exc(file=sys.stderr)
                return error_response(APIError(500, f"Internal error: {type(e).__name__}: {e}", None, "internal"))

        return guarded

    def _authorize(self, request: HTTPRequest) -> None:
        if self.locked:
            raise APIError(401, self.locked, None, "api_locked")
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "You didn't provide an API key: send it as 'Authorization: Bearer KEY' (the server's "
                           "--api-key).", None, "invalid_api_key")  # fmt: skip
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", None, "invalid_api_key")

    # endpoints -----------------------------------------------------------------------------------------------
    async def health(self, request: HTTPRequest) -> Response:
        q = self.engine.queue
        return json_response({"status": "ok", "queue": {"running": q.locked(), "waiting": q.waiting(),
                                                        "max_waiting": q.max_waiting}})  # fmt: skip

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": OWNER,
                "name": self.engine.name, "context_length": self.engine.max_length}  # fmt: skip

    async def models(self, request: HTTPRequest) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HTTPRequest) -> Response:
        self._check_model(request.path_params["model"])
        return json_response(self._model_card())

    async def unknown(self, request: HTTPRequest) -> Response:
        known = {"/v1/models", "/v1/chat/completions", "/v1/completions"}
        if request.url.path.rstrip("/") in known:
            raise APIError(405, f"{request.method} is not allowed on {request.url.path}", None, "method_not_allowed")
        raise APIError(404, f"Unknown endpoint {request.url.path}: this server has /v1/chat/completions, "
                       "/v1/completions, /v1/models and /health", None, "unknown_url")  # fmt: skip

    def _check_model(self, name: str) -> None:
        if name not in (self.model_id, self.engine.name):
            raise APIError(404, f"The model {name!r} does not exist: this server serves {self.model_id!r} "
                           "(GET /v1/models)", "model", "model_not_found")  # fmt: skip

    async def complete(self, request: HTTPRequest, kind: str) -> Response:
        body = await read_json(request)
        self._check_model(model_of(body))
        limit = self.engine.max_length
        if kind == "chat":
            req, default = chat_request(body, limit), self.max_new_tokens
        else:
            vocab = len(self.engine.tokenizer)
            req, default = completion_request(body, limit, vocab), COMPLETIONS_MAX_TOKENS
        prep = await run_in_threadpool(prepare, self.engine, req, default)
        try:
            ticket = self.engine.queue.join()  # the place in the model's queue: taken on arrival
        except QueueFull as e:
            raise APIError(503, f"The server is busy: {e}.", None, "queue_full",
                           {"Retry-After": str(e.retry_after_s)}) from None  # fmt: skip
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        record = {"id": rid, "kind": kind, "stream": req.stream, "joined": time.monotonic(), "status": "queued",
                  "prompt_tokens": len(prep.ids)}  # fmt: skip
        try:
            job = Job(self.engine, req, prep, ticket, record)
        except BaseException:
            self.engine.queue.withdraw(ticket)  # a place nobody will wait for would hold up everyone behind it
            raise
        self.runs.append(record)
        shape = Shape(rid, kind, self.model_id, req)
        if req.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            # the background task runs when the response ends, even if the client left before the stream began
            return StreamingResponse(self._stream(job, shape, request), media_type="text/event-stream",
                                     headers=headers, background=BackgroundTask(job.cancel))  # fmt: skip
        return await self._whole(job, shape, request)

    async def _stream(self, job: Job, shape: "Shape", request: HTTPRequest):
        watch = asyncio.create_task(job.watch(request))
        try:
            if shape.kind == "chat":  # the role first, as OpenAI sends it
                yield sse(shape.chunk(None, first=True))
            while (event := await job.next()) is not _END:
                if isinstance(event, Delta):
                    yield sse(shape.chunk(event.text))
                elif isinstance(event, Done):
                    yield sse(shape.chunk("", finish=event.finish_reason or "stop", timings=event.timings))
                    if shape.req.include_usage:
                        yield sse(shape.usage_chunk(event.usage, event.timings))
                elif isinstance(event, APIError):
                    yield sse(event.body())
            yield sse("[DONE]")
        finally:
            watch.cancel()
            job.cancel()  # no-op when it ended

    async def _whole(self, job: Job, shape: "Shape", request: HTTPRequest) -> Response:
        watch = asyncio.create_task(job.watch(request))
        try:
            text, done = [], None
            while (event := await job.next()) is not _END:
                if isinstance(event, Delta):
                    text.append(event.text)
                elif isinstance(event, Done):
                    done = event
                elif isinstance(event, APIError):
                    raise event
            if done is None:  # the client left before its turn: nobody reads this
                raise APIError(503, "The request was withdrawn before it ran", None, "withdrawn")
            return json_response(shape.whole("".join(text), done))
        finally:
            watch.cancel()
            job.cancel()


class Shape:
    """OpenAI's response objects for one request: chat.completion(.chunk) or text_completion."""

    def __init__(self, rid: str, kind: str, model: str, req: Request):
        self.rid, self.kind, self.model, self.req, self.created = rid, kind, model, req, int(time.time())

    def _head(self, obj: str) -> dict:
        head = {"id": self.rid, "object": obj, "created": self.created, "model": self.model}
        return {**head, "system_fingerprint": None} if self.kind == "chat" else head

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False, timings: dict | None = None):
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if first else {} if finish else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        if timings is not None:
            out["timings"] = timings
        return out

    def usage_chunk(self, usage: dict, timings: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage, "timings": timings}

    def whole(self, text: str, done: Done) -> dict:
        finish = done.finish_reason or "stop"
        if self.kind == "chat":
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": done.usage, "timings": done.timings}


async def read_json(request: HTTPRequest):
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"The request body is over {MAX_BODY_BYTES // 2**20} MiB", None, "body_too_large")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}", None, "invalid_json") from None
