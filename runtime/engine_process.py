"""ProcessEngine: the engine in a process of its own, for the server.

AsyncLLMEngine runs the engine on a thread of the server's process; there every step's host
work (scheduling, sampling, detokenizing, building outputs) and the event loop's (parsing,
JSON, writing streams) take turns on one GIL, and at decode speed the two together are longer
than a step: the GPU waits. vLLM and SGLang put the engine in its own process for that
reason; so does this class. Same interface as AsyncLLMEngine (add_request / generate /
abort / stats / tokenizer / max_model_len / shutdown), so the HTTP app does not know which
one it has.

Wire (one duplex multiprocessing pipe, pickled tuples):
    to the engine   ("add", prompt, params, request_id) | ("abort", request_id) | ("drain", timeout)
    from it         ("ready", info) | ("failed", message, is_user_error) at start-up, then
                    ("added", request_id, error) once per add, before any of its outputs;
                    ("out", deltas, stats) after every step (and after commands when idle);
                    ("error", request_ids, message) when a step fails; ("stopped",) last.
A delta carries only what is new since the request's previous one: per completion the new
token ids, the text from the first character that changed, the new log-probs, the finish
reason; the prompt (and its log-probs) only once. Sending cumulative outputs would pickle
every token of every running request at every step. This side rebuilds cumulative
RequestOutputs (one fresh object per step per request, as AsyncLLMEngine gives), so readers
and the OpenAI response code stay the same.

Threads here: a writer (commands go through a queue, so an event loop never blocks on a full
pipe) and a reader (one call_soon_threadsafe per event loop per step, as AsyncLLMEngine).
The engine process ignores SIGINT / SIGTERM (the server decides when to drain) and exits
when the pipe closes, so it never outlives a server killed outright.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field

from ..errors import UserError
from .async_engine import RequestStream, deliver
from .config import EngineConfig
from .engine import EngineStats
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger("optllm.engine")


class EngineDied(RuntimeError):
    pass


# --------------------------------------------------------------------------- engine process
@dataclass
class _Sent:
    """What the server side already has of one completion."""

    tokens: int = 0
    text: str = ""
    logprobs: int = 0


def _delta(out: RequestOutput, sent: dict[str, list[_Sent]]) -> tuple:
    """(request_id, finished, prompt part or None, completions, metrics or None) with only
    what is new since the request's last delta."""
    have = sent.get(out.request_id)
    first = have is None
    if first:
        have = sent[out.request_id] = [_Sent() for _ in out.outputs]
    comps = []
    for c in out.outputs:
        while c.index >= len(have):
            have.append(_Sent())
        h = have[c.index]
        # the visible text only grows in practice; should it ever change behind the end, resend
        # from the first character (text_from) instead of assuming it
        text_from = len(h.text) if c.text.startswith(h.text) else 0
        lps = None if c.logprobs is None else c.logprobs[h.logprobs:]
        comps.append((c.index, c.token_ids[h.tokens:], text_from, c.text[text_from:], lps, c.finish_reason,
                       c.stop_reason))
        h.tokens, h.text = len(c.token_ids), c.text
        h.logprobs = h.logprobs if c.logprobs is None else len(c.logprobs)
    if out.finished:
        sent.pop(out.request_id, None)
    prompt = (out.prompt, out.prompt_token_ids) if first else None
    # prompt log-probs come once, complete, with the first output that has them
    plp = out.prompt_logprobs if (first or out.finished) else None
    return (out.request_id, out.finished, prompt, comps, plp, out.metrics if (first or out.finished) else None)


