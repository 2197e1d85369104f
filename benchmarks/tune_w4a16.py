"""Tune the W4A16 kernel's launch configs on the GPU, at Llama-3-8B shapes.

    python benchmarks/tune_w4a16.py [--shapes qkv,o,gate_up,down] [--ms 1,16,64,256,4096]
                                    [--budget-s 300] [--gemv-stages 1,3] [--only FLAG]
                                    [--out DIR]

For each (shape, M) every candidate config of kernels/w4a16_configs.W4A16Config is timed
as benchmarks/gemm.py times it (CUDA-graph replay, 4 weight copies rotated, sym g128,
bf16), the best is checked against the float32 reference, and the winners are printed as
entries for W4A16_CONFIGS. --only FLAG (a W4A16Config flag such as gemv) times just the
candidates with that flag set, beside the table's current entry. Candidates that fail to
compile (shared memory) are skipped.
Stops sweeping when the time budget is spent and reports what it has.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import time
from pathlib import Path

import torch

from optllm.benchmarks.common import ROT, SHAPES, parse_shapes, rotated_us
from optllm.kernels import w4a16 as w4k
from optllm.kernels.w4a16_configs import W4A16_CONFIGS, W4A16Config, default_w4a16_config

G = 128


def candidates(m, table=None, gemv_stages=(1, 3)):
    """Configs to time at M = m; ``table``: the current table entry, whose GEMV shape is
    also tried at pipeline depths 2, 4 and 5."""
    C = W4A16Config
    out = [C(128, 128, 128, dequant=True)]
    if m == 1:
        for bn, bk, split, wp, st in itertools.product([32, 64, 128], [128, 256], [2, 4, 8],
                                                       [2, 4, 8], gemv_stages):
            out.append(C(16, bn, bk, split, wp, st, gemv=True))
        if table is not None and table.gemv:
            out += [dataclasses.replace(table, num_stages=st) for st in (2, 4, 5)]
    elif m <= 16:
        for (bn, bk), split, (wp, st) in itertools.product(
                [(64, 128), (64, 256), (128, 128)], [2, 4, 8], [(4, 1), (4, 2), (8, 1), (8, 3)]):
            out.append(C(16, bn, bk, split, wp, st, swap_ab=True))
    elif m <= 64:
        for (bn, bk), split, (wp, st) in itertools.product(
                [(64, 64), (64, 128), (128, 64), (128, 128)], [1, 2, 4, 8], [(4, 3), (8, 3)]):
            out.append(C(64, bn, bk, split, wp, st, swap_ab=True))
            if split <= 4:
                out.append(C(64, bn, bk, split, wp, st))
    elif m <= 256:
        for bm, (bn, bk), split, (wp, st) in itertools.product(
                [64, 128], [(128, 64), (128, 128), (256, 64)], [1, 2], [(4, 3), (8, 3), (8, 4)]):
            out.append(C(bm, bn, bk, split, wp, st))
        for bm, (bn, bk), (wp, st) in itertools.product(  # swap-AB: PTX dequant, A from registers
                [128, 256], [(64, 64), (64, 128), (128, 64), (128, 128)], [(4, 3), (8, 3), (8, 4)]):
            out.append(C(bm, bn, bk, 1, wp, st, swap_ab=True))
    else:
        for bm, (bn, bk), (wp, st) in itertools.product(
                [128], [(128, 64), (128, 128), (256, 64)], [(8, 3), (8, 4)]):
            out.append(C(bm, bn, bk, 1, wp, st))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="1,16,64,256,4096")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--gemv-stages", default="1,3", help="GEMV pipeline depths to sweep")
    ap.add_argument("--only", default=None, help="time only candidates with this config flag set")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    t_end = time.time() + a.budget_s
    torch.manual_seed(0)
    dev = torch.device("cuda")
    results, best = [], {}
    for sname in parse_shapes(a.shapes):
        k, n = SHAPES[sname]
        ws = []
        for _ in range(ROT):
            q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=dev)
            s = (torch.rand(n, k // G, device=dev) * 0.002 + 0.001).to(torch.bfloat16)
            ws.append(w4k.prepack_w4a16(q, s, None, G))
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            table = W4A16_CONFIGS.get((m, n, k))
            cfgs = candidates(m, table, [int(v) for v in a.gemv_stages.split(",")])
            if a.only:
                if not hasattr(W4A16Config(16, 16, 32), a.only):
                    raise SystemExit(f"--only {a.only}: not a W4A16Config field")
                cfgs = [c for c in cfgs if getattr(c, a.only)]
            default = table or default_w4a16_config(m, n, k)
            if default not in cfgs:
                cfgs.insert(0, default)
            timed = []
            for cfg in cfgs:
                if time.time() > t_end:
                    break
                try:
                    us = rotated_us(lambda i, cfg=cfg: w4k.w4a16_gemm(x, ws[i], config=cfg))
                except Exception as e:  # out of shared memory / registers for this tile
                    results.append({"shape": sname, "M": m, "config": repr(cfg), "error": str(e).splitlines()[0][:120]})
                    continue
                timed.append((us, cfg))
                results.append({"shape": sname, "M": m, "config": repr(cfg), "us": us})
            if not timed:
                continue
            timed.sort(key=lambda t: t[0])
            us, cfg = timed[0]
            ref = x.float() @ w4k.dequantize_w4a16(ws[0]).t()
            err = float((w4k.w4a16_gemm(x, ws[0], config=cfg).float() - ref).norm() / ref.norm())
            d_us = next((t for t, c in timed if c == default), None)
            best[(sname, m)] = (us, cfg, err, d_us, len(timed))
            print(f"{sname} M={m}: best {us:.1f} us {cfg} err {err:.1e} (table/default {d_us}, "
                  f"{len(timed)} timed)", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tune_w4a16.json").write_text(json.dumps(results, indent=1))
    print("\n# W4A16_CONFIGS entries")
    for (sname, m), (us, cfg, err, d_us, cnt) in best.items():
        k, n = SHAPES[sname]
        print(f"    ({m}, {n}, {k}): {cfg!r},  # {us:.1f} us, {sname}")


if __name__ == "__main__":
    main()
