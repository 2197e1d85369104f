"""Load test of an OpenAI-compatible server, as its clients see it (`optllm bench serve URL`).

Requests come from a dataset (.jsonl / .json rows with a "prompt", or ShareGPT-style
conversations) or are synthetic: ``input_len`` random token ids when the server takes
token-id prompts (probed once), else ``input_len`` random words. They go out at Poisson arrival
times (random.Random(seed): the same seed, the same schedule and prompts), at most
``max_concurrency`` at once, until ``num_prompts`` are sent or ``duration`` seconds have passed;
in-flight requests then get ``timeout`` seconds, after which they are cancelled and counted
as failed. Every request is streamed with stream_options.include_usage: TTFT is the time to
the first chunk that carries a choice, ITL the gaps between such chunks (vLLM's
benchmark_serving definitions), TPOT a request's (E2E - TTFT) / (output tokens - 1), and
token counts are the server's own usage numbers (chunks counted only where it sends none).
Goodput is benchmark_serving's: successful requests per second that meet every target given
(TTFT <= slo_ttft_ms, TPOT <= slo_itl_ms).

The HTTP client is aiohttp, as in vLLM's and SGLang's serving benchmarks: httpx's (and
httpx2's) AsyncClient spends far more time per request under many concurrent requests
(encode/httpx#3215, pydantic/httpx2#827), time that would land in the latencies measured.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from ..errors import UserError
from .loadtest_report import Report, percentile, summarize  # noqa: F401 (percentile: re-exported)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DEFAULT_NUM_PROMPTS = 100  # when neither num_prompts nor duration bounds the run
_PROBE_VOCAB = (32000, 4096, 256)  # token-id probes, largest first: ids are drawn from [v // 8, v)


@dataclass(frozen=True)
class LoadTestConfig:
    """url: the server, http[s]://host[:port] (a trailing /v1 is dropped). endpoint: completions |
    chat. model: None = the first id of GET /v1/models. dataset: prompts file; None = synthetic
    prompts of input_len tokens (words where the server takes no token ids). output_len:
    max_tokens of each request. num_prompts, duration (s): stop issuing after either (neither:
    DEFAULT_NUM_PROMPTS requests). request_rate: mean arrivals per second, inf = all at once.
    max_concurrency: requests in flight at most (None: no limit). timeout: seconds in-flight
    requests get once issuing stops. slo_ttft_ms, slo_itl_ms: goodput targets (ms)."""

    url: str
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    dataset: Path | None = None
    input_len: int = 128
    output_len: int = 128
    num_prompts: int | None = None
    duration: float | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    timeout: float = 300.0
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    temperature: float = 0.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        try:
            _ = parts.port  # raises on a bad port
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"URL {self.url!r} is not an http(s)://host[:port] address")
        if self.endpoint not in ENDPOINTS:
            raise UserError(f"--endpoint {self.endpoint!r} is not one of: {', '.join(ENDPOINTS)}")
        if math.isnan(self.request_rate) or self.request_rate <= 0:
            raise UserError(f"--request-rate {self.request_rate:g} must be > 0 requests/s (inf: all at once)")
        for name in ("input_len", "output_len", "num_prompts", "max_concurrency"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise UserError(f"--{name.replace('_', '-')} {v} must be >= 1")
        for name in ("duration", "timeout", "slo_ttft_ms", "slo_itl_ms"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise UserError(f"--{name.replace('_', '-')} {v:g} must be > 0")
        if self.temperature < 0:
            raise UserError(f"--temperature {self.temperature:g} must be >= 0")
        if math.isinf(self.request_rate) and self.num_prompts is None and self.max_concurrency is None \
                and self.duration is not None:
            raise UserError("--request-rate inf with --duration needs --num-prompts or --max-concurrency "
                            "(else it would issue requests without end)")
        if self.dataset is not None and not Path(self.dataset).is_file():
            raise UserError(f"--dataset {self.dataset}: no such file")

    @property
    def base(self) -> str:
        base = self.url.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base

    @property
    def max_requests(self) -> int | None:
        if self.num_prompts is not None:
            return self.num_prompts
        return None if self.duration is not None else DEFAULT_NUM_PROMPTS


def arrival_offsets(rate: float, seed: int) -> Iterator[float]:
    """Send times (s after the start) of a Poisson process of `rate` requests/s, without end:
    the first at 0, then gaps drawn from Exponential(rate) by random.Random(seed). rate inf:
    every request at 0."""
    rng = random.Random(seed)
    t = 0.0
    while True:
        yield t
        if math.isfinite(rate):
            t += rng.expovariate(rate)


def load_prompts(path: Path) -> list[str]:
    """The prompts of a .jsonl file (one JSON object a line) or a .json file (a list of them):
    each row's "prompt" string, or the first human/user turn of its "conversations" (ShareGPT:
    from/value) or "messages" (role/content). UserError naming the file and row otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            rows = list(enumerate(json.loads(text), 1))
        else:
            rows = [(n, json.loads(line)) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"--dataset {path}: cannot read it as {'JSON' if path.suffix == '.json' else 'JSON lines'}"
                        f" ({e})") from None
    prompts = []
    for n, row in rows:
        prompt = _row_prompt(row)
        if prompt is None:
            raise UserError(f"--dataset {path}: row {n} has no \"prompt\" string and no human/user turn in "
                            "\"conversations\" or \"messages\"")
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"--dataset {path} holds no prompts")
    return prompts


