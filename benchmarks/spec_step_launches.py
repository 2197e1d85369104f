"""Kernels of one speculative step as its CUDA graph holds them (greedy, or with --temperature T
every row sampled at T: the sampled step graph's acceptance), counted on the CPU by
phase: the draft's catch-up window, the proposal (EAGLE-2 tree growth), the verify forward, the
LM head, and acceptance with the KV move and the feature store. The step's body (SpecStepGraphs'
captured function) runs once eagerly on the Triton backend under the interpreter; Triton launches
are counted as JITFunction runs and torch ops that would run a kernel on a GPU as in
benchmarks/eager_step_launches.py (views, reshapes, allocations left out). A random Llama of
SmolLM2-135M's layer count (30) at tiny widths, a pass-through draft (the counts depend on the
layers and the tree, not the widths).

    TRITON_INTERPRET=1 python benchmarks/spec_step_launches.py [--method eagle3] [--batch 4]
        [--top-k 8] [--depth 5] [--num-draft 19] [--temperature 0] [--out DIR]

Inside a graph replay on the H200 a kernel this small costs ~2-3 us (a SmolLM2 decode graph of
~312 kernels replays in ~1.1 ms): the count is the part of a speculative step's time that does
not shrink with the model.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from eager_step_launches import _NO_KERNEL, _Ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="eagle3", choices=["medusa", "eagle", "eagle3"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--num-draft", type=int, default=19)
    ap.add_argument("--temperature", type=float, default=0.0, help="every row's temperature (0: greedy)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("error: set TRITON_INTERPRET=1 (the Triton kernels run on the CPU interpreter here)")
    import torch
    from conftest import make_tiny_model, write_draft
    from triton.runtime.interpreter import InterpretedFunction

    from optllm.runtime.llm import LLM
    from optllm.runtime.sampling_params import SamplingParams
    from optllm.runtime.spec_runner import _GREEDY

    phase = ["other"]
    triton: Counter = Counter()  # (phase, kernel)
    ops: Counter = Counter()  # (phase, op)
    run = InterpretedFunction.run

    def counted(self, *a, **kw):
        triton[(phase[0], self.fn.__name__)] += 1
        _Ops.inside_triton += 1
        try:
            return run(self, *a, **kw)
        finally:
            _Ops.inside_triton -= 1

    class _PhaseOps(_Ops):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._overloadpacket.__name__
            if name not in _NO_KERNEL and not _Ops.inside_triton:
                ops[(phase[0], name)] += 1
            return func(*args, **(kwargs or {}))

    def in_phase(obj, attr, label):
        f = getattr(obj, attr)

        def g(*a, **kw):
            prev, phase[0] = phase[0], label
            try:
                return f(*a, **kw)
            finally:
                phase[0] = prev
        setattr(obj, attr, g)

    InterpretedFunction.run = counted
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_model(Path(tmp) / "m", "llama", layers=args.layers)
        kw = dict(seed=2, noise=0.3, draft_vocab=150) if args.method == "eagle3" else {}
        draft = write_draft(Path(tmp) / "d", folder, args.method, **kw)
        llm = LLM(str(folder), device="cpu", dtype="float32", kernels="triton", enable_prefix_caching=False,
                  max_num_seqs=args.batch, num_kv_blocks=256, draft=str(draft), spec_policy="fixed",
                  spec_top_k=args.top_k, spec_depth=args.depth, spec_num_draft=args.num_draft)
        eng = llm.engine
        for i in range(args.batch):
            eng.add_request([5 + i] * 12, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                                                         detokenize=False))
        for _ in range(3):
            eng.step()
        spec = eng.runner.spec
        seqs = list(eng.scheduler.running)
        g = spec.catch_rows
        ids = torch.tensor([s.token_ids[s.num_computed_tokens - g + 1: s.num_computed_tokens + 1] for s in seqs])
        ctx, tables = spec._context(seqs)
        for attr, label in (("_states_fixed", "draft catch-up window"), ("_propose", "proposal"),
                            ("_accept", "acceptance, KV move, feature store")):
            in_phase(spec, attr, label)
        in_phase(eng.runner.model, "forward", "verify forward")
        in_phase(eng.runner.model, "compute_logits", "LM head")
        triton.clear()
        with _PhaseOps():
            states = spec._states_fixed(ids, ctx, tables)  # the step graph's body (SpecStepGraphs._run)
            temps = torch.full((len(seqs),), args.temperature) if args.temperature > 0 else None
            spec._draft_and_verify(ids[:, -1], states, ctx, tables, [_GREEDY] * len(seqs), spec.n, inner=True,
                                   temps=temps)
    InterpretedFunction.run = run
    labels = ["draft catch-up window", "proposal", "verify forward", "LM head", "acceptance, KV move, feature store",
              "other"]
    rows = {}
    how = "greedy" if args.temperature <= 0 else f"temperature {args.temperature:g}"
    lines = [f"| phase ({args.method}, batch {args.batch}, tree {spec.n}, {args.layers} layers, {how}) "
             "| Triton launches | torch ops with a kernel | all |", "|---|---|---|---|"]
    for label in labels:
        t = sum(v for (p, _), v in triton.items() if p == label)
        o = sum(v for (p, _), v in ops.items() if p == label)
        if t or o:
            rows[label] = dict(triton=t, torch=o, torch_ops={n: v for (p, n), v in ops.items() if p == label},
                               triton_kernels={n: v for (p, n), v in triton.items() if p == label})
            lines.append(f"| {label} | {t} | {o} | {t + o} |")
    tt, to = sum(triton.values()), sum(ops.values())
    lines.append(f"| **the step** | {tt} | {to} | **{tt + to}** |")
    table = "\n".join(lines)
    print(table)
    write_results(args.out, "spec_step_launches", table, dict(args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
