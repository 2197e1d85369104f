"""Speed of one checkpoint on the runtime, for ``optllm eval --speed``: output and decode tok/s,
TTFT and inter-token latency percentiles, weight GB/s and % of the memory roofline, at
several batch sizes.

Each batch is ``batch_size`` requests of ``prompt_len`` random token ids, all arriving at
once, decoded greedily to exactly ``output_len`` tokens (EOS ignored). The requests stream
through the engine's own step loop (``LLMEngine.add_request(stream=True)`` + ``step()``), and
a token's time is when the step that made it returned, as a streaming client would see it;
the runtime itself carries no timing hooks.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..hub.loader import resolve_device
from ..runtime.llm import LLM
from ..runtime.loader import checkpoint_kind
from ..runtime.sampling_params import SamplingParams
from .loadtest_report import percentile

# measured copy bandwidth (bytes/s) by GPU name: the roofline's denominator. A GPU not listed
# gets no roofline unless --bandwidth is given.
BANDWIDTH = {"H200": 4.27e12}


@dataclass
class BatchTiming:
    """One streamed batch: start (time.monotonic() when the requests were added), end (when
    the last step returned), token_times[i]: the arrival time of each of request i's output
    tokens, step_times: when each engine step that produced tokens returned."""

    start: float
    end: float
    token_times: list[list[float]]
    step_times: list[float]
    preemptions: int = 0


def parse_batch_sizes(value: str | Sequence[int]) -> tuple[int, ...]:
    """Batch sizes from "1,8,32" or a sequence; UserError (one line) on anything but integers >= 1."""
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else list(value)
    out = []
    for s in items:
        try:
            n = int(s)
            ok = str(n) == str(s).strip() and n >= 1
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise UserError(f"--batch-sizes {value if isinstance(value, str) else ','.join(map(str, value))!r}: "
                            f"{str(s)!r} is not allowed; allowed: comma-separated integers >= 1, e.g. 1,8,32")
        out.append(n)
    if not out:
        raise UserError("--batch-sizes is empty; allowed: comma-separated integers >= 1, e.g. 1,8,32")
    return tuple(dict.fromkeys(out))


def speed_defaults(device: str) -> tuple[tuple[int, ...], int, int]:
    """(batch sizes, prompt_len, output_len) for a device ("auto", "cpu", "cuda[:N]"): small on
    CPU, where decoding is slow."""
    return ((1, 4), 32, 32) if resolve_device(device).type == "cpu" else ((1, 8, 32), 128, 128)


def bandwidth_of(device: str) -> float | None:
    """Bytes/s of the GPU behind `device` from BANDWIDTH (matched by name), None otherwise."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(dev)
    return next((bw for key, bw in BANDWIDTH.items() if key.lower() in name.lower()), None)


def weight_bytes(llm: LLM) -> int:
    """Weight bytes one decode step reads: every parameter and buffer of the runtime's model
    once (shared ones once), the rotary table and the embedding table left out (a step reads
    one embedding row per token), unless the embedding is tied to the LM head."""
    model = llm.engine.runner.model
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen or "cos_sin_cache" in name or name.endswith("locks"):
            continue
        seen.add(id(t))
        if "embed_tokens" in name and not tied:
            continue
        total += t.numel() * t.element_size()
    return total


def stream_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> BatchTiming:
    """Add every prompt at once and step the engine until all finish, recording when each
    output token arrived (tokens a step adds together share its time)."""
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine has unfinished requests; speed needs it idle")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.monotonic()
    ids = [engine.add_request(p, params, arrival_time=start, stream=True) for p in prompts]
    index = {rid: i for i, rid in enumerate(ids)}
    times: list[list[float]] = [[] for _ in ids]
    steps, preemptions, done = [], 0, 0
    try:
        while done < len(ids):
            outs = engine.step()
            now = time.monotonic()  # step() returns sampled ids on the host: the GPU is done
            moved = False
            for out in outs:
                i = index.get(out.request_id)
                if i is None:
                    continue
                n = len(out.outputs[0].token_ids)
                if n > len(times[i]):
                    times[i].extend([now] * (n - len(times[i])))
                    moved = True
                if out.finished:
                    done += 1
                    preemptions += out.metrics.num_preemptions if out.metrics else 0
            if moved:
                steps.append(now)
            if not outs and not engine.has_unfinished_requests():
                break
    finally:
        for rid in ids:  # an exception mid-way must not leave requests holding KV blocks
            engine.abort_request(rid)
    return BatchTiming(start, time.monotonic() if not steps else steps[-1], times, steps, preemptions)


