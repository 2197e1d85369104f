"""AsyncLLMEngine: the engine on a background thread, for asyncio servers.

The engine itself is single-threaded: one thread owns it and runs step() while there is
work; add and abort are commands queued to that thread. Each request's outputs reach the
caller's event loop through an asyncio.Queue: one call_soon_threadsafe per event loop per
step carries every output of the step (not one wake-up of the loop per request). Outputs are
cumulative, so a reader that fell behind takes only the newest one queued (its text and tokens
hold the skipped ones): under load a stream sends fewer, larger chunks instead of falling
further behind the engine. Leaving the async iterator early (a client that disconnected)
aborts the request, which frees its KV blocks on the engine's next turn.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator

from .config import EngineConfig
from .engine import EngineStats, LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine if engine is not None else LLMEngine(config)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._loop, name="optllm-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any event loop)
    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> "RequestStream":
        """Queue a request; returns the stream of its cumulative outputs. Errors from
        add_request (a prompt too long, a duplicate id) are raised here, before any output."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        done = threading.Event()
        error: list[BaseException] = []
        self._submit(("add", prompt, params, request_id, done, error))
        await loop.run_in_executor(None, done.wait)
        if error:
            self._streams.pop(request_id, None)
            raise error[0]
        return RequestStream(self, request_id, q)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes; leaving early aborts it."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def stats(self) -> EngineStats:
        """Counts as of the engine's last turn (read without locking the engine)."""
        return self._stats

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish what is in flight (abort it if `timeout` seconds pass), then stop the thread."""
        self._submit(("drain", timeout))
        self._thread.join()

    # ---- engine thread
    def _submit(self, cmd) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def _loop(self) -> None:
        import time

        deadline = None
        while True:
            while not self._commands.empty():
                cmd = self._commands.get()
                if cmd[0] == "add":
                    _, prompt, params, rid, done, error = cmd
                    try:
                        self.engine.add_request(prompt, params, request_id=rid)
                    except Exception as e:  # reported to the caller, the engine keeps serving
                        error.append(e)
                    done.set()
                elif cmd[0] == "abort":
                    out = self.engine.abort_request(cmd[1])
                    if out is not None:
                        self._deliver([out])
                elif cmd[0] == "drain":
                    self._stopping = True
                    deadline = None if cmd[1] is None else time.monotonic() + cmd[1]
            if self._stopping and deadline is not None and time.monotonic() > deadline:
                for rid in list(self.engine.requests):
                    out = self.engine.abort_request(rid)
                    if out is not None:
                        self._deliver([out])
            if self.engine.has_unfinished_requests():
                try:
                    self._deliver(self.engine.step())
                except Exception as e:  # a failed step fails its requests, not the server
                    self._fail_all(e)
                self._stats = self.engine.stats()
                continue
            self._stats = self.engine.stats()
            if self._stopping:
                return
            self._wake.wait(0.05)
            self._wake.clear()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        deliver(self._streams, outputs)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            target = self._streams.get(rid)
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, RuntimeError(f"engine step failed: {error}"))


def _put_all(items) -> None:
    for q, out in items:
        q.put_nowait(out)


def deliver(streams: dict, outputs: list[RequestOutput]) -> None:
    """Hand each output to its request's queue (streams: request id -> (event loop, queue)),
    one call_soon_threadsafe per event loop for the whole batch, from any thread."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for out in outputs:
        target = streams.get(out.request_id)
        if target is not None:
            by_loop.setdefault(target[0], []).append((target[1], out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that loop is closed: its readers are gone
            pass


class RequestStream:
    """Async iterator over one request's cumulative outputs (the last has finished=True).
    close() -- also called when the iterator is dropped unfinished -- aborts the request."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.engine, self.request_id, self._queue = engine, request_id, queue
        self.finished = False
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        out = await self._queue.get()
        while not isinstance(out, BaseException) and not self._queue.empty():
            out = self._queue.get_nowait()  # cumulative: the newest holds the ones before it
        if isinstance(out, BaseException):
            self.close()
            raise out
        self.finished = out.finished
        if self.finished:
            self.engine._forget(self.request_id)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.engine._forget(self.request_id)
        if not self.finished:
            self.engine.abort(self.request_id)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to abort
            pass
