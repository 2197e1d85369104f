"""Time the per-token INT8 / FP8 activation quantizers over their launch parameters (block,
one or two passes over the row, warps) on the GPU; scaled_mm.row_kernel_launch_params is set
from this.

    python benchmarks/tune_quant.py [--ks 4096,14336] [--ms 64,4096] [--out DIR]

CUDA-graph replay, median µs; % of the memory floor (read bf16 x, write the 8-bit x and the
scales, at 4.27 TB/s). Every variant's output is checked bit for bit against the torch
reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch
import triton

from optllm.benchmarks.common import graph_us
from optllm.kernels import fp8 as fp8k
from optllm.kernels import w8a8_int8 as i8k
from optllm.kernels.scaled_mm import SCALE_EPS, row_kernel_launch_params

BW = 4.27e12


def launch(kind, x, xq, s, block, one_pass, warps):
    args = (x, xq, s, x.shape[1], x.stride(0), xq.stride(0))
    if kind == "int8":
        i8k._quant_int8_kernel[(x.shape[0],)](*args, EPS=SCALE_EPS, BLOCK=block, ONE_PASS=one_pass,
                                              INTERPRET=False, num_warps=warps)
    else:
        fp8k._quant_fp8_kernel[(x.shape[0],)](*args, EPS=SCALE_EPS, STATIC=False, BLOCK=block,
                                              ONE_PASS=one_pass, INTERPRET=False, num_warps=warps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="4096,14336")
    ap.add_argument("--ms", default="64,4096")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    rows = []
    for kind, k, m in itertools.product(("int8", "fp8"), [int(v) for v in a.ks.split(",")],
                                        [int(v) for v in a.ms.split(",")]):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref_q, ref_s = (i8k.quantize_per_token_int8_ref(x) if kind == "int8" else fp8k.quantize_fp8_ref(x))
        xq = torch.empty_like(ref_q)
        s = torch.empty(m, 1, device="cuda")
        floor = (m * k * 3 + m * 4) / BW * 1e6
        full = triton.next_power_of_2(k)
        variants = [(b, True, w) for b in (full,) for w in (4, 8, 16, 32) if b <= 16384]
        variants += [(b, False, w) for b in (1024, 2048, 4096) for w in (2, 4, 8)]
        current = row_kernel_launch_params(k)
        for block, one_pass, warps in variants:
            fn = lambda: launch(kind, x, xq, s, block, one_pass, warps)  # noqa: E731
            fn()
            ok = torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
            us = graph_us(fn, rep=30)
            rows.append({"kind": kind, "K": k, "M": m, "block": block, "one_pass": one_pass,
                         "warps": warps, "us": us, "floor_pct": 100 * floor / us, "exact": ok,
                         "current": (block, one_pass, warps) == current})
        best = min((r for r in rows if r["kind"] == kind and r["K"] == k and r["M"] == m), key=lambda r: r["us"])
        cur = next((r for r in rows if r["kind"] == kind and r["K"] == k and r["M"] == m and r["current"]), None)
        print(f"{kind} K={k} M={m}: best {best['us']:.1f} us ({best['floor_pct']:.0f}% floor) block "
              f"{best['block']} one_pass {best['one_pass']} warps {best['warps']}; current "
              f"{cur and round(cur['us'], 1)} us; all exact: "
              f"{all(r['exact'] for r in rows if r['kind'] == kind and r['K'] == k and r['M'] == m)}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tune_quant.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