def summarize(timings: list[BatchTiming], batch_size: int, wbytes: int, kv_bytes_per_token: float,
              prompt_len: int, output_len: int, bandwidth: float | None) -> dict:
    """The speed numbers of one batch size from its measured batches (pooled):

    tok_s: output tokens / wall seconds (prefill included). decode_tok_s: tokens that arrived
    after every request had its first one, over that window (first to last token).
    ttft_*_ms: first token - arrival; itl_*_ms: gaps between a request's consecutive tokens
    (output_len - 1 per request). weight_gb_s: weight bytes x decode steps / decode seconds.
    roofline_pct (when a bandwidth is known): the time the decode steps need at that bandwidth
    (weights + the KV cache at the mean context, prompt_len + output_len / 2, per sequence)
    over the time they took, in %.
    """
    seconds = sum(t.end - t.start for t in timings)
    tokens = sum(len(tt) for t in timings for tt in t.token_times)
    ttft = [tt[0] - t.start for t in timings for tt in t.token_times if tt]
    itl = [b - a for t in timings for tt in t.token_times for a, b in zip(tt, tt[1:])]
    dec_tokens = dec_steps = 0
    dec_seconds = 0.0
    for t in timings:
        begin = max(tt[0] for tt in t.token_times)
        end = max(tt[-1] for tt in t.token_times)
        dec_tokens += sum(1 for tt in t.token_times for x in tt if x > begin)
        dec_steps += sum(1 for x in t.step_times if begin < x <= end)
        dec_seconds += end - begin
    ms = lambda v: None if v is None else 1000 * v  # noqa: E731
    step_bytes = wbytes + batch_size * (prompt_len + output_len / 2) * kv_bytes_per_token
    decode_ok = dec_seconds > 0 and dec_steps > 0
    return dict(
        batch_size=batch_size, prompt_len=prompt_len, output_len=output_len, requests=len(ttft),
        batches=len(timings), output_tokens=tokens, seconds=seconds, tok_s=tokens / seconds if seconds > 0 else None,
        decode_tokens=dec_tokens, decode_steps=dec_steps, decode_seconds=dec_seconds,
        decode_tok_s=dec_tokens / dec_seconds if decode_ok else None,
        ttft_p50_ms=ms(percentile(ttft, 50)), ttft_p99_ms=ms(percentile(ttft, 99)),
        itl_p50_ms=ms(percentile(itl, 50)), itl_p99_ms=ms(percentile(itl, 99)), itl_count=len(itl),
        weight_bytes=wbytes, weight_gb_s=wbytes * dec_steps / dec_seconds / 1e9 if decode_ok else None,
        bandwidth_gb_s=None if bandwidth is None else bandwidth / 1e9,
        roofline_pct=(100 * dec_steps * step_bytes / bandwidth / dec_seconds
                      if decode_ok and bandwidth else None),
        preemptions=sum(t.preemptions for t in timings),
    )


