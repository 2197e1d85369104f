"""Why a plain decode step costs more with a draft loaded (issue 15: with speculation off the EAGLE
engine ran at 0.69-0.86x of plain at batch 32-64 on the H200): the same decode workload on an engine
without a draft and on one with a draft whose adaptive policy never speculates (its cost table set so
that no tree can win), per-step wall time of engine.step split into schedule / execute / the rest,
then torch.profiler's top operations by CPU and by device time over a few steps of each.

    python benchmarks/profile_spec_off.py smollm2-135m --draft D [--batch 64] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch


def engine(model: str, draft: str | None, args):
    from optllm.runtime.llm import LLM
    from optllm.runtime.spec.policy import CostTable

    kw = dict(draft=draft, spec_policy="adaptive") if draft else {}
    # two engines live one after the other in this process: each gets under half of the GPU
    llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=args.batch, gpu_memory_utilization=0.4,
              **kw)
    if draft:  # no tree can ever beat a plain step: speculation stays off, exploration too
        pol = llm.engine.runner.spec.policy
        pol.cost = CostTable(pol.cost.batches, {n: [1.0 if n == 1 else 1e6] * len(pol.cost.batches)
                                                for n in pol.cost.ms})
    return llm


def timed_steps(llm, args) -> dict:
    from optllm.runtime.sampling_params import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True, detokenize=False)
    vocab = eng.runner.vocab_size
    for i in range(args.batch):
        eng.add_request([1 + (i * 7919 + j * 31) % (vocab - 1) for j in range(args.prompt_len)], params)
    while any(s.num_uncomputed_tokens > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    parts: dict[str, list[float]] = {"schedule": [], "execute": [], "step": []}
    sched, run = eng.scheduler.schedule, eng.runner.execute

    def t_sched():
        t = time.perf_counter()
        r = sched()
        parts["schedule"].append(time.perf_counter() - t)
        return r

    def t_run(batch):
        t = time.perf_counter()
        r = run(batch)
        parts["execute"].append(time.perf_counter() - t)
        return r

    eng.scheduler.schedule, eng.runner.execute = t_sched, t_run
    for _ in range(args.steps):
        sync()
        t = time.perf_counter()
        eng.step()
        parts["step"].append(time.perf_counter() - t)
    eng.scheduler.schedule, eng.runner.execute = sched, run
    return {k: 1e3 * statistics.median(v) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--profile", action="store_true", help="also torch.profiler's top operations")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    rows = {}
    for label, draft in (("no draft", None), ("draft, speculation off", args.draft)):
        llm = engine(args.model, draft, args)
        rows[label] = timed_steps(llm, args)
        if args.profile:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
            with profile(activities=acts) as prof:
                timed_steps(llm, argparse.Namespace(**{**vars(args), "steps": 8}))
            key = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
            print(f"## {label}: top operations by {key}")
            print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"| engine (batch {args.batch}) | step ms | schedule ms | execute ms |")
    print("|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['step']:.3f} | {r['schedule']:.3f} | {r['execute']:.3f} |")


if __name__ == "__main__":
    main()
