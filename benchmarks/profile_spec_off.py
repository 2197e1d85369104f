"""Why a plain decode step costs more with a draft loaded (issue 15: with speculation off the EAGLE
engine ran at 0.69-0.86x of plain at batch 32-64 on the H200): the same decode workload on an engine
without a draft and on one with a draft whose adaptive policy never speculates (its cost table set so
that no tree can win), per-step wall time of engine.step split into schedule / execute / the rest,
then torch.profiler's top operations by CPU and by device time over a few steps of each.
--trees N,...: also the draft engine with speculation always on (the fixed policy, EAGLE trees of
N draft nodes): where a speculative step's time goes (its kernels' count and summed device time per
step beside the step's wall time; tokens a sequence gets per step).
--order plain,off,plain,...: the engines in that order (an engine built later in a process may pay
for what earlier ones left behind); each row also times its decode graph's replay alone (host
time of CUDAGraph.replay() and replay + synchronize, the same batch bucket), apart from the step.

    python benchmarks/profile_spec_off.py smollm2-135m --draft D [--batch 64] [--device cuda] [--trees 40,8]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch


def engine(model: str, draft: str | None, args, tree: int = 0):
    from optllm.runtime.llm import LLM
    from optllm.runtime.spec.policy import CostTable

    kw = dict(draft=draft, spec_policy="adaptive") if draft else {}
    if tree:
        kw = dict(draft=draft, spec_policy="fixed", spec_num_draft=tree)
    # two engines live one after the other in this process: each gets under half of the GPU
    llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=args.batch, gpu_memory_utilization=0.4,
              **kw)
    if draft and not tree:  # no tree can ever beat a plain step: speculation stays off, exploration too
        pol = llm.engine.runner.spec.policy
        pol.cost = CostTable(pol.cost.batches, {n: [1.0 if n == 1 else 1e6] * len(pol.cost.batches)
                                                for n in pol.cost.ms})
    return llm


def timed_steps(llm, args, prof=None) -> dict:
    """Median step / schedule / execute milliseconds of args.steps decode steps of args.batch
    sequences after their prefill (the profiler, when given, records those steps only), mean
    tokens a sequence gets per step; the requests are aborted at the end."""
    from optllm.runtime.sampling_params import SamplingParams

    eng = llm.engine
    # a speculative step emits up to depth + 1 tokens: no sequence may finish inside the window
    params = SamplingParams(temperature=0, max_tokens=8 * args.steps + 8, ignore_eos=True, detokenize=False)
    vocab = eng.runner.vocab_size
    rids = [eng.add_request([1 + (i * 7919 + j * 31) % (vocab - 1) for j in range(args.prompt_len)], params)
            for i in range(args.batch)]
    while any(s.num_uncomputed_tokens > 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()  # prefill
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    parts: dict[str, list[float]] = {"schedule": [], "execute": [], "step": [], "tokens": []}
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
    if prof is not None:
        sync()
        prof.start()
    for _ in range(args.steps):
        sync()
        before = sum(len(s.output_token_ids) for s in eng.scheduler.running)
        t = time.perf_counter()
        eng.step()
        parts["step"].append(time.perf_counter() - t)
        after = sum(len(s.output_token_ids) for s in eng.scheduler.running)
        parts["tokens"].append((after - before) / max(1, len(eng.scheduler.running)))
    if prof is not None:
        sync()
        prof.stop()
    eng.scheduler.schedule, eng.runner.execute = sched, run
    for rid in rids:
        eng.abort_request(rid)
    tokens = parts.pop("tokens")
    return {**{k: 1e3 * statistics.median(v) for k, v in parts.items()}, "tokens": statistics.fmean(tokens)}


def replay_only(llm, reps: int = 200) -> dict:
    """Median µs of the engine's decode graph for its largest bucket replayed alone: host time of
    replay(), and replay() + synchronize() (inputs as the last step left them); {} without graphs."""
    graphs = llm.engine.runner.graphs
    if graphs is None or graphs.eager_stand_in:
        return {}
    from optllm.benchmarks.common import replay_us

    host, full = replay_us(graphs.graphs[graphs.buckets[-1]], reps, warmup=20)
    return {"replay_host_us": host, "replay_sync_us": full}


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
    ap.add_argument("--trees", default="", help="N,...: also speculation always on, EAGLE trees of N draft nodes")
    ap.add_argument("--order", default="plain,off", help="engines before the trees: plain (no draft), off (draft, "
                                                          "speculation off), in this order, repeats allowed")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    rows = {}
    kinds = {"plain": ("no draft", None), "off": ("draft, speculation off", args.draft)}
    bad = [k for k in args.order.split(",") if k not in kinds]
    if bad:
        ap.error(f"--order {args.order!r}: {', '.join(map(repr, bad))} not allowed; allowed: plain, off")
    runs, seen = [], {}
    for k in args.order.split(","):
        label, draft = kinds[k]
        seen[label] = seen.get(label, 0) + 1
        runs.append((label if seen[label] == 1 else f"{label} ({seen[label]})", draft, 0))
    trees = [int(n) for n in args.trees.split(",") if n]
    runs += [(f"draft, tree of {n} + 1 every step", args.draft, n) for n in trees]
    # timing first, every engine; profiling after (once torch.profiler has run in a process, CUPTI
    # stays attached and every later graph launch pays for it: ~0.1 ms a decode step on the H200)
    for phase in ("time", "profile") if args.profile else ("time",):
        for label, draft, tree in runs:
            llm = engine(args.model, draft, args, tree)
            if phase == "time":
                rows[label] = timed_steps(llm, args)
                rows[label].update(replay_only(llm))
            else:
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
                steps = 8
                prof = profile(activities=acts)
                timed_steps(llm, argparse.Namespace(**{**vars(args), "steps": steps}), prof)
                key = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
                kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
                rows[label]["kernels"] = len(kernels) / steps
                rows[label]["kernel_ms"] = sum(e.device_time for e in kernels) / 1e3 / steps
                print(f"## {label}: top operations by {key}")
                print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=70))
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    print(f"| engine (batch {args.batch}) | step ms | schedule ms | execute ms | tokens / seq-step "
          "| kernels / step | kernel ms / step | graph replay() host µs | replay + sync µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['step']:.3f} | {r['schedule']:.3f} | {r['execute']:.3f} | {r['tokens']:.2f} "
              f"| {r.get('kernels', float('nan')):.0f} | {r.get('kernel_ms', float('nan')):.3f} "
              f"| {r.get('replay_host_us', float('nan')):.1f} | {r.get('replay_sync_us', float('nan')):.1f} |")


if __name__ == "__main__":
    main()