def measure_speed(model: str | LLM, batch_sizes: Sequence[int] | None = None, prompt_len: int | None = None,
                  output_len: int | None = None, device: str = "cpu", dtype: str = "auto", reps: int = 2,
                  seed: int = 0, bandwidth: float | None = None, progress: bool = False) -> list[dict]:
    """Speed at each batch size, one dict per batch size (keys: see `summarize`, plus device
    and dtype; times in ms, rates per second, bytes per second as GB/s).

    model: a model folder / alias / checkpoint, loaded on `device` in `dtype` with quantized
    linears on their kernels (as `optllm serve` runs them), or an LLM already built (then
    device and dtype are its own). Unset batch_sizes / prompt_len / output_len take
    `speed_defaults(device)`. Per batch size: one warm-up batch, then `reps` measured batches
    of fresh random prompts (random.Random(seed)). bandwidth: bytes/s for the roofline
    (default: BANDWIDTH by GPU name; no roofline on CPU).
    """
    if isinstance(model, LLM):
        device = str(model.engine.runner.device)
    sizes, prompt_len, output_len = speed_shape(device, batch_sizes, prompt_len, output_len)
    _check_int("reps", reps, 1)
    llm = model if isinstance(model, LLM) else load_for_speed(model, device, dtype, sizes, prompt_len, output_len)
    runner = llm.engine.runner
    if bandwidth is None:
        bandwidth = bandwidth_of(str(runner.device))
    wbytes, kv_tok = weight_bytes(llm), runner.kv_spec.bytes_per_token()
    params = SamplingParams(temperature=0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True,
                            detokenize=False)
    low = min(100, runner.vocab_size // 2)  # past the usual special-token ids
    rng = random.Random(seed)

    def prompts(bs: int) -> list[list[int]]:
        return [[rng.randrange(low, runner.vocab_size) for _ in range(prompt_len)] for _ in range(bs)]

    rows = []
    bar = _bar(len(sizes) * (reps + 1)) if progress else None
    try:
        for bs in sizes:
            timings = []
            for r in range(reps + 1):  # the first batch warms up (kernel tuning, allocator, caches)
                t = stream_batch(llm, prompts(bs), params)
                if any(len(tt) != output_len for tt in t.token_times):
                    raise RuntimeError(f"batch size {bs}: a request did not produce exactly {output_len} tokens")
                if r:
                    timings.append(t)
                if bar is not None:
                    bar.update(1)
            rows.append(dict(summarize(timings, bs, wbytes, kv_tok, prompt_len, output_len, bandwidth),
                             device=_device_name(runner.device), dtype=str(runner.dtype).removeprefix("torch.")))
    finally:
        if bar is not None:
            bar.close()
    return rows


def speed_shape(device: str, batch_sizes: Sequence[int] | str | None, prompt_len: int | None,
                output_len: int | None) -> tuple[tuple[int, ...], int, int]:
    """(batch sizes, prompt_len, output_len): the ones given, checked (UserError, one line),
    the device's defaults for the rest."""
    d_sizes, d_prompt, d_output = speed_defaults(device)
    sizes = parse_batch_sizes(d_sizes if batch_sizes is None else
                              batch_sizes if isinstance(batch_sizes, str) else list(batch_sizes))
    prompt_len = d_prompt if prompt_len is None else prompt_len
    output_len = d_output if output_len is None else output_len
    _check_int("--prompt-len", prompt_len, 1)
    _check_int("--output-len", output_len, 2)  # an inter-token latency needs two tokens
    return sizes, prompt_len, output_len


def load_for_speed(model: str, device: str, dtype: str, batch_sizes: Sequence[int], prompt_len: int,
                   output_len: int) -> LLM:
    """The model on the runtime as `optllm serve` runs it (quantized linears on their kernels,
    CUDA graphs), sized to run the largest batch at once."""
    return LLM(str(model), device=device, dtype=dtype, quantized_linear="kernel",
               max_model_len=prompt_len + output_len, max_num_seqs=max(batch_sizes))


def evaluate_speed(models: Sequence[str], batch_sizes: Sequence[int] | str | None = None,
                   prompt_len: int | None = None, output_len: int | None = None, device: str = "cpu",
                   dtype: str = "auto", reps: int = 2, seed: int = 0, bandwidth: float | None = None,
                   progress: bool = True) -> list[dict]:
    """measure_speed for each model in turn (each freed before the next loads), every model
    on the same prompts: [{"speed": its rows, "scheme": the checkpoint's, "seconds": load and
    measurement}]. Arguments are checked before any model loads."""
    sizes, prompt_len, output_len = speed_shape(device, batch_sizes, prompt_len, output_len)
    _check_int("reps", reps, 1)
    check_bandwidth(bandwidth)
    out = []
    for name in models:
        t0 = time.perf_counter()
        llm = load_for_speed(name, device, dtype, sizes, prompt_len, output_len)
        rows = measure_speed(llm, sizes, prompt_len, output_len, reps=reps, seed=seed, bandwidth=bandwidth,
                             progress=progress)
        out.append(dict(speed=rows, scheme=checkpoint_kind(llm.engine.source.folder),
                        seconds=time.perf_counter() - t0))
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def check_bandwidth(bandwidth: float | None) -> float | None:
    """bandwidth (bytes/s, None: not given) as given; UserError (in GB/s, as --bandwidth
    takes it) unless it is > 0."""
    if bandwidth is not None and not bandwidth > 0:
        raise UserError(f"--bandwidth {bandwidth / 1e9:g} is not allowed; allowed: a number of GB/s > 0")
    return bandwidth


def _check_int(name: str, v, low: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise UserError(f"{name} {v!r} is not allowed; allowed: an integer >= {low}")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def _bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="speed", unit="batch")
