"""The OpenAI-compatible HTTP API over AsyncLLMEngine (FastAPI).

Routes: /v1/completions, /v1/chat/completions, /v1/models (behind the API key when one is
set), /health, /metrics. Bodies are parsed here, not by FastAPI, so every client error is
OpenAI's {"error": {message, type, param, code}} with the right status: 400 malformed JSON,
bad fields or a prompt over the context; 401 a missing or wrong key (compared in constant
time); 404 an unknown model or route; 413 an oversized body (middleware); 500 never carries
a traceback. Streams are server-sent events ending with ``data: [DONE]``; a client that goes
away mid-stream has its requests aborted (their KV blocks freed) at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..llm import render_chat
from .metrics import ServerMetrics
from .middleware import BodyLimit, RequestLog
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .responses import Tracker, chat_logprobs, completion_chunk, completion_logprobs

log = logging.getLogger("optllm.server")


@dataclass(frozen=True)
class ServerConfig:
    """served_model_name: the id clients send as ``model``. api_key: required as a Bearer
    token on /v1 routes when set. max_body_bytes: larger bodies get 413. log_prompts: put the
    prompt in the request log line. shutdown_timeout: seconds in-flight requests get to finish
    after SIGTERM before they are aborted."""

    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 * 2**20
    log_prompts: bool = False
    shutdown_timeout: float = 30.0


def build_app(engine, cfg: ServerConfig):
    """The ASGI application (FastAPI inside the body-limit and request-log middleware)."""
    metrics = ServerMetrics(engine)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await asyncio.to_thread(engine.shutdown, cfg.shutdown_timeout)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_request, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), kind=kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_request, e: Exception):
        log.exception("internal error")
        return JSONResponse(APIError(500, "internal server error", kind="internal_error").body(), status_code=500)

    def authorize(request: Request) -> None:
        if cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), cfg.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send it as 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    async def parse(request: Request, model_cls):
        raw = await request.body()
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        if not isinstance(obj, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            req = model_cls.model_validate(obj)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(x) for x in first["loc"]) or None
            raise APIError(400, f"{param}: {first['msg']}", param) from None
        if req.model is not None and req.model != cfg.served_model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{cfg.served_model_name!r}", "model", "model_not_found")
        return req

    async def add_all(prompts, params, rid: str, param: str):
        streams = []
        try:
            for i, p in enumerate(prompts):
                streams.append(await engine.add_request(p, params, f"{rid}-{i}"))
        except ValueError as e:
            for s in streams:
                s.close()
            code = "context_length_exceeded" if "max_model_len" in str(e) else None
            raise APIError(400, str(e), param, code) from None
        return streams

    def note(request: Request, what: str, params, prompts) -> None:
        fields = f"{what} n={params.n} max_tokens={params.max_tokens}"
        if cfg.log_prompts:
            fields += f" prompt={json.dumps(prompts)[:2000]}"
        request.state.log = fields

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        card = {"id": cfg.served_model_name, "object": "model", "created": started, "owned_by": "optllm",
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = await parse(request, CompletionRequest)
        params, prompts = req.to_params(), req.prompts()
        note(request, "completion", params, prompts)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await add_all(prompts, params, rid, "prompt")
        tracker = Tracker(params.n, metrics)
        tok = engine.tokenizer
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage

            def chunk(deltas):
                choices = [{"index": d.index, "text": d.text, "finish_reason": d.finish_reason,
                            "logprobs": completion_logprobs(tok, d.token_ids, d.logprobs, d.text_offset)}
                           for d in deltas]
                return completion_chunk(rid, created, cfg.served_model_name, choices, None) | (
                    {"usage": None} if usage else {})

            return _sse(streams, tracker, chunk, lambda: completion_chunk(
                rid, created, cfg.served_model_name, [], tracker.usage()) if usage else None)
        finals = await _collect(streams, tracker)
        choices = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                choices.append({"index": i * params.n + c.index, "text": c.text, "finish_reason": c.finish_reason,
                                "logprobs": completion_logprobs(tok, c.token_ids, c.logprobs, 0)})
        return {"id": rid, "object": "text_completion", "created": created, "model": cfg.served_model_name,
                "choices": choices, "usage": tracker.usage()}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        authorize(request)
        req = await parse(request, ChatCompletionRequest)
        params = req.to_params()
        try:
            ids = render_chat(engine.tokenizer, req.conversation(), req.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        note(request, "chat", params, req.conversation())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        streams = await add_all([ids], params, rid, "messages")
        tracker = Tracker(params.n, metrics)
        tok, top = engine.tokenizer, req.top_logprobs or 0
        name = cfg.served_model_name
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            started: set[int] = set()

            def chunk(deltas):
                choices = []
                for d in deltas:
                    delta = {"content": d.text}
                    if d.index not in started:
                        started.add(d.index)
                        delta = {"role": "assistant", "content": d.text}
                    choices.append({"index": d.index, "delta": delta, "finish_reason": d.finish_reason,
                                    "logprobs": chat_logprobs(tok, d.token_ids, d.logprobs, top)})
                return completion_chunk(rid, created, name, choices, None, chat=True) | (
                    {"usage": None} if usage else {})

            return _sse(streams, tracker, chunk, lambda: completion_chunk(
                rid, created, name, [], tracker.usage(), chat=True) if usage else None)
        (out,) = await _collect(streams, tracker)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason, "logprobs": chat_logprobs(tok, c.token_ids, c.logprobs, top)}
                   for c in out.outputs]
        return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
                "usage": tracker.usage()}

    return RequestLog(BodyLimit(app, cfg.max_body_bytes), metrics)


async def _merge(streams):
    """(prompt index, output) from several request streams as they come; closing the merge
    (a client gone) closes, i.e. aborts, every stream."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                await q.put((i, out))
        except Exception as e:  # handed to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    left = len(tasks)
    try:
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


async def _collect(streams, tracker: Tracker):
    finals = [None] * len(streams)
    async for i, out in _merge(streams):
        tracker.update(i, out)
        finals[i] = out
    return finals


def _sse(streams, tracker: Tracker, chunk, final) -> StreamingResponse:
    async def events():
        merged = _merge(streams)
        try:
            async for i, out in merged:
                deltas = tracker.update(i, out)
                if deltas:
                    yield f"data: {json.dumps(chunk(deltas))}\n\n"
            last = final()
            if last is not None:
                yield f"data: {json.dumps(last)}\n\n"
        except Exception as e:  # the status line is sent: report in the stream, no traceback
            log.exception("stream failed")
            yield f"data: {json.dumps(APIError(500, f'generation failed: {type(e).__name__}').body())}\n\n"
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