def _row_prompt(row) -> str | None:
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("prompt"), str):
        return row["prompt"]
    for turn in row.get("conversations") or row.get("messages") or []:
        if isinstance(turn, dict) and (turn.get("from") or turn.get("role")) in ("human", "user"):
            content = turn.get("value", turn.get("content"))
            return content if isinstance(content, str) else None
    return None


@dataclass(frozen=True)
class Target:
    """What the load test learnt from the server before it: the model id and the prompts it
    sends (`kind`: "dataset", "token ids" drawn from `id_range`, or "words")."""

    model: str
    kind: str
    id_range: tuple[int, int] | None = None
    prompts: tuple[str, ...] = ()


@dataclass
class RequestRecord:
    """One request. Times in seconds after the load test's start; latencies in seconds.
    reason: why it failed ("HTTP 404", "connection", "timeout", "stream error", "protocol",
    "no tokens"), None when ok; error: the detail."""

    index: int
    scheduled_s: float
    sent_s: float | None = None
    done_s: float | None = None
    ok: bool = False
    reason: str | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage: bool = False  # token counts from the server's usage, not counted chunks
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float:
        """(E2E - TTFT) / (output tokens - 1); 0 for one token (as benchmark_serving's goodput)."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0

    def fail(self, reason: str, error: str, now: float) -> None:
        self.ok, self.reason, self.error, self.done_s = False, reason, error[:300], now


@dataclass(frozen=True)
class Progress:
    """A snapshot while the load test runs (every half second)."""

    elapsed_s: float
    issued: int
    ok: int
    failed: int
    output_tokens: int

    @property
    def in_flight(self) -> int:
        return self.issued - self.ok - self.failed


def _headers(cfg: LoadTestConfig) -> dict:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def _error_text(raw: str) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return " ".join(raw.split())[:300]


async def prepare(session: aiohttp.ClientSession, cfg: LoadTestConfig) -> Target:
    """Reads the dataset, asks the server for its model (GET /v1/models) unless cfg.model is
    set, and for synthetic prompts on /v1/completions probes whether it takes token ids and
    below which id. UserError when the server cannot be reached or refuses the key."""
    prompts = tuple(load_prompts(cfg.dataset)) if cfg.dataset is not None else ()
    model = cfg.model
    try:
        async with session.get(cfg.base + "/v1/models", headers=_headers(cfg),
                               timeout=aiohttp.ClientTimeout(total=60)) as r:
            body = await r.text()
            if r.status in (401, 403):
                raise UserError(f"{cfg.base} refused the API key (HTTP {r.status}: {_error_text(body)}); "
                                "pass --api-key")
            if model is None:
                ids = [m.get("id") for m in json.loads(body).get("data", [])] if r.status == 200 else []
                if not ids or not isinstance(ids[0], str):
                    raise UserError(f"GET {cfg.base}/v1/models gave no model (HTTP {r.status}); pass --model")
                model = ids[0]
        if prompts:
            return Target(model, "dataset", prompts=prompts)
        if cfg.endpoint == "completions":
            for vocab in _PROBE_VOCAB:
                probe = {"model": model, "prompt": [vocab - 1], "max_tokens": 1, "temperature": 0}
                async with session.post(cfg.base + ENDPOINTS["completions"], json=probe, headers=_headers(cfg),
                                        timeout=aiohttp.ClientTimeout(total=120)) as r:
                    await r.read()
                    if r.status == 200:
                        return Target(model, "token ids", (vocab // 8, vocab))
    except UserError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise UserError(f"cannot reach {cfg.base}: {e or type(e).__name__}") from None
    except (ValueError, AttributeError) as e:
        raise UserError(f"GET {cfg.base}/v1/models is not an OpenAI model list ({e}); pass --model") from None
    return Target(model, "words")


def request_prompts(cfg: LoadTestConfig, target: Target) -> Iterator[str | list[int]]:
    """The prompts in the order they are sent, without end: the dataset shuffled and cycled,
    or synthetic ones; the same for the same seed."""
    rng = random.Random(f"prompts-{cfg.seed}")  # its own stream: the schedule does not depend on it
    if target.prompts:
        order = list(range(len(target.prompts)))
        rng.shuffle(order)
        yield from (target.prompts[i] for i in itertools.cycle(order))
    elif target.id_range is not None:
        lo, hi = target.id_range
        while True:
            yield [rng.randrange(lo, hi) for _ in range(cfg.input_len)]
    else:
        words = _words()
        while True:
            yield " ".join(rng.choice(words) for _ in range(cfg.input_len))


def _words() -> list[str]:
    from ..hub.corpus import texts

    return sorted({w for doc in texts("docs", "calib") for w in doc.lower().split() if w.isalpha()})


def _body(cfg: LoadTestConfig, model: str, prompt) -> dict:
    body = {"model": model, "max_tokens": cfg.output_len, "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension: exact output lengths
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def _events(resp: aiohttp.ClientResponse, clock) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, data) of each server-sent event; a server that does not stream: its
    whole body as one event."""
    if resp.content_type != "text/event-stream":
        text = await resp.text()
        yield clock(), text
        return
    buf = b""
    async for chunk in resp.content.iter_any():
        now = clock()
        *events, buf = (buf + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
        for ev in events:
            data = [line[5:].removeprefix(b" ") for line in ev.split(b"\n") if line.startswith(b"data:")]
            if data:
                yield now, b"\n".join(data).decode()


async def _send(session, url: str, headers: dict, body: dict, rec: RequestRecord, clock) -> None:
    sent = rec.sent_s = clock()
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            rec.fail(f"HTTP {resp.status}", _error_text(await resp.text()), clock())
            return
        last = None
        async for now, data in _events(resp, clock):
            if data.strip() == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("error"):
                rec.fail("stream error", str(obj["error"].get("message", obj["error"])), now)
                return
            if obj.get("usage"):
                rec.prompt_tokens, rec.output_tokens = obj["usage"]["prompt_tokens"], obj["usage"]["completion_tokens"]
                rec.usage = True
            choices = obj.get("choices") or []
            for c in choices:
                rec.finish_reason = c.get("finish_reason") or rec.finish_reason
            if choices:  # as benchmark_serving: every chunk with a choice, its text empty or not
                if last is None:
                    rec.ttft_s = now - sent
                else:
                    rec.itl_s.append(now - last)
                last = now
                if not rec.usage:
                    rec.output_tokens += 1
    if last is None:
        rec.fail("no tokens", "the response carried no output", clock())
        return
    rec.done_s = clock()
    rec.e2e_s, rec.ok = rec.done_s - sent, True


async def _one(session, url, headers, body, rec, clock, slots: asyncio.Semaphore | None) -> None:
    try:
        await _send(session, url, headers, body, rec, clock)
    except aiohttp.ClientError as e:
        rec.fail("connection", f"{type(e).__name__}: {e}", clock())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        rec.fail("protocol", f"unexpected stream content: {type(e).__name__}: {e}", clock())
    finally:
        if slots is not None:
            slots.release()


async def _acquire(slots: asyncio.Semaphore, seconds: float) -> bool:
    if math.isinf(seconds):
        await slots.acquire()
        return True
    try:
        await asyncio.wait_for(slots.acquire(), max(seconds, 0.0))
        return True
    except asyncio.TimeoutError:
        return False


async def measure(session: aiohttp.ClientSession, cfg: LoadTestConfig, target: Target,
                  progress: Callable[[Progress], None] | None = None) -> Report:
    """Issues the requests on the schedule, waits for them (cfg.timeout at most once issuing
    stops: the rest count as failed with reason "timeout") and summarises them."""
    url, headers = cfg.base + ENDPOINTS[cfg.endpoint], _headers(cfg)
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    deadline = cfg.duration if cfg.duration is not None else math.inf
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    async def tick():
        while True:
            ok = sum(r.ok for r in records)
            progress(Progress(clock(), len(records), ok, sum(r.reason is not None for r in records),
                              sum(r.output_tokens for r in records if r.ok)))
            await asyncio.sleep(0.5)

    ticker = asyncio.create_task(tick()) if progress else None
    schedule = zip(arrival_offsets(cfg.request_rate, cfg.seed), request_prompts(cfg, target))
    stopped = None  # when issuing stopped: the drain's timeout counts from there
    for i, (at, prompt) in enumerate(itertools.islice(schedule, cfg.max_requests)):
        if at >= deadline:
            stopped = deadline  # the next arrival is past the deadline, which ends issuing
            break
        await asyncio.sleep(max(at - clock(), 0.0))  # 0: still lets the requests in flight run
        if slots is not None and not await _acquire(slots, deadline - clock()):
            break  # the deadline passed while it waited for a slot: not issued
        rec = RequestRecord(i, at)
        records.append(rec)
        tasks.append(asyncio.create_task(_one(session, url, headers, _body(cfg, target.model, prompt), rec, clock,
                                              slots)))
    stopped = max(clock(), stopped or 0.0)
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(stopped + cfg.timeout - clock(), 0.0))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    end = clock()
    for rec in records:
        if rec.done_s is None:
            rec.fail("timeout", f"still running {cfg.timeout:g} s after issuing stopped", end)
    if ticker is not None:
        ticker.cancel()
        progress(Progress(end, len(records), sum(r.ok for r in records), sum(not r.ok for r in records),
                          sum(r.output_tokens for r in records if r.ok)))
    report = summarize(cfg, target, records, max((r.done_s for r in records), default=end),
                       client=f"aiohttp {aiohttp.__version__}")
    report.summary["issuing_stopped_s"] = stopped
    return report


def _session() -> aiohttp.ClientSession:
    # no pool limit (max_concurrency is ours to enforce); no total timeout (the drain's is)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))


def find_target(cfg: LoadTestConfig) -> Target:
    """prepare() in its own event loop."""
    async def go():
        async with _session() as s:
            return await prepare(s, cfg)
    return asyncio.run(go())


def run_loadtest(cfg: LoadTestConfig, progress: Callable[[Progress], None] | None = None,
                 target: Target | None = None) -> Report:
    """The whole load test (prepare, unless `target` is given, then measure); blocks."""
    async def go():
        async with _session() as s:
            return await measure(s, cfg, target or await prepare(s, cfg), progress)
    return asyncio.run(go())
