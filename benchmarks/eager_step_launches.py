"""Launches of one eager engine step, counted on the CPU: the Triton kernels (each a JITFunction
launch) and the torch ops that run a kernel on a GPU (views, reshapes and allocations left out),
for a mixed step (one prompt admitted beside decoding sequences) and for a decode-only step run
eagerly, on a random Llama of SmolLM2-135M's layer count (30) and head layout at tiny widths (the
counts depend on the layers, not the widths).

    TRITON_INTERPRET=1 python benchmarks/eager_step_launches.py [--layers 30] [--decodes 7]
        [--prompt-len 40] [--out DIR]

On the H200 a step that is not a CUDA-graph replay pays the host for each launch: 38-68 µs for a
Triton kernel through JITFunction.run and 17-30 µs for a cuBLAS call (docs/BENCHMARKS.md,
fifteenth session, `benchmarks/host_cost.py`). The counts here times those costs give what an
eager step's launches cost the host there (printed as a range; a model, not a GPU measurement).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

# ops that launch no GPU kernel: views, metadata, allocations
_NO_KERNEL = ("view", "_unsafe_view", "reshape", "as_strided", "slice", "select", "t", "transpose", "expand",
              "unsqueeze", "squeeze", "permute", "detach", "alias", "empty", "empty_like", "empty_strided",
              "lift_fresh", "_to_copy_noop", "split", "split_with_sizes", "unbind", "chunk", "narrow", "sym_size",
              "sym_stride", "is_same_size", "_reshape_alias", "contiguous", "clone_noop", "numel", "dim", "size",
              "stride", "is_nonzero", "_local_scalar_dense", "item")


class _Ops(TorchDispatchMode):
    """Counts torch ops outside Triton launches (the interpreter's own tensor copies are not
    counted: on a GPU a launch is one kernel)."""

    inside_triton = 0

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name not in _NO_KERNEL and not _Ops.inside_triton:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--decodes", type=int, default=7)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("error: set TRITON_INTERPRET=1 (the Triton kernels run on the CPU interpreter here)")
    from conftest import make_tiny_model
    from triton.runtime.interpreter import InterpretedFunction

    from optllm.runtime.llm import LLM
    from optllm.runtime.sampling_params import SamplingParams

    launches: Counter = Counter()
    run = InterpretedFunction.run

    def counted(self, *a, **kw):
        launches[self.fn.__name__] += 1
        _Ops.inside_triton += 1
        try:
            return run(self, *a, **kw)
        finally:
            _Ops.inside_triton -= 1

    InterpretedFunction.run = counted
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_model(Path(tmp) / "m", "llama", layers=args.layers)
        llm = LLM(str(folder), device="cpu", dtype="float32", kernels="triton", enable_prefix_caching=False,
                  max_num_seqs=args.decodes + 1, num_kv_blocks=256)
        engine = llm.engine
        params = SamplingParams(max_tokens=64, ignore_eos=True, detokenize=False)
        for i in range(args.decodes):
            engine.add_request([5 + i] * 12, params, request_id=f"d{i}")
        engine.step()  # their prefill
        engine.step()  # a decode step (warm)
        rows = {}
        engine.add_request([9] * args.prompt_len, params, request_id="new")
        for label in ("mixed", "decode"):
            launches.clear()
            with _Ops() as ops:
                batch_before = engine.scheduler.num_running
                engine.step()
            rows[label] = dict(triton=sum(launches.values()), triton_by_kernel=dict(launches),
                               torch_ops=sum(ops.counts.values()), torch_by_op=dict(ops.counts.most_common()),
                               running_before=batch_before)
    InterpretedFunction.run = run
    lines = ["| step | Triton launches | torch ops with a kernel | host cost at the H200's per-launch costs |",
             "|---|---|---|---|"]
    for label, r in rows.items():
        lo = r["triton"] * 38 + r["torch_ops"] * 17
        hi = r["triton"] * 68 + r["torch_ops"] * 30
        r["host_ms_range"] = [lo / 1e3, hi / 1e3]
        lines.append(f"| {label} ({args.layers} layers) | {r['triton']} | {r['torch_ops']} | "
                     f"{lo / 1e3:.1f}-{hi / 1e3:.1f} ms |")
    table = "\n".join(lines)
    print(table)
    for label, r in rows.items():
        print(f"{label}: Triton {r['triton_by_kernel']}")
        print(f"{label}: torch top ops {dict(list(r['torch_by_op'].items())[:12])}")
    write_results(args.out, "eager_step_launches", table, dict(args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
