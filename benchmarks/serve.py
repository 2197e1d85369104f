"""The server's own overhead: the same requests offline (LLM.generate) and through `optllm serve`.

    python benchmarks/serve.py [--requests 256] [--clients 64] [--model 8b|smol] [--out DIR]

The requests are benchmarks/decode.py's serve256 set: prompt and output lengths uniform in
[100, 1024] (seed 0), random token ids, greedy, EOS ignored, exact output lengths, text
detokenized (as the server does). First every request through LLM.generate in this process,
twice: all at once (max_num_seqs 256) and at most --clients at once (max_num_seqs = clients:
the concurrency the clients give the server, so the ratio to it is the server's own
overhead); then the same
requests through a server process (`optllm serve --load-format dummy`, random weights in
the model's shape), sent as token-id prompts to /v1/completions with stream=true by
`--clients` concurrent clients (threads, http.client: the standard library only, so the
GPU machine needs nothing installed). Reports output tok/s both ways and their ratio, TTFT
and inter-token latency p50 / p99 seen by the clients, in a table, JSON and Markdown.
--repeats R measures the same-concurrency offline run and the server R times, alternately
(the ratio is taken per round: a slow spell of a shared machine then hits both sides);
--profile-s S records S seconds of the first server run's two processes (server and
engine) with py-spy, when it is installed, to profile_server.txt / profile_engine.txt.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import queue
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from optllm.benchmarks.common import LLAMA3_8B, SMOLLM2, provenance, shape_folder


def requests_set(n: int, vocab: int):
    rng = random.Random(0)
    lens = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(n)]
    prompts = [[rng.randrange(100, min(vocab, 30000)) for _ in range(p)] for p, _ in lens]
    return prompts, [o for _, o in lens]


def offline(folder, prompts, outs, engine_args) -> dict:
    import torch

    from optllm import LLM, SamplingParams

    llm = LLM(str(folder), load_format="dummy", **engine_args)
    params = [SamplingParams(temperature=0, max_tokens=o, min_tokens=o, ignore_eos=True) for o in outs]
    llm.generate(prompts[:8], params[:8])  # warm-up
    t0 = time.perf_counter()
    res = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    tokens = sum(len(r.outputs[0].token_ids) for r in res)
    del llm
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
    return dict(s=dt, tokens=tokens, tok_s=tokens / dt)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(port: int, prompt: list[int], out_len: int) -> dict:
    """Stream one completion; (first-token time, per-token gaps, tokens) as the client sees them."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": out_len, "min_tokens": out_len, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    first, last, gaps, tokens = None, None, [], 0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        now = time.perf_counter()
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        if event.get("choices"):
            if first is None:
                first = now - t0
            elif last is not None:
                gaps.append(now - last)
            last = now
    conn.close()
    return dict(ttft=first, gaps=gaps, tokens=tokens)


def engine_pid(server_pid: int) -> int | None:
    """The server's engine process (the child multiprocessing spawned), from Linux's /proc."""
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    cmd = c.read()
                if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                    return int(child)
    return None


def profile(pids: dict, seconds: int, out: Path) -> list:
    """py-spy (if installed) on each process for `seconds`, in the background: raw stacks
    with idle time, per thread, to out/profile_NAME.txt."""
    import shutil

    spy = shutil.which("py-spy")
    if spy is None:
        return []
    return [subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200",
                              "--format", "raw", "--idle", "--threads", "--nonblocking",
                              "-o", str(out / f"profile_{name}.txt")], stdout=subprocess.DEVNULL,
                             stderr=subprocess.STDOUT)
            for name, pid in pids.items() if pid is not None]


