"""Tune the W4A16 kernel's launch configs on the GPU, at Llama-3-8B shapes (or SmolLM2's).

    python benchmarks/tune_w4a16.py [--shapes qkv,o,gate_up,down] [--ms 1,16,64,128,256,4096]
                                    [--budget-s 300] [--gemv-stages 1,3] [--only FLAG]
                                    [--layout k|n] [--out DIR]

For each (shape, M) every candidate config of kernels/w4a16_configs.W4A16Config is timed
in a CUDA-graph replay over weight copies rotated past 200 MB (--l2 flush, the default: read from
HBM as in a model; --l2 warm: 4 copies, as benchmarks/gemm.py times, where small shapes stay in the
L2), sym g128 -- g64 on SmolLM2's shapes -- bf16; the best is checked against the float32
reference, and the winners are printed as entries for W4A16_CONFIGS. --only FLAG (a W4A16Config
flag such as gemv) times just the candidates with that flag set, beside the table's current
entry. Candidates that fail to compile (shared memory) are skipped.
--layout n tunes N-major words (prepack_w4a16(n_major=True)): the N-major GEMV's shapes at
M <= 8 beside the tiles. The winners are also written as $OUT/w4a16_table.json, which
OPTLLM_W4A16_TABLE loads (so gemm.py can measure them in the same device call).
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

from optllm.benchmarks.common import ROT, SHAPES, flush_copies, group_size, parse_shapes, rotated_us
from optllm.kernels import w4a16 as w4k
from optllm.kernels.w4a16_configs import (
    W4A16Config,
    gemv_bucket,
    lookup_w4a16_config,
    m_bucket,
    table_to_json,
)

MAX_ERR = 2e-2  # relative Frobenius error against the float32 reference (bf16 outputs: ~2e-3)


def candidates_n_gemv(m, n, k, gemv_stages=(1, 2, 3)):
    """The N-major GEMV at M = m <= 8: 2 / 4 (/ 8 at M = 1) words per thread along n, 8 / 16
    (/ 4 at M = 1) word rows per step, 4 / 8 (/ 2 at M = 1) warps, split over K so that
    about 1, 2 or 4 waves of programs run (each split keeping >= 2 steps)."""
    C = W4A16Config
    out = []
    rows = gemv_bucket(m)
    wide = m == 1
    for wp, per_thread, bkw, st in itertools.product([4, 8] + [2] * wide, [4, 2] + [8] * wide,
                                                     [8, 16] + [4] * wide, gemv_stages):
        bn = 32 * wp * per_thread
        if bn > n or bn > 2048:
            continue
        tiles = -(-n // bn)
        for waves in (1, 2, 4):
            split = max(1, min(132 * waves // tiles, k // (8 * bkw * 2)))
            out.append(C(rows, bn, 8 * bkw, split, wp, st, gemv=True))
    return list(dict.fromkeys(out))


def candidates(m, table=None, gemv_stages=(1, 3)):
    """Configs to time at M = m; ``table``: the current table entry, whose GEMV shape is
    also tried at pipeline depths 2, 4 and 5."""
    C = W4A16Config
    out = [C(128, 128, 128, dequant=True)]
    if m == 1:  # (16-wide tiles and no split for SmolLM2's shapes: N 576, K 576)
        for bn, bk, split, wp, st in itertools.product([16, 32, 64, 128], [128, 256], [1, 2, 4, 8],
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
    elif m <= 128:  # swap-AB over one or two 64-row x tiles or one of 128, split over K; the plain tiles
        for bm, (bn, bk), split, (wp, st) in itertools.product(
                [64, 128], [(64, 128), (128, 64), (128, 128)], [1, 2, 4], [(4, 3), (8, 3)]):
            out.append(C(bm, bn, bk, split, wp, st, swap_ab=True))
        for bm, (bn, bk), (wp, st) in itertools.product([64, 128], [(128, 64), (128, 128)], [(4, 3), (8, 3)]):
            out.append(C(bm, bn, bk, 1, wp, st))
    elif m <= 256:  # first swap-AB over 64- or 128-row x tiles split over K (M = 128's winners, forty-fifth
        # session), then the plain tiles and 256-row swap-AB (the H200's M = 256 sweep: these lost to dequantize +
        # cuBLAS but on gate_up): the sweep's budget may end before the last
        for bm, (bn, bk), split, (wp, st) in itertools.product(
                [64, 128], [(64, 128), (128, 64), (128, 128)], [1, 2, 4], [(4, 3), (8, 3)]):
            out.append(C(bm, bn, bk, split, wp, st, swap_ab=True))
        for bm, (bn, bk), split, (wp, st) in itertools.product(
                [64, 128], [(128, 64), (128, 128), (256, 64)], [1, 2], [(4, 3), (8, 3), (8, 4)]):
            out.append(C(bm, bn, bk, split, wp, st))
        for bm, (bn, bk), (wp, st) in itertools.product(  # swap-AB: PTX dequant, A from registers
                [128, 256], [(64, 64), (64, 128), (128, 64), (128, 128)], [(4, 3), (8, 3), (8, 4)]):
            out.append(C(bm, bn, bk, 1, wp, st, swap_ab=True))
        out = list(dict.fromkeys(out))
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
    ap.add_argument("--layout", choices=("k", "n"), default="k", help="K-major words (the checkpoint's) "
                    "or N-major (prepack_w4a16(n_major=True))")
    ap.add_argument("--l2", choices=("flush", "warm"), default="flush",
                    help="flush: rotate weight copies past 200 MB (read from HBM, as in a model); warm: "
                         f"{ROT} copies (small shapes' weights then stay in the L2)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    t_end = time.time() + a.budget_s
    torch.manual_seed(0)
    dev = torch.device("cuda")
    results, rows, entries = [], [], {}
    n_major = a.layout == "n"
    shapes, ms = parse_shapes(a.shapes), [int(v) for v in a.ms.split(",")]
    for si, sname in enumerate(shapes):
        k, n = SHAPES[sname]
        G = group_size(sname)
        ws = []
        copies = flush_copies(n * k // 2) if a.l2 == "flush" else ROT
        for _ in range(copies):
            q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device=dev)
            s = (torch.rand(n, k // G, device=dev) * 0.002 + 0.001).to(torch.bfloat16)
            ws.append(w4k.prepack_w4a16(q, s, None, G, n_major=n_major))
        for mi, m in enumerate(ms):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            table = lookup_w4a16_config(m, n, k, n_major)
            stages = [int(v) for v in a.gemv_stages.split(",")]
            if n_major and m <= 8:
                cfgs = candidates_n_gemv(m, n, k, stages) + candidates(16, None, stages)[1:13]
            else:
                cfgs = candidates(m, table, stages)
            if a.only:
                if not hasattr(W4A16Config(16, 16, 32), a.only):
                    raise SystemExit(f"--only {a.only}: not a W4A16Config field")
                cfgs = [c for c in cfgs if getattr(c, a.only)]
            if table not in cfgs:
                cfgs.insert(0, table)
            ref = x.float() @ w4k.dequantize_w4a16(ws[0]).t()
            timed = []
            cells_left = len(ms) * (len(shapes) - si) - mi
            t_cell = time.time() + max(0.0, t_end - time.time()) / cells_left  # an even share per cell
            for cfg in cfgs:
                if time.time() > t_cell:
                    break
                try:
                    us = rotated_us(lambda i, cfg=cfg: w4k.w4a16_gemm(x, ws[i], config=cfg), copies=copies)
                    # after the timing, which may leave a wrong split-K reduction's counters behind
                    err = float((w4k.w4a16_gemm(x, ws[0], config=cfg).float() - ref).norm() / ref.norm())
                except Exception as e:  # out of shared memory / registers for this tile
                    results.append({"shape": sname, "M": m, "config": repr(cfg), "error": str(e).splitlines()[0][:120]})
                    continue
                results.append({"shape": sname, "M": m, "config": repr(cfg), "us": us, "err": err})
                if not err <= MAX_ERR:  # a config that computes wrong is reported, never a winner
                    print(f"{sname} M={m}: WRONG {cfg}: relative error {err:.1e}", flush=True)
                    continue
                timed.append((us, cfg, err))
            if not timed:
                continue
            timed.sort(key=lambda t: t[0])
            us, cfg, err = timed[0]
            d_us = next((t for t, c, _ in timed if c == table), None)
            bucket = gemv_bucket(m) if n_major else m_bucket(m)
            entries[(n_major, bucket, n, k)] = cfg
            rows.append({"shape": sname, "M": m, "bucket": bucket, "N": n, "K": k, "us": us, "config": repr(cfg),
                         "err": err, "table_us": d_us, "timed": len(timed)})
            print(f"{sname} M={m}: best {us:.1f} us {cfg} err {err:.1e} (table/default {d_us}, "
                  f"{len(timed)} timed)", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"tune_w4a16_{a.layout}.json").write_text(json.dumps({"best": rows, "all": results}, indent=1))
    print(f"\n# {'W4A16_CONFIGS_N' if n_major else 'W4A16_CONFIGS'} entries")
    for r in rows:
        print(f"    ({r['bucket']}, {r['N']}, {r['K']}): {r['config']},  # {r['us']:.1f} us, {r['shape']}")
    (a.out / "w4a16_table.json").write_text(table_to_json(entries))


if __name__ == "__main__":
    main()
