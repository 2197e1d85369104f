"""Where a draft engine's plain decode steps spend host time (issue 15: with speculation off, the
draft engine's steps measured 1-6% slower in runner time than a draft-less engine's, while their
decode graphs take the same GPU time, profile_step.py --model --draft).

    python benchmarks/host_profile_spec.py --model smollm2-135m --draft DIR [--batches 1,8,64]

Two engines of the model, without and with the draft (adaptive policy, its choice pinned to "no
tree" so every step is a plain one, as the policy runs it), decode the same batch in alternating
rounds; per engine and batch: wall ms a step, the runner's ms a step, then one more round under
cProfile and, where CUDA is there, one under torch's sync debug mode (every host sync the step
makes beyond its one token read-back is printed with its stack). The table lists the functions
whose own time differs most between the two engines, µs a step.

--ablate: also draft engines with a part of the dormant draft's work taken out or moved, timed in
the same rounds: "nostore" (the feature store built as a graph of its own, then never replayed: no
store at all), "noplan" (plan() returns "no speculation" at once, without the policy), and "apart"
(the feature store as a graph of its own replayed after the host's fence, the thirty-seventh
session's; "draft" stores inside the decode graph after its fence's mark where the device allows
it). What is left of "draft" minus "plain" in each says how much of it that part was.

--trees 2,5 (after the plain comparison): the draft engine's choice pinned to trees of n nodes
instead, so that every decode step speculates; per n and batch: ms a step, tokens a step, and
cProfile's functions of ours by cumulative time and all by own time, µs a step -- where a
speculative step's host time goes.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from optllm.benchmarks.common import provenance


def run(llm, prompts, params):
    r = llm.engine.runner
    s0, m0 = r.exec_steps, r.exec_ms
    t = time.perf_counter()
    llm.generate(prompts, params)
    t = time.perf_counter() - t
    steps = r.exec_steps - s0
    return 1e3 * t / steps, (r.exec_ms - m0) / steps, steps


def own_times(prof: cProfile.Profile, steps: int) -> dict[str, tuple[float, int]]:
    st = pstats.Stats(prof)
    out = {}
    for (file, line, fn), (_cc, nc, tt, _ct, _callers) in st.stats.items():
        out[f"{Path(file).name}:{line}({fn})"] = (1e6 * tt / steps, nc / steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="the requests' (1: sampled decode steps)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--trees", default="", help="tree sizes to pin, each profiled at every batch")
    ap.add_argument("--ablate", action="store_true", help="also the nostore, apart and noplan draft engines")
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args()
    from optllm import LLM, SamplingParams

    batches = [int(b) for b in a.batches.split(",")]
    from optllm.runtime.config import EngineConfig

    # both engines live at once: each a KV cache of what the batch needs (not a share of the GPU)
    # room for the largest tree past the last token: every decode step stays eligible to speculate
    kw = dict(model=a.model, device=a.device, max_num_seqs=max(batches), max_model_len=a.tokens + 128,
              num_kv_blocks=EngineConfig.kv_blocks_for(max(batches), a.tokens + 160))
    engines = {"plain": LLM(**kw), "draft": LLM(**kw, draft=a.draft, spec_policy="adaptive")}
    spec = engines["draft"].engine.runner.spec
    if spec.policy is None:
        sys.exit("the draft engine has no adaptive policy")
    spec.policy.choose = lambda ids, budget=None, behind=0, sampled=False, rest=0, left=None: 1  # every step plain
    if a.ablate:
        from unittest import mock

        from optllm.runtime.cuda_graphs import DecodeGraphs

        def dormant():
            """A draft engine whose policy never speculates (its choice pinned as the draft engine's)."""
            llm = LLM(**kw, draft=a.draft, spec_policy="adaptive")
            llm.engine.runner.spec.policy.choose = spec.policy.choose
            return llm

        with mock.patch.object(DecodeGraphs, "store_in_graph", False):  # the store a graph of its own: droppable
            engines["nostore"] = dormant()
            engines["apart"] = dormant()  # the thirty-seventh session's store, kept
        graphs = engines["nostore"].engine.runner.graphs
        if graphs is not None:  # (no graphs: an eager engine, the CPU; its store runs inside the step)
            graphs.stores.clear()
        engines["noplan"] = dormant()
        sp = engines["noplan"].engine.runner.spec

        def noplan(running, draining=False, sp=sp):
            sp.pending_cost, sp.scanned, sp.n = None, False, 1
            return 0
        sp.plan = noplan
    params = SamplingParams(temperature=a.temperature, max_tokens=a.tokens, ignore_eos=True, detokenize=False)
    rows, lines = [], []
    for bs in batches:
        prompts = [[100 + (7 * i + j) % 20000 for j in range(32)] for i in range(bs)]
        times = {k: [] for k in engines}
        for llm in engines.values():
            run(llm, prompts, params)  # warm-up
        for _ in range(a.rounds):
            for name, llm in engines.items():
                times[name].append(run(llm, prompts, params))
        prof = {}
        for name, llm in [(k, engines[k]) for k in ("plain", "draft")]:
            p = cProfile.Profile()
            p.enable()
            _, _, steps = run(llm, prompts, params)
            p.disable()
            prof[name] = own_times(p, steps)
        syncs = {}
        if a.device == "cuda":
            for name, llm in [(k, engines[k]) for k in ("plain", "draft")]:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        _, _, steps = run(llm, prompts, params)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs[name] = (len(caught) / steps, sorted({str(w.message)[:160] for w in caught})[:5])
        med = {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for k, v in times.items()}
        keys = set(prof["plain"]) | set(prof["draft"])
        diff = sorted(keys, key=lambda k: -(prof["draft"].get(k, (0, 0))[0] - prof["plain"].get(k, (0, 0))[0]))
        top = [(k, prof["plain"].get(k, (0, 0)), prof["draft"].get(k, (0, 0))) for k in diff[:15]]
        rows.append(dict(batch=bs, step_ms=med, rounds=times, syncs=syncs,
                         top=[dict(fn=k, plain_us=p[0], draft_us=d[0], plain_calls=p[1], draft_calls=d[1])
                              for k, p, d in top]))
        (p_ms, p_run), (d_ms, d_run) = med["plain"], med["draft"]
        lines.append(f"\n### batch {bs}: a step {p_ms:.3f} ms plain, {d_ms:.3f} ms with the draft "
                     f"({d_ms / p_ms:.3f}×); runner {p_run:.3f} / {d_run:.3f} ms")
        for k in [k for k in engines if k not in ("plain", "draft")]:
            lines.append(f"- {k}: a step {med[k][0]:.3f} ms ({med[k][0] / p_ms:.3f}× plain), runner {med[k][1]:.3f} ms")
        for k, (n, msgs) in syncs.items():
            lines.append(f"- host syncs a step, {k}: {n:.2f}" + "".join(f"\n  - `{m}`" for m in msgs))
        lines.append("\n| function (own time, cProfile) | plain µs a step | draft µs a step "
                     "| calls a step plain / draft |\n|---|---|---|---|")
        for k, p, d in top:
            lines.append(f"| `{k}` | {p[0]:.1f} | {d[0]:.1f} | {p[1]:.1f} / {d[1]:.1f} |")
        print("\n".join(lines[-(len(top) + 4 + len(syncs) + len(engines) - 2):]), flush=True)
    spec_rows = []
    draft = engines["draft"]
    for n in [int(t) for t in a.trees.split(",") if t]:
        if n not in spec.policy.sizes:
            print(f"tree size {n} is not in the menu {spec.policy.sizes}; skipped", flush=True)
            continue
        spec.policy.choose = lambda ids, budget=None, behind=0, sampled=False, rest=0, left=None, n=n: n
        for bs in batches:
            prompts = [[100 + (7 * i + j) % 20000 for j in range(32)] for i in range(bs)]
            run(draft, prompts, params)  # warm-up
            st0 = dict(spec.stats.as_dict())
            step_ms, runner_ms, steps = statistics.median(run(draft, prompts, params) for _ in range(a.rounds))
            p = cProfile.Profile()
            p.enable()
            _, _, psteps = run(draft, prompts, params)
            p.disable()
            st1 = spec.stats.as_dict()
            seq_steps = st1["seq_steps"] - st0["seq_steps"]
            tau = (st1["accepted"] - st0["accepted"] + seq_steps) / seq_steps if seq_steps else None
            own = own_times(p, psteps)
            cum = {}
            for (file, line, fn), (_cc, _nc, _tt, ct, _callers) in pstats.Stats(p).stats.items():
                if "optllm" in file or "/runtime/" in file:
                    cum[f"{Path(file).name}:{line}({fn})"] = 1e6 * ct / psteps
            top_cum = sorted(cum.items(), key=lambda kv: -kv[1])[:25]
            top_own = sorted(own.items(), key=lambda kv: -kv[1][0])[:20]
            spec_rows.append(dict(tree=n, batch=bs, step_ms=step_ms, runner_ms=runner_ms, steps=steps,
                                  tau=tau, cum=top_cum, own=top_own))
            lines.append(f"\n### trees of {n}, batch {bs}: {step_ms:.3f} ms a step (runner {runner_ms:.3f}), "
                         f"{steps} steps for {bs * a.tokens} tokens, τ {tau or 0:.2f}")
            lines.append("\n| ours, cumulative | µs a step |\n|---|---|")
            lines += [f"| `{k}` | {v:.1f} |" for k, v in top_cum]
            lines.append("\n| own time | µs a step | calls a step |\n|---|---|---|")
            lines += [f"| `{k}` | {v[0]:.1f} | {v[1]:.1f} |" for k, v in top_own]
            print("\n".join(lines[-(len(top_cum) + len(top_own) + 7):]), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    info = provenance()
    report = dict(info=info, rows=rows, spec_rows=spec_rows)
    (a.out / "host_profile_spec.json").write_text(json.dumps(report, indent=1, default=str))
    head = "\n".join(f"- {k}: {v}" for k, v in info.items())
    (a.out / "host_profile_spec.md").write_text(head + "\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