def _engine_main(config: EngineConfig, conn) -> None:
    """The engine process: load, then serve commands and step until drained or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process handles the signals
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from .engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except UserError as e:
        conn.send(("failed", str(e), True))
        return
    except BaseException as e:  # noqa: BLE001 -- reported to the server, which raises it
        conn.send(("failed", "".join(traceback.format_exception(e)).strip(), False))
        return
    # the model's and the libraries' objects live as long as the process: move them out of
    # the collector's way, so the collections that a step's short-lived outputs trigger stay short
    gc.collect()
    gc.freeze()
    conn.send(("ready", dict(folder=str(engine.source.folder), max_model_len=engine.max_model_len,
                             stats=engine.stats())))
    try:
        _serve(engine, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the server is gone: nothing to report to


def _serve(engine, conn) -> None:
    sent: dict[str, list[_Sent]] = {}
    stopping, deadline = False, None
    while True:
        outs: list[RequestOutput] = []
        changed = False
        wait = 0 if (engine.has_unfinished_requests() or stopping) else 0.05
        while conn.poll(wait):
            cmd = conn.recv()
            wait, changed = 0, True
            if cmd[0] == "add":
                _, prompt, params, rid = cmd
                try:
                    engine.add_request(prompt, params, request_id=rid)
                    conn.send(("added", rid, None))
                except Exception as e:  # reported to the caller; the engine keeps serving
                    conn.send(("added", rid, (type(e).__name__, str(e))))
            elif cmd[0] == "abort":
                out = engine.abort_request(cmd[1])
                if out is not None:
                    outs.append(out)
            elif cmd[0] == "drain":
                stopping = True
                deadline = None if cmd[1] is None else time.monotonic() + cmd[1]
        if stopping and deadline is not None and time.monotonic() > deadline:
            for rid in list(engine.requests):
                out = engine.abort_request(rid)
                if out is not None:
                    outs.append(out)
        if engine.has_unfinished_requests():
            try:
                outs.extend(engine.step())
            except Exception as e:  # a failed step fails its requests, not the engine
                rids = list(engine.requests)
                for rid in rids:
                    engine.abort_request(rid)
                    sent.pop(rid, None)
                log.exception("engine step failed")
                conn.send(("error", rids, f"engine step failed: {type(e).__name__}: {e}"))
                changed = True
        if outs or changed:
            conn.send(("out", [_delta(o, sent) for o in outs], engine.stats()))
        if stopping and not engine.has_unfinished_requests():
            conn.send(("stopped",))
            return


# --------------------------------------------------------------------------- server side
@dataclass
class _Acc:
    """The server side's cumulative view of one request."""

    prompt: str | None
    prompt_token_ids: list[int]
    comps: dict[int, list] = field(default_factory=dict)  # index -> [tokens, text, logprobs]
    prompt_logprobs: list | None = None
    metrics: RequestMetrics | None = None


