"""ASGI middleware: a request-body size limit (413 before the handler reads too much) and one
log line per request (method, path, status, seconds, tokens; the prompt only when asked)."""

from __future__ import annotations

import json
import logging
import time

log = logging.getLogger("optllm.server")


async def send_error(send, status: int, message: str, code: str | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413: by Content-Length when given, else
    while the body streams in."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        msg = f"request body over {self.limit} bytes"
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                return await send_error(send, 413, msg, "request_too_large")
        seen = 0
        started = False

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited, tracking_send)
        except _TooLarge:
            if not started:
                await send_error(send, 413, msg, "request_too_large")


class RequestLog:
    """One INFO line per HTTP request when its response ends, and the request counted in the
    metrics by endpoint and status (499: the client left first). Handlers add their own
    fields (sampling settings, and the prompt when --log-prompts) as ``request.state.log``."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

    def __init__(self, app, metrics=None) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [0]

        async def logging_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._done(scope, status[0], t0)
                status[0] = -1  # logged

        try:
            await self.app(scope, receive, logging_send)
        finally:
            if status[0] != -1:  # the response never finished (client gone, cancelled)
                self._done(scope, 499, t0)

    def _done(self, scope, status: int, t0: float) -> None:
        _line(scope, status, t0)
        if self.metrics is not None:
            path = scope.get("path", "")
            self.metrics.requests.labels(path if path in self.ENDPOINTS else "other", str(status)).inc()


def _line(scope, status: int, t0: float) -> None:
    extra = scope.get("state", {}).get("log", "")
    log.info("%s %s %d %.3fs%s", scope.get("method", "-"), scope.get("path", "-"), status,
             time.perf_counter() - t0, f" {extra}" if extra else "")
