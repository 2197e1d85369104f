"""How many of a continuous load's steps are mixed (prefill + decodes, run eagerly) and how many
decode-only (a CUDA-graph replay), by the scheduler alone, for each admit_group.

    python benchmarks/admission_steps.py [--batch-sizes 8,32,64] [--reps 3] [--output-len 128]
        [--prompt-len 48] [--admit-groups 1,2,4,8,16] [--graph-ms 1.33] [--eager-ms E]
        [--out DIR]

The load is `optllm eval --spec-load continuous`'s: batch * reps requests arrive at once, at
most batch run, output lengths spread_lengths(n, output_len) (eval/speculation.py), greedy with
EOS ignored, so each request's length is fixed and the scheduler's choices do not depend on the
model: Scheduler.schedule / update run here with no model (plain decoding, no draft). Reported
per case: steps, decode-only steps, mixed steps, mean sequences a step, mean wait of a request
for its first step (in steps).

--eager-ms: a mixed step's cost; with --graph-ms (a decode-only step's) each row gets a
*predicted* time a pass and tokens a ms -- a model, not a measurement: it takes both costs as
constants, where the real ones grow with the batch and the prefill's tokens. Without
--eager-ms the prediction is left out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from optllm.eval.speculation import spread_lengths
from optllm.runtime.config import SchedulerConfig
from optllm.runtime.sampling_params import SamplingParams
from optllm.runtime.scheduler import Scheduler
from optllm.runtime.sequence import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402


def simulate(batch: int, reps: int, output_len: int, prompt_len: int, admit_group: int,
             admit_max_wait: int = 8) -> dict:
    """One pass of the continuous load through the scheduler; counts as the module docstring says."""
    n = batch * reps
    cfg = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=4096, max_model_len=prompt_len + 2 * output_len,
                          block_size=16, enable_prefix_caching=False, admit_group=admit_group,
                          admit_max_wait=admit_max_wait)
    blocks = batch * (-(-(prompt_len + 2 * output_len) // 16) + 1) + 16
    sched = Scheduler(cfg, blocks)
    seqs = []
    for i, length in enumerate(spread_lengths(n, output_len)):
        s = Sequence(f"r{i}", [10 + i % 50] * prompt_len, SamplingParams(max_tokens=length, ignore_eos=True))
        sched.add(s)
        seqs.append(s)
    first_step = {}
    steps = decode_only = running = 0
    while sched.num_running or sched.num_waiting:
        batch_ = sched.schedule()
        if not len(batch_):
            raise RuntimeError("the scheduler made an empty step with work left")
        steps += 1
        decode_only += batch_.decode_only
        running += len(batch_)
        for s in batch_.seqs:
            first_step.setdefault(s.seq_id, steps)
        sched.update(batch_, [7 if batch_.samples(i) else None for i in range(len(batch_))])
    tokens = sum(s.num_output_tokens for s in seqs)
    return dict(batch=batch, admit_group=admit_group, requests=n, tokens=tokens, steps=steps,
                decode_only=decode_only, mixed=steps - decode_only, mean_running=running / steps,
                mean_first_step=sum(first_step.values()) / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="8,32,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--admit-groups", default="1,2,4,8,16")
    ap.add_argument("--graph-ms", type=float, default=None, help="a decode-only step's cost (ms)")
    ap.add_argument("--eager-ms", type=float, default=None, help="a mixed step's cost (ms)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [simulate(bs, args.reps, args.output_len, args.prompt_len, g)
            for bs in (int(x) for x in args.batch_sizes.split(","))
            for g in (int(x) for x in args.admit_groups.split(","))]
    predict = args.graph_ms is not None and args.eager_ms is not None
    head = "| batch | admit_group | steps | decode-only | mixed | mean running | mean first step |"
    if predict:
        head += " predicted ms | predicted tok/ms |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (f"| {r['batch']} | {r['admit_group']} | {r['steps']} | {r['decode_only']} | {r['mixed']} | "
                f"{r['mean_running']:.1f} | {r['mean_first_step']:.1f} |")
        if predict:
            ms = r["decode_only"] * args.graph_ms + r["mixed"] * args.eager_ms
            r["predicted_ms"] = ms
            line += f" {ms:.0f} | {r['tokens'] / ms:.1f} |"
        lines.append(line)
    table = "\n".join(lines)
    print(table)
    write_results(args.out, "admission_steps", table, dict(args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
