"""NVFP4 weight-only paths on the GPU, at Llama-3-8B shapes: the fused Triton kernel (its
table / heuristic config) against dequantize + cuBLAS, beside cuBLAS bf16. kernels/nvfp4.py's
dispatch (which path from which M) is set from this.

    python benchmarks/bench_nvfp4.py [--shapes qkv,o,gate_up,down] [--ms 1,16,64,256,4096] [--out DIR]

CUDA-graph replay, median µs per call, 4 weight copies rotated.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from optllm.benchmarks.common import ROT, SHAPES, parse_shapes, rotated_us
from optllm.kernels import nvfp4 as nvk


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="1,16,64,256,4096")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    print("| shape | M | cuBLAS bf16 | fused (config) | dequant + cuBLAS | dequant pass alone |")
    print("|---|---|---|---|---|---|")
    for sname in parse_shapes(a.shapes):
        k, n = SHAPES[sname]
        wf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(ROT)]
        ws = [nvk.prepack_nvfp4(*nvk.quantize_nvfp4(w)) for w in wf]
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fused = nvk.TUNED_CONFIGS.get((nvk.m_bucket(m), n, k))
            if fused is None or fused.dequant:  # the fused heuristic (its M <= 64 tiles above)
                fused = nvk.fused_config(min(nvk.m_bucket(m), 64), n, k)
            ops = {
                "cublas_bf16": lambda i: x @ wf[i].t(),
                "fused": lambda i: nvk.nvfp4_linear(x, ws[i], config=fused),
                "dequant": lambda i: nvk.nvfp4_linear(x, ws[i], config=nvk.DEQUANT),
                "dequant_pass": lambda i: nvk.dequantize_nvfp4_triton(ws[i], torch.bfloat16),
            }
            r = {"shape": sname, "M": m, "N": n, "K": k, "fused_config": repr(fused)}
            for name, op in ops.items():
                r[name] = rotated_us(op, rep=30)
            rows.append(r)
            print(f"| {sname} | {m} | {r['cublas_bf16']:.1f} | {r['fused']:.1f} | {r['dequant']:.1f} "
                  f"| {r['dequant_pass']:.1f} |", flush=True)
        for held in (wf, ws):  # this shape's weights, before the next shape's
            held.clear()
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_nvfp4.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
