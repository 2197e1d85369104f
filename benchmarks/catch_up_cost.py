"""What an EAGLE draft's eager catch-up costs (the draft run over the rows of earlier plain steps --
the prompt, or a plain stretch -- before a speculative step), by the number of rows: the H100's
temperature-1 waves measured 4.8-5.0 ms a catch-up at batch 8-64 (543-2720 rows) and 1.4 ms for 31
rows at batch 1, against ~1.4 ms for a whole graphed speculative step.

A random model of SmolLM2's shapes and a random EAGLE-3 draft for it (benchmarks/random_smol.py:
timing does not depend on the weights), served with a fixed policy (every decode speculates), so the
first decode after a prefill catches up over the prompt. Per (batch, prompt length): the catch-ups'
mean ms and rows (the runner's stats), over REPS rounds after a warm-up round; the start-up fit
(c0 + c1 * rows, measure_catch_up). Then a catch-up under torch.profiler (the second of two): its CUDA time against its
wall time, and the ops by count and time, to tell launch-bound host time from GPU time.

--min-tokens M makes the catch-up a mid-stream one, as an adaptive policy's exploring step after a
plain stretch: a request inside min_tokens cannot speculate, so its first M tokens decode plainly
(under the decode graphs, which store the draft's inputs) and the first speculative step after them
runs the draft over the prompt and those M rows. --temps 0,1 times it greedy and sampled (the
temperature-1 waves' catch-ups were the slow ones). --vary gives every request of every round a prompt
length of its own (n + 0..22), so that no two catch-ups run over the same number of rows, as in
served traffic; each round's catch-up ms are listed.

    python benchmarks/catch_up_cost.py [--root DIR] [--batches 1,8,32] [--lens 32,128,256] [--reps 3]
        [--min-tokens 0,48] [--temps 0,1] [--vary] [--profile 8,256[,M[,T]]] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/catch_up_models"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--lens", default="32,128,256")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--min-tokens", default="0", help="plain tokens before the first speculative step (each a case)")
    ap.add_argument("--temps", default="0", help="temperatures (each a case)")
    ap.add_argument("--vary", action="store_true", help="a prompt length of its own for every request")
    ap.add_argument("--profile", default="8,256",
                    help="batch,prompt[,min_tokens[,temperature]] of the profiled catch-up ('' for none)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import torch
    from common import ensure_random_smol

    from optllm import LLM, SamplingParams

    ensure_random_smol(a.root)
    batches = [int(b) for b in a.batches.split(",")]
    lens = [int(n) for n in a.lens.split(",")]
    mins = [int(m) for m in a.min_tokens.split(",")]
    temps = [float(t) for t in a.temps.split(",")]
    if a.profile:
        pf = a.profile.split(",")
        mins = sorted(set(mins) | {int(pf[2])} if len(pf) > 2 else set(mins))
    llm = LLM(str(a.root / "target"), draft=str(a.root / "eagle3"), device=a.device, dtype="bfloat16",
              spec_policy="fixed", spec_num_draft=20, spec_top_k=8, spec_depth=5, enable_prefix_caching=False,
              max_num_seqs=max(batches), max_model_len=max(lens) + max(mins) + 64 + 23 * a.vary)
    spec = llm.engine.runner.spec

    def params(m: int, temp: float) -> SamplingParams:
        return SamplingParams(temperature=temp, min_tokens=m, max_tokens=m + 3, ignore_eos=True, detokenize=False)
    sync = (lambda: torch.cuda.synchronize()) if a.device == "cuda" else (lambda: None)
    fit = spec.measure_catch_up()
    print(f"start-up fit: c0 {fit[0]:.3f} ms + c1 {fit[1] * 1e3:.3f} µs a row" if fit else "no fit (Medusa)")

    def prompts(bs: int, n: int, salt: int) -> list[list[int]]:
        extra = [(salt * 11 + 5 * i) % 23 if a.vary else 0 for i in range(bs)]
        return [[3 + (salt * 131 + 7 * i + 13 * j) % 40000 for j in range(n + extra[i])] for i in range(bs)]

    rows = []
    print("| temp | min_tokens | batch | prompt | catch-ups | rows each | ms each | µs a row | generate ms |\n"
          "|---|---|---|---|---|---|---|---|---|")
    cases = [(t, m, bs, n) for t in temps for m in mins for bs in batches for n in lens]
    for temp, m, bs, n in cases:
        llm.generate(prompts(bs, n, 0), params(m, temp))  # warm-up: any first-time compile of this shape
        st = spec.stats
        steps0, rows0, ms0 = st.caught_up_steps, st.catch_up_rows, st.catch_up_ms
        t = time.perf_counter()
        each = []
        for r in range(a.reps):
            ms_r = st.catch_up_ms
            llm.generate(prompts(bs, n, r + 1), params(m, temp))
            each.append(round(st.catch_up_ms - ms_r, 2))
        sync()
        wall = (time.perf_counter() - t) * 1e3 / a.reps
        k = st.caught_up_steps - steps0
        rw, ms = st.catch_up_rows - rows0, st.catch_up_ms - ms0
        row = {"temperature": temp, "min_tokens": m, "batch": bs, "prompt": n, "catch_ups": k,
               "rows_each": rw / max(k, 1), "ms_each": ms / max(k, 1), "us_a_row": 1e3 * ms / max(rw, 1),
               "generate_ms": wall, "ms_by_round": each}
        rows.append(row)
        print(f"| {temp:g} | {m} | {bs} | {n} | {k} | {row['rows_each']:.0f} | {row['ms_each']:.2f} "
              f"| {row['us_a_row']:.2f} | {wall:.1f} |" + (f" {each}" if a.vary else ""), flush=True)
    prof = None
    if a.profile:
        bs, n = int(pf[0]), int(pf[1])
        m = int(pf[2]) if len(pf) > 2 else 0
        temp = float(pf[3]) if len(pf) > 3 else 0.0
        from torch.profiler import ProfilerActivity, profile

        seen: list = []  # (wall ms, profile) of each catch-up
        real = spec._catch_up

        def timed(*args, **kw):
            sync()
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                out = real(*args, **kw)
                sync()
            seen.append(((time.perf_counter() - t0) * 1e3, p))
            return out

        spec._catch_up = timed
        for salt in (98, 99):
            llm.generate(prompts(bs, n, salt), params(m, temp))
        spec._catch_up = real
        if len(seen) < 2:
            sys.exit(f"--profile {a.profile}: {len(seen)} catch-up(s) ran, 2 needed (a prompt longer than the "
                     "step graph's catch-up window)")
        wall, p = seen[-1]  # the last one (the first pays the profiler's own start)
        ev = p.key_averages()
        cuda_us = sum(e.self_device_time_total for e in ev)
        launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        table = ev.table(sort_by="self_cpu_time_total", row_limit=30)
        print(f"\nprofiled catch-up (batch {bs}, prompt {n}, min_tokens {m}, temperature {temp:g}): "
              f"wall {wall:.2f} ms (under the profiler), "
              f"GPU {cuda_us / 1e3:.3f} ms, {launches} kernel launches\n{table}")
        prof = {"batch": bs, "prompt": n, "min_tokens": m, "temperature": temp, "wall_ms": wall,
                "gpu_ms": cuda_us / 1e3, "launches": launches,
                "table": table}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "catch_up_cost.json").write_text(json.dumps({"fit": fit, "rows": rows, "profile": prof}, indent=1))


if __name__ == "__main__":
    main()
