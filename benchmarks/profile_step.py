"""Where a decode step's GPU time goes, kernel by kernel (issue 13: "say what fraction of a decode
step is kernel time"; the W4A16 SmolLM2 step was slower than bf16 with its GEMMs timed alone at 37%).

    python benchmarks/profile_step.py [--cases smol,smol-w4a16] [--batches 1,64] [--out DIR]
    python benchmarks/profile_step.py --model smollm2-135m --draft DIR [--batches 1,8,64]

For each case (decode.py's: random weights of the model's shape; W4A16 g64 with a bf16 LM head)
an engine decodes a batch once (its graphs captured, the kernels compiled), then its decode
graph of that batch is replayed: first timed alone with CUDA events (GPU µs a step), then under
torch.profiler, whose CUPTI trace lists every kernel of the graph. Kernels are summed per step
and grouped by what they do (W4A16 GEMM, cuBLAS GEMM, attention, norms, rotary, the rest); the
table gives each group's kernels and µs a step and its share of the graph's time. Kernel µs
summed below the graph's time is the time between kernels inside the graph (launch gaps, tails).
Timings come before any profiling: a process that ran the profiler pays more per graph launch.

With --model and --draft (issue 15: a draft engine's plain steps measured 1-6% slower than a
draft-less engine's): three engines of the model, built in this order -- without the draft, with
it (the adaptive policy, every speculative graph captured), and without it again, so that an
effect of building second is told from one of the draft -- their decode graphs timed in
interleaved rounds (the median of --rounds), then profiled the same way. --spec-trees 2,5,20
adds the draft engine's speculative step graphs (SpecStepGraphs: catch-up window, proposal,
verify, acceptance, KV move, feature store; greedy) of those tree sizes at each batch, replayed
on the inputs its last speculative step left (a pinned policy speculates through each first).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from optllm.benchmarks.common import SMOLLM2, provenance, shape_folder

GROUPS = (  # first match wins
    ("W4A16 GEMM", re.compile(r"w4a16|gemv|swap_ab|dequant|_w4", re.I)),
    ("cuBLAS / other GEMM", re.compile(r"gemm|cutlass|cublas|xmma|nvjet|sm90|sm100|matmul|_mm_", re.I)),
    ("attention", re.compile(r"attn|attention|paged|flash|_fwd", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("rotary", re.compile(r"rotary|rope", re.I)),
    ("activation", re.compile(r"silu|gelu|act_and_mul|swiglu", re.I)),
    ("copy / index", re.compile(r"copy|index|gather|scatter|cat|fill|elementwise_kernel_with_index", re.I)),
)


def group_of(name: str) -> str:
    for label, pat in GROUPS:
        if pat.search(name):
            return label
    return "other elementwise / reduce"


def graph_of(llm, bs: int):
    graphs = llm.engine.runner.graphs
    b = graphs.bucket(bs)
    return graphs.graphs[b], b


def time_graph(g, iters: int = 50) -> float:
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / iters


def profile_graph(g, steps: int) -> dict[str, dict]:
    from torch.profiler import ProfilerActivity, profile

    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            g.replay()
        torch.cuda.synchronize()
    kernels: dict[str, dict] = defaultdict(lambda: {"count": 0, "us": 0.0})
    for ev in prof.events():
        if "CUDA" not in str(getattr(ev, "device_type", "")):
            continue
        dev_us = ev.time_range.elapsed_us()
        k = kernels[ev.name]
        k["count"] += 1
        k["us"] += dev_us
    if not kernels:
        print("warning: the profiler listed no kernel of the graph's replays", flush=True)
    return {name: {"count": v["count"] / steps, "us": v["us"] / steps} for name, v in kernels.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="smol,smol-w4a16")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--root", type=Path, default=Path("/tmp/optllm-shapes"))
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--model", default=None, help="a model of ours to load (with --draft)")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--spec-trees", default="", help="with --draft: speculative step graphs of these tree sizes")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    from optllm import LLM, SamplingParams
    from optllm.runtime.config import EngineConfig

    # every engine lives at once: each a KV cache of what the batch needs (not a share of the GPU)
    size = dict(max_num_seqs=max(batches), max_model_len=256,
                num_kv_blocks=EngineConfig.kv_blocks_for(max(batches), 320))
    if a.model:
        if not a.draft:
            sys.exit("--model needs --draft (the engines compared are without and with it)")
        plain = dict(model=a.model, **size)
        specs = {"plain": plain, "draft": dict(plain, draft=a.draft, spec_policy="adaptive"), "plain again": plain}
    else:
        specs = {}
        for case in a.cases.split(","):
            if case not in ("smol", "smol-w4a16"):
                sys.exit(f"--cases: unknown {case}; allowed: smol, smol-w4a16")
            w4 = case == "smol-w4a16"
            folder = shape_folder(a.root, f"smollm2-135m{'-w4a16' if w4 else ''}-shape", SMOLLM2, w4a16=w4, group=64)
            specs[case] = dict(model=str(folder), load_format="dummy", **size)
    engines, times = {}, defaultdict(list)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
    items = {}  # (case, batch) -> (graph, bucket)
    for case in specs:
        llm = engines[case] = LLM(**specs[case])
        for bs in batches:
            prompts = [[100 + (7 * i + j) % 20000 for j in range(32)] for i in range(bs)]
            llm.generate(prompts, greedy)
            items[(case, bs)] = graph_of(llm, bs)
    trees = [int(t) for t in a.spec_trees.split(",") if t]
    if trees and not a.draft:
        sys.exit("--spec-trees needs --model and --draft (the speculative graphs are the draft engine's)")
    if trees and "draft" in engines:
        spec = engines["draft"].engine.runner.spec
        for n in trees:
            if spec.graphs is None or n not in spec.sizes:
                sys.exit(f"--spec-trees: no speculative step graphs of {n} nodes (menu {spec.sizes})")
            # speculate with trees of n
            spec.policy.choose = lambda ids, budget=None, behind=0, sampled=False, rest=0, left=None, n=n: n
            for bs in batches:
                b = spec.graphs.bucket(bs, n)
                if b is None:
                    print(f"trees of {n} at batch {bs}: no graph (eager past the token cap)", flush=True)
                    continue
                prompts = [[100 + (7 * i + j) % 20000 for j in range(32)] for i in range(bs)]
                engines["draft"].generate(prompts, greedy)
                items[(f"draft, trees of {n}", bs)] = (spec.graphs.graphs[(b, n, False)], b)
    cases = list(dict.fromkeys(c for c, _ in items))
    timed = {}
    for _ in range(a.rounds):  # every timing before any profiling, the engines interleaved
        for key, (g, _b) in items.items():
            times[key].append(time_graph(g))
    for key, (_g, bucket) in items.items():
        timed[key] = (statistics.median(times[key]), bucket)
        print(f"{key[0]} bs {key[1]}: graph {timed[key][0]:.1f} us (rounds: "
              f"{', '.join(f'{t:.1f}' for t in times[key])})", flush=True)
    rows, lines = [], []
    for case in cases:
        for bs in batches:
            if (case, bs) not in items:
                continue
            g, bucket = items[(case, bs)]
            graph_us = timed[(case, bs)][0]
            kernels = profile_graph(g, a.steps)
            groups: dict[str, dict] = defaultdict(lambda: {"count": 0.0, "us": 0.0})
            for name, v in kernels.items():
                grp = groups[group_of(name)]
                grp["count"] += v["count"]
                grp["us"] += v["us"]
            total = sum(v["us"] for v in kernels.values())
            rows.append(dict(case=case, batch=bs, bucket=bucket, graph_us=graph_us, rounds_us=times[(case, bs)],
                             kernel_us=total,
                             kernels_per_step=sum(v["count"] for v in kernels.values()),
                             groups=dict(groups), kernels=kernels))
            lines.append(f"\n### {case}, batch {bs} (graph bucket {bucket}): graph {graph_us:.1f} µs a step, "
                         f"kernels {total:.1f} µs ({100 * total / graph_us:.0f}%), "
                         f"{rows[-1]['kernels_per_step']:.0f} kernels\n")
            lines.append("| group | kernels a step | µs a step | % of the graph's time |\n|---|---|---|---|")
            for label, v in sorted(groups.items(), key=lambda kv: -kv[1]["us"]):
                lines.append(f"| {label} | {v['count']:.0f} | {v['us']:.1f} | {100 * v['us'] / graph_us:.1f}% |")
            gap = graph_us - total
            lines.append(f"| between kernels | – | {gap:.1f} | {100 * gap / graph_us:.1f}% |")
            lines.append("\nTop kernels:\n\n| kernel | a step | µs a step |\n|---|---|---|")
            for name, v in sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:12]:
                lines.append(f"| `{name[:90]}` | {v['count']:.0f} | {v['us']:.1f} |")
    del engines
    gc.collect()
    info = provenance()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "profile_step.json").write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    md = "\n".join(f"- {k}: {v}" for k, v in info.items()) + "\n" + "\n".join(lines) + "\n"
    (a.out / "profile_step.md").write_text(md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
