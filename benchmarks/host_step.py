"""The host's share of a decode step, without a model: the scheduler's pass, the step's inputs
(host_batch, the block-table gather) and the scheduler's update, for B running sequences that
each decode one token a step (16-token blocks, prefix caching on as the engine's default).
Runs on any machine; the H200 host measured 0.3 ms a step at batch 1 and ~1 ms at batch 64
outside its 0.9-1.0 ms decode graph (docs/BENCHMARKS.md, seventeenth session), not overlapped
with the GPU, so every microsecond here is a microsecond of the step.

    python benchmarks/host_step.py [--batches 1,8,64,256] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from optllm.runtime.block_table import BlockTables
from optllm.runtime.config import SchedulerConfig
from optllm.runtime.sampling_params import SamplingParams
from optllm.runtime.scheduler import Scheduler
from optllm.runtime.sequence import Sequence
from optllm.runtime.step_inputs import host_batch


def measure(bs: int, steps: int, block_size: int = 16) -> dict[str, float]:
    cfg = SchedulerConfig(max_num_seqs=bs, max_num_batched_tokens=max(2048, bs), max_model_len=4096,
                          block_size=block_size, enable_prefix_caching=True)
    blocks = bs * (4096 // block_size) + 8
    sched = Scheduler(cfg, blocks, frozenset({2}))
    tables = BlockTables(bs + 1, 4096 // block_size)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(bs):
        sched.add(Sequence(f"r{i}", [10 + (7 * i + j) % 300 for j in range(100)], params))
    parts = {"schedule": [], "host_batch": [], "update": []}
    for s in range(steps + 1):
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        host_batch(batch.seqs, batch.num_new_tokens, block_size, tables)
        t2 = time.perf_counter()
        sched.update(batch, [5 + (s % 50) if batch.samples(i) else None for i in range(len(batch))])
        t3 = time.perf_counter()
        if s:  # the first step is the prefill
            parts["schedule"].append(t1 - t0)
            parts["host_batch"].append(t2 - t1)
            parts["update"].append(t3 - t2)
    return {k: 1e6 * statistics.median(v) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    print("| batch | schedule µs | host_batch µs | update µs | total µs | µs a sequence |\n|---|---|---|---|---|---|")
    for bs in (int(b) for b in a.batches.split(",")):
        r = measure(bs, a.steps)
        tot = sum(r.values())
        cells = " | ".join(f"{v:.1f}" for v in (r["schedule"], r["host_batch"], r["update"], tot))
        print(f"| {bs} | {cells} | {tot / bs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
