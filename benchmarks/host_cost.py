"""What one eager call of our quantized linears costs on the host, beside its GPU time (issue 13,
part 4: one call at M = 1 from eager PyTorch at most 1.3x its CUDA-graph time).

For each shape (Llama-3-8B's four projections, SmolLM2-135M's five) and M, per op:
  graph     GPU time of one call inside a CUDA-graph replay (ROT weight copies rotated);
  eager     wall time per call of CALLS back-to-back eager calls (rotating copies), from the
            first launch to the GPU finishing the last: what a call costs a stream of them;
  host      the host's time per call in that loop (perf_counter, before the final sync);
  eager/graph.
Ops: ours W4A16 (w4a16_linear: sym, g128 on the 8B shapes, g64 on SmolLM2's, as its
checkpoints), ours FP8 (dynamic per token: quantize + GEMM), ours INT8 (the same), cuBLAS bf16
(x @ w.t(), for scale). Each of ours twice: launched through the compiled kernel's launcher (the
default, kernels/common.CompiledLaunch) and through Triton's JITFunction.run (DIRECT_LAUNCH off,
what every call paid before), plus W4A16 through the torch.library op (the dispatcher, what
torch.compile calls).

    python benchmarks/host_cost.py [--shapes qkv,o,gate_up,down,smol_qkv,...] [--ms 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from optllm.benchmarks.common import ROT, SHAPES, group_size, provenance, rotated_us, sym_int4
from optllm.kernels import common as kcommon
from optllm.kernels import fp8 as fp8k
from optllm.kernels import w4a16 as w4k
from optllm.kernels import w8a8_int8 as i8k


def eager_us(op, calls: int, reps: int = 5) -> tuple[float, float]:
    """(wall µs per call from the first launch to the GPU's end, host µs per call), medians of reps
    runs of `calls` back-to-back calls op(i % ROT)."""
    walls, hosts = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(calls):
            op(i % ROT)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        walls.append((t2 - t0) * 1e6 / calls)
        hosts.append((t1 - t0) * 1e6 / calls)
    return statistics.median(walls[1:]), statistics.median(hosts[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--ms", default="1")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    bad = [s for s in a.shapes.split(",") if s not in SHAPES]
    if bad:
        raise SystemExit(f"unknown shape(s) {', '.join(bad)}: allowed {', '.join(SHAPES)}")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for sname in a.shapes.split(","):
        k, n = SHAPES[sname]
        g = group_size(sname)
        wf = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(ROT)]
        w4, f8, i8 = [], [], []
        for w in wf:
            q, s = sym_int4(w, g)
            w4.append(w4k.prepack_w4a16(q, s.to(torch.bfloat16), None, g, dtype=torch.bfloat16))
            sf = w.float().abs().amax(1) / 448
            f8.append(fp8k.prepack_fp8((w.float() / sf[:, None]).to(torch.float8_e4m3fn), sf))
            sc = w.float().abs().amax(1) / 127
            i8.append(i8k.prepack_w8a8(torch.round(w.float() / sc[:, None]).clamp(-127, 127).to(torch.int8), sc))
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ops = {
                "cublas_bf16": (lambda i: x @ wf[i].t(), None),
                "w4a16": (lambda i: w4k.w4a16_linear(x, w4[i]), True),
                "w4a16_jit": (lambda i: w4k.w4a16_linear(x, w4[i]), False),
                "w4a16_op": (lambda i: torch.ops.optllm.w4a16_gemm(x, w4[i].packed, w4[i].scales, None, None,
                                                                   w4[i].locks, k, g), True),
                "fp8": (lambda i: fp8k.fp8_linear(x, f8[i]), True),
                "fp8_jit": (lambda i: fp8k.fp8_linear(x, f8[i]), False),
                "int8": (lambda i: i8k.w8a8_int8_linear(x, i8[i]), True),
                "int8_jit": (lambda i: i8k.w8a8_int8_linear(x, i8[i]), False),
            }
            ref = ops["w4a16_jit"][0](0)
            for name, (op, direct) in ops.items():
                kcommon.DIRECT_LAUNCH = True if direct is None else direct
                op(0)
                op(1)  # the second call of a key takes the direct path
                r = {"shape": sname, "K": k, "N": n, "M": m, "op": name}
                if name.startswith("w4a16"):  # the three ways in give the same bits
                    r["equal_to_jit"] = bool(torch.equal(op(0), ref))
                r["graph_us"] = rotated_us(op, rep=40)
                r["eager_us"], r["host_us"] = eager_us(op, a.calls)
                r["eager_over_graph"] = r["eager_us"] / r["graph_us"]
                rows.append(r)
                print(json.dumps({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in r.items()}),
                      flush=True)
            kcommon.DIRECT_LAUNCH = True
        for held in (wf, w4, f8, i8):
            held.clear()
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "host_cost.json").write_text(json.dumps(dict(info=provenance(), rows=rows), indent=1))
    md = render(rows)
    (a.out / "host_cost.md").write_text(md)
    print(md)


def render(rows) -> str:
    by = {}
    for r in rows:
        by.setdefault((r["shape"], r["M"]), {})[r["op"]] = r
    names = ["cublas_bf16", "w4a16", "w4a16_jit", "w4a16_op", "fp8", "fp8_jit", "int8", "int8_jit"]
    out = ["µs per call: graph / eager (host); eager ÷ graph in brackets", "",
           "| shape | M | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for (shape, m), ops in by.items():
        cells = []
        for nm in names:
            r = ops.get(nm)
            cells.append("–" if r is None else f"{r['graph_us']:.1f} / {r['eager_us']:.1f} ({r['host_us']:.1f}) "
                         f"[{r['eager_over_graph']:.2f}]")
        out.append(f"| {shape} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