def through_server(folder, prompts, outs, clients: int, engine_args: dict, profile_s: int = 0,
                   out: Path | None = None) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "optllm", "serve", str(folder), "--port", str(port), "--load-format", "dummy"]
    for k, v in engine_args.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    log = open(os.environ.get("OUT", "/tmp") + "/serve_server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(3000):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} (its log: {log.name})")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError("the server did not come up")
        for i in range(min(8, len(prompts))):  # warm-up (CUDA graphs are captured at start already)
            one_request(port, prompts[i], 16)
        work: queue.Queue = queue.Queue()
        for i in range(len(prompts)):
            work.put(i)
        results: list = [None] * len(prompts)

        def client():
            while True:
                try:
                    i = work.get_nowait()
                except queue.Empty:
                    return
                results[i] = one_request(port, prompts[i], outs[i])

        threads = [threading.Thread(target=client) for _ in range(clients)]
        spies = profile({"server": proc.pid, "engine": engine_pid(proc.pid)}, profile_s, out) if profile_s else []
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        for spy in spies:
            spy.wait(timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        log.close()
    tokens = sum(r["tokens"] for r in results)
    ttft = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None  # noqa: E731
    return dict(s=dt, tokens=tokens, tok_s=tokens / dt, ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99),
                itl_p50=pct(gaps, 0.5), itl_p99=pct(gaps, 0.99), itl_mean=statistics.fmean(gaps) if gaps else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--model", choices=("8b", "smol"), default="8b")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--root", type=Path, default=Path("/tmp/optllm-bench"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure offline (same concurrency) and the server this many times, alternately")
    ap.add_argument("--no-all-at-once", action="store_true", help="skip the offline run with max_num_seqs 256")
    ap.add_argument("--profile-s", type=int, default=0,
                    help="py-spy the server and engine processes for this many seconds of the first server run")
    a = ap.parse_args()
    cfg = LLAMA3_8B if a.model == "8b" else SMOLLM2
    folder = shape_folder(a.root, f"{a.model}-shape", cfg)
    prompts, outs = requests_set(a.requests, cfg["vocab_size"])
    engine_args = dict(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048, device=a.device)
    info = provenance()
    print(json.dumps(info), flush=True)
    off = None if a.no_all_at_once else offline(folder, prompts, outs, engine_args)
    print(json.dumps(dict(offline=off)), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for r in range(a.repeats):  # alternately, so that a slow spell of the machine hits both sides
        matched = offline(folder, prompts, outs, {**engine_args, "max_num_seqs": a.clients})
        print(json.dumps(dict(offline_matched=matched)), flush=True)
        srv = through_server(folder, prompts, outs, a.clients, engine_args, a.profile_s if r == 0 else 0, a.out)
        print(json.dumps(dict(server=srv)), flush=True)
        pairs.append((matched, srv))
    ms = lambda v: "–" if v is None else f"{1000 * v:.1f}"  # noqa: E731
    table = ("| path | run | requests | output tokens | s | tok/s | vs offline, same concurrency, same round "
             "| TTFT p50 / p99 ms | ITL p50 / p99 ms |\n|---|---|---|---|---|---|---|---|---|\n")
    if off is not None:
        table += (f"| LLM.generate, all at once | – | {a.requests} | {off['tokens']} | {off['s']:.2f} | "
                  f"{off['tok_s']:.1f} | {off['tok_s'] / pairs[0][0]['tok_s']:.2f} | – | – |\n")
    for r, (matched, srv) in enumerate(pairs, 1):
        table += (f"| LLM.generate, max_num_seqs {a.clients} | {r} | {a.requests} | {matched['tokens']} | "
                  f"{matched['s']:.2f} | {matched['tok_s']:.1f} | 1.00 | – | – |\n"
                  f"| optllm serve, {a.clients} clients | {r} | {a.requests} | {srv['tokens']} | {srv['s']:.2f} | "
                  f"{srv['tok_s']:.1f} | {srv['tok_s'] / matched['tok_s']:.2f} | "
                  f"{ms(srv['ttft_p50'])} / {ms(srv['ttft_p99'])} | {ms(srv['itl_p50'])} / {ms(srv['itl_p99'])} |\n")
    ratios = sorted(s_['tok_s'] / m['tok_s'] for m, s_ in pairs)
    table += f"\nserver / offline at the same concurrency, per round: {', '.join(f'{x:.3f}' for x in ratios)}\n"
    (a.out / "serve.json").write_text(json.dumps(dict(info=info, offline=off, rounds=[
        dict(offline_matched=m, server=s_) for m, s_ in pairs]), indent=1))
    md = "\n".join(f"- {k}: {v}" for k, v in info.items()) + "\n\n" + table
    (a.out / "serve.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
