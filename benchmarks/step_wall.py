"""Wall time of a decode step, host included, for a plain engine and a draft engine whose tree size
is pinned: what the host adds around the CUDA graphs; and of a prefill step alone (32-token prompts,
one new token each: a graph where one takes the step, else eager). Uses only the public engine API, so the same
script times two code trees (run it with each on PYTHONPATH) on the same machine.

    python benchmarks/step_wall.py --model DIR --draft DIR [--batches 1,8] [--trees 5,20] [--tag T]

Greedy, EOS ignored, 32-token prompts, --tokens new tokens a sequence; each engine is warmed up,
then --rounds runs alternate between the engines; the median of ms a step (wall time of the whole
generate call over the runner's step count) and the runner's own ms a step. A random draft accepts
almost nothing, so a pinned speculative step emits ~1 token: the step's cost is what is timed.
Writes OUT/step_wall_TAG.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from host_profile_spec import run as timed  # (wall ms a step, runner ms a step, steps) of one generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--trees", default="5,20")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args()
    from optllm import LLM, SamplingParams
    from optllm.runtime.config import EngineConfig

    batches = [int(b) for b in a.batches.split(",")]
    trees = [int(t) for t in a.trees.split(",") if t]
    kw = dict(model=a.model, device=a.device, max_num_seqs=max(batches), max_model_len=a.tokens + 128,
              num_kv_blocks=EngineConfig.kv_blocks_for(max(batches), a.tokens + 160))
    plain = LLM(**kw)
    draft = LLM(**kw, draft=a.draft, spec_policy="adaptive")
    policy = draft.engine.runner.spec.policy
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True, detokenize=False)
    rows = []
    for bs in batches:
        prompts = [[100 + (7 * i + j) % 20000 for j in range(32)] for i in range(bs)]
        cases = [("plain", plain, None)] + [(f"tree {n}", draft, n) for n in trees]
        times: dict[str, list] = {name: [] for name, _, _ in cases}
        for r in range(a.rounds + 1):  # round 0: warm-up
            for name, llm, n in cases:
                if n is not None:
                    policy.choose = lambda ids, budget=None, behind=0, sampled=False, rest=0, left=None, n=n: n
                got = timed(llm, prompts, params)
                if r:
                    times[name].append(got)
        # a prefill alone: one step of bs prompts of 32 tokens (eager, or an extend graph where one is)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
        times["prefill"] = []
        for r in range(a.rounds + 1):
            got = timed(plain, prompts, one)
            if r:
                times["prefill"].append(got)
        cases.append(("prefill", plain, None))
        for name, _, n in cases:
            wall = statistics.median(t[0] for t in times[name])
            runner = statistics.median(t[1] for t in times[name])
            rows.append(dict(batch=bs, case=name, wall_ms=wall, runner_ms=runner, steps=times[name][0][2],
                             rounds=times[name]))
            print(f"batch {bs} {name}: {wall:.3f} ms a step (runner {runner:.3f}), {times[name][0][2]} steps",
                  flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"step_wall_{a.tag}.json").write_text(json.dumps(rows, indent=1))
    lines = ["| batch | case | wall ms a step | runner ms a step | steps |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['case']} | {r['wall_ms']:.3f} | {r['runner_ms']:.3f} | {r['steps']} |"
              for r in rows]
    (a.out / f"step_wall_{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
