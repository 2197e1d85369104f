"""What holding a draft costs a plain decode step on the GPU: the decode step of an engine with an
EAGLE-3 draft (which stores the draft's inputs, fc over the target's three auxiliary states, at
every row it computes) against the same step of an engine without one.

The H100's temperature-1 waves had the draft engine's plain decode graphs at 0.968 ms a step against
the plain engine's 0.958 at batch 8 (+1.0%), with the store inside the decode graph, before the
step's tokens. Since the thirty-seventh session the store runs after the point the host waits for:
"draft" is the runtime's default (inside the decode graph after its fence's mark, where
``graph_fence_ok``: one replay a step), "draft, store apart" the thirty-seventh session's (a graph of
its own, replayed after the host's fence), "draft, fused store" the default with the store as one
launch (kernels/fc_scatter.py, opt-in). Each step here is as the runner runs it: the decode graph's
replay, the fence, the store's replay where it is apart, the host's wait for the tokens, and HOST_US
of host work (a server's next step being scheduled, which the store's GPU time overlaps), on a
random model of SmolLM2's shapes (benchmarks/random_smol.py), every row a real sequence of CONTEXT
keys, greedy and at temperature 1, rounds interleaved, the median of ROUNDS rounds of REPS steps
each (µs a step, the host work taken out). Then, with --profile, each engine's kernels at batch 8
under torch.profiler (name, count, GPU µs), so a difference has a name.

    python benchmarks/dormant_cost.py [--root DIR] [--batches 1,8,32,64] [--context 256]
        [--reps 200] [--rounds 7] [--host-us 60] [--profile] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from unittest import mock


def fill(graphs, b: int, context: int, temp: float) -> None:
    """Bucket b's staging buffers: b rows, each the next token of its own sequence of `context`
    keys (blocks laid out one sequence after another), at temperature temp."""
    size = graphs.bucket(b)
    bs = 16
    per = -(-context // bs)
    q, i = graphs.i64.np, graphs.i32.np
    for r in range(size):
        q[r] = 5 + r
        q[size + r] = context - 1
        first = r * per
        q[2 * size + r] = (first + (context - 1) // bs) * bs + (context - 1) % bs
        i[r] = context
        i[2 * size + r * graphs.width:2 * size + r * graphs.width + per] = range(first, first + per)
    graphs.temps[size:2 * size] = temp  # (each replay copies the host buffers in: its captured upload)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/catch_up_models"))
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--host-us", type=float, default=60.0, help="host work a step after its tokens (µs)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import torch
    from common import ensure_random_smol

    from optllm import LLM

    ensure_random_smol(a.root)
    batches = [int(b) for b in a.batches.split(",")]
    most = max(batches)
    per = -(-a.context // 16)
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=most, max_model_len=a.context + 64,
              num_kv_blocks=most * per + 8, enable_prefix_caching=False)
    from optllm.runtime import spec_runner
    from optllm.runtime.cuda_graphs import DecodeGraphs

    def draft_engine(pin=None):
        """A draft engine, built with pin's (object, attribute, value) set."""
        with mock.patch.object(*pin) if pin else contextlib.nullcontext():
            return LLM(str(a.root / "target"), draft=str(a.root / "eagle3"), spec_policy="adaptive", **kw)

    engines = {"plain": LLM(str(a.root / "target"), **kw), "draft": draft_engine(),
               "draft, store apart": draft_engine((DecodeGraphs, "store_in_graph", False)),
               "draft, fused store": draft_engine((spec_runner, "FUSED_STORE", True))}
    print("the draft engine's store: " + ("inside the decode graph, after its fence's mark"
                                          if engines["draft"].engine.runner.graphs.in_graph else
                                          "a graph of its own (graph_fence_ok is False here)"))
    graphs = {name: llm.engine.runner.graphs for name, llm in engines.items()}

    def timed(g, b: int) -> float:
        """µs a step of bucket b as the runner runs it, REPS steps: the decode graph's replay, its fence,
        the feature store's graph where it is apart, the host waiting on the fence for the tokens,
        then HOST_US of host work (the next step's scheduling and inputs, which the store's GPU time
        can overlap) -- wall time over the steps."""
        size = g.bucket(b)
        graph, store, fence = g.graphs[size], g.stores.get(size), g.fence
        gap = a.host_us * 1e-6
        t0 = time.perf_counter()
        for _ in range(a.reps):
            graph.replay()
            fence.replayed()
            if store is not None:
                store.replay()
            fence.wait()
            t = time.perf_counter() + gap
            while time.perf_counter() < t:
                pass
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6 / a.reps - a.host_us

    rows = []
    others = [n for n in graphs if n != "plain"]
    print("| batch | temp | plain µs | " + " | ".join(f"{n} µs | / plain" for n in others) + " |\n"
          + "|---|---|---|" + "---|---|" * len(others))
    for b in batches:
        for temp in (0.0, 1.0):
            times: dict[str, list[float]] = {name: [] for name in graphs}
            for name, g in graphs.items():
                fill(g, b, a.context, temp)
                timed(g, b)  # warm
            for _ in range(a.rounds):
                for name, g in graphs.items():
                    times[name].append(timed(g, b))
            med = {n: statistics.median(v) for n, v in times.items()}
            p = med["plain"]
            rows.append({"batch": b, "temperature": temp, "us": med, "ratio": {n: med[n] / p for n in others},
                         "rounds": times})
            print(f"| {b} | {temp:g} | {p:.1f} | " + " | ".join(f"{med[n]:.1f} | {med[n] / p:.3f}" for n in others)
                  + " |", flush=True)
    prof = {}
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        b = 8 if 8 in batches else batches[0]
        for name, g in graphs.items():
            fill(g, b, a.context, 0.0)
            graph, store = g.graphs[g.bucket(b)], g.stores.get(g.bucket(b))
            graph.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as pr:
                for _ in range(20):
                    graph.replay()
                    if store is not None:
                        store.replay()
                torch.cuda.synchronize()
            ev = [e for e in pr.key_averages() if e.self_device_time_total > 0]
            ev.sort(key=lambda e: -e.self_device_time_total)
            lines = [f"{e.count / 20:6.1f} x {e.self_device_time_total / 20:9.2f} µs  {e.key[:110]}" for e in ev]
            total = sum(e.self_device_time_total for e in ev) / 20
            prof[name] = {"total_us": total, "kernels": lines}
            print(f"\n{name} engine, batch {b}: {total:.1f} µs of kernels a replay, "
                  f"{sum(e.count for e in ev) / 20:.0f} kernels\n" + "\n".join(lines[:40]))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "dormant_cost.json").write_text(json.dumps({"rows": rows, "profile": prof}, indent=1))


if __name__ == "__main__":
    main()
