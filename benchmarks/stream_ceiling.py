"""What a Triton kernel can stream from HBM with the N-major GEMV's access pattern, no math.

    python benchmarks/stream_ceiling.py [--shapes qkv,o,gate_up,down] [--out DIR]

For each Llama-3-8B shape's int4 words ([K // 8, N] int32, four copies rotated as gemm.py
rotates them) a kernel reads tiles [BLOCK_KW, BLOCK_N] exactly as kernels/w4a16.py's
N-major GEMV does (same grid, split over K, one partial per split) and folds each tile with
xor, so nothing but the loads costs time. Its best time over a few tilings is the ceiling
the GEMV can approach; beside it torch's copy of the same bytes (read + write, so counted
as twice the bytes) and the device bandwidth BW that the "% floor" columns of
docs/BENCHMARKS.md use.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from optllm.benchmarks.common import BW, ROT, SHAPES, parse_shapes, rotated_us


@triton.jit
def _stream_kernel(w_ptr, out_ptr, N, KW, rows_per_split, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                   STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_KW)
    r0 = pid_k * rows_per_split
    nsteps = tl.cdiv(tl.minimum(rows_per_split, KW - r0), BLOCK_KW)
    acc = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.int32)
    for i in tl.range(nsteps, num_stages=STAGES):
        rows = r0 + i * BLOCK_KW + offs_r
        acc ^= tl.load(w_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :],
                       mask=(rows < KW)[:, None] & (offs_n < N)[None, :], other=0)
    tl.store(out_ptr + pid_k * N + offs_n, tl.xor_sum(acc, axis=0), mask=offs_n < N)


def stream(w: torch.Tensor, out: torch.Tensor, bn: int, bkw: int, split: int, warps: int, stages: int):
    kw, n = w.shape
    per = -(-kw // split)
    per = -(-per // bkw) * bkw
    _stream_kernel[(-(-n // bn), -(-kw // per))](w, out, n, kw, per, BLOCK_N=bn, BLOCK_KW=bkw, STAGES=stages,
                                                 num_warps=warps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    rows = []
    for sname in parse_shapes(a.shapes):
        k, n = SHAPES[sname]
        ws = [torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda") for _ in range(ROT)]
        out = torch.empty(64 * n, dtype=torch.int32, device="cuda")
        nbytes = ws[0].numel() * 4
        best = None
        for (wp, per_thread), bkw, waves, st in itertools.product([(4, 4), (8, 4), (4, 2), (2, 8)], [8, 16],
                                                                   [1, 2, 4], [1, 3]):
            bn = 32 * wp * per_thread
            split = max(1, min(64, 132 * waves // -(-n // bn), k // (8 * bkw * 2)))
            us = rotated_us(lambda i: stream(ws[i], out, bn, bkw, split, wp, st))
            if best is None or us < best[0]:
                best = (us, dict(block_n=bn, block_kw=bkw, split=split, warps=wp, stages=st))
        copy_us = rotated_us(lambda i: ws[i].clone())
        r = {"shape": sname, "K": k, "N": n, "bytes": nbytes, "stream_us": best[0], "stream_cfg": best[1],
             "stream_TBps": nbytes / best[0] / 1e6, "copy_us": copy_us, "copy_TBps": 2 * nbytes / copy_us / 1e6,
             "floor_us": nbytes / BW * 1e6}
        rows.append(r)
        print(json.dumps(r), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "stream_ceiling.json").write_text(json.dumps(rows, indent=1))
    print("\n| shape | int4 bytes | floor (BW) µs | Triton stream µs | TB/s | % BW | torch copy TB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['bytes'] / 1e6:.1f} MB | {r['floor_us']:.1f} | {r['stream_us']:.1f} "
              f"| {r['stream_TBps']:.2f} | {100 * r['stream_TBps'] * 1e12 / BW:.0f}% | {r['copy_TBps']:.2f} |")


if __name__ == "__main__":
    main()