class ProcessEngine:
    """The engine in a child process (spawned: CUDA is initialised there only). Blocks until
    the model is loaded; a load failure is raised here (UserError for the user's mistakes)."""

    def __init__(self, config: EngineConfig, start_timeout: float | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_engine_main, args=(config, child), name="optllm-engine")
        self._proc.start()
        child.close()
        info = self._startup(start_timeout)
        from ..hub.loader import load_tokenizer

        self.max_model_len: int = info["max_model_len"]
        self._stats: EngineStats = info["stats"]
        self.tokenizer = load_tokenizer(info["folder"])
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._accs: dict[str, _Acc] = {}
        self._dead: str | None = None
        self._commands: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="optllm-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="optllm-engine-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    def _startup(self, timeout: float | None) -> dict:
        start = time.monotonic()
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                raise EngineDied(f"the engine process exited with code {self._proc.exitcode} while loading the model")
            if timeout is not None and time.monotonic() - start > timeout:
                self._proc.kill()
                raise EngineDied(f"the engine did not load the model in {timeout:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineDied(f"the engine process exited with code {self._proc.exitcode} while loading the model") \
                from None
        if msg[0] == "failed":
            self._proc.join(30)
            if msg[2]:
                raise UserError(msg[1])
            raise EngineDied(f"the engine failed to start:\n{msg[1]}")
        return msg[1]

    # ---- the interface (any event loop)
    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a request; returns the stream of its cumulative outputs. The engine's
        add_request errors (a prompt too long, a duplicate id) are raised here as ValueError."""
        if self._dead is not None:
            raise EngineDied(self._dead)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        fut = loop.create_future()
        self._streams[request_id] = (loop, q)
        self._pending[request_id] = (loop, fut)
        self._commands.put(("add", prompt, params, request_id))
        error = await fut
        if error is not None:
            self._streams.pop(request_id, None)
            kind, message = error
            raise (ValueError if kind in ("ValueError", "UserError") else RuntimeError)(message)
        return RequestStream(self, request_id, q)

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str):
        """Yield the request's cumulative outputs until it finishes; leaving early aborts it."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """Counts as of the engine's last message."""
        return self._stats

    @property
    def alive(self) -> bool:
        return self._dead is None

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish what is in flight (abort it if `timeout` seconds pass), then stop the engine
        process and the threads."""
        if self._proc.is_alive() and self._dead is None:
            self._commands.put(("drain", timeout))
            self._reader.join(None if timeout is None else timeout + 60)
        self._commands.put(None)
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._conn.close()

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ---- threads
    def _write(self) -> None:
        while True:
            cmd = self._commands.get()
            if cmd is None:
                return
            try:
                self._conn.send(cmd)
            except (OSError, ValueError):  # the engine is gone; the reader reports it
                if cmd[0] == "add":
                    self._resolve(cmd[3], ("EngineDied", self._dead or "the engine process is gone"))

    def _resolve(self, rid: str, error) -> None:
        pending = self._pending.pop(rid, None)
        if pending is not None:
            loop, fut = pending
            try:
                loop.call_soon_threadsafe(_set_result, fut, error)
            except RuntimeError:  # that loop is closed
                pass

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                self._proc.join(5)
                self._fail(f"the engine process exited (code {self._proc.exitcode})")
                return
            kind = msg[0]
            if kind == "out":
                self._stats = msg[2]
                self._deliver([self._rebuild(d) for d in msg[1]])
            elif kind == "added":
                self._resolve(msg[1], msg[2])
            elif kind == "error":
                for rid in msg[1]:
                    self._accs.pop(rid, None)
                    self._put(rid, RuntimeError(msg[2]))
            elif kind == "stopped":
                self._dead = "the engine has shut down"
                return

    def _rebuild(self, d) -> RequestOutput:
        rid, finished, prompt, comps, plp, metrics = d
        acc = self._accs.get(rid)
        if acc is None:
            acc = self._accs[rid] = _Acc(*prompt) if prompt is not None else _Acc(None, [])
        for index, tokens, text_from, text, lps, finish, stop in comps:
            c = acc.comps.get(index)
            if c is None:
                c = acc.comps[index] = [[], "", None, None, None]  # tokens, text, log-probs, finish, stop
            c[0].extend(tokens)
            c[1] = c[1][:text_from] + text
            if lps is not None:
                if c[2] is None:
                    c[2] = []
                c[2].extend(lps)
            c[3], c[4] = finish, stop
        if plp is not None:
            acc.prompt_logprobs = plp
        if metrics is not None:
            acc.metrics = metrics
        if finished:
            self._accs.pop(rid, None)
        outs = [CompletionOutput(index=i, text=c[1], token_ids=list(c[0]), finish_reason=c[3], stop_reason=c[4],
                                 logprobs=None if c[2] is None else list(c[2]))
                for i, c in sorted(acc.comps.items())]
        return RequestOutput(rid, acc.prompt, acc.prompt_token_ids, outs, finished, acc.prompt_logprobs, acc.metrics)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        deliver(self._streams, outputs)

    def _put(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is not None:
            try:
                target[0].call_soon_threadsafe(target[1].put_nowait, item)
            except RuntimeError:
                pass

    def _fail(self, message: str) -> None:
        self._dead = message
        log.error("%s", message)
        for rid in list(self._pending):
            self._resolve(rid, ("EngineDied", message))
        for rid in list(self._streams):
            self._put(rid, EngineDied(message))


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)
