"""Tune the scaled-matmul kernel (INT8 and FP8 GEMMs, kernels/scaled_mm.py) on the GPU, at
Llama-3-8B shapes, against the peer each is judged by.

    python benchmarks/tune_scaled_mm.py [--kinds int8,fp8] [--shapes qkv,o,gate_up,down]
                                        [--ms 64,256,4096] [--budget-s 300] [--out DIR]

For each (kind, shape, M) every candidate GemmConfig is timed on the GEMM alone (the
activation is quantized once beforehand) as benchmarks/gemm.py times it: CUDA-graph replay,
4 weight copies rotated. The peer is timed the same way: torch._int_mm (int8, no scaling)
or torch._scaled_mm (fp8, row-wise scales, no fast accumulation). The winner is checked
against scaled_mm_ref and printed as an INT8_CONFIGS / FP8_CONFIGS entry with its ratio to
the peer and to the table's current config. fast_accum (fp8) is tried from M = 256 up,
where the table already uses it (at M > 512 only it). Stops when the budget is spent.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch

from optllm.benchmarks.common import ROT, SHAPES, parse_shapes, rotated_us
from optllm.kernels import fp8 as fp8k
from optllm.kernels import w8a8_int8 as i8k
from optllm.kernels.scaled_mm import GemmConfig, m_bucket, scaled_mm_ref, scaled_mm_triton


def candidates(kind: str, m: int) -> list[GemmConfig]:
    C = GemmConfig
    out = []
    if m <= 32:
        for bn, bk, wp, st in itertools.product([32, 64, 128], [128, 256, 512], [4, 8], [3, 4, 5]):
            out.append(C(16 if m <= 16 else 32, bn, bk, 1, wp, st, swap_ab=True))
    elif m <= 128:
        for bn, bk, (wp, st) in itertools.product([64, 128], [128, 256], [(4, 3), (4, 4), (4, 5), (8, 4)]):
            out.append(C(64, bn, bk, 1, wp, st, swap_ab=True))
            out.append(C(64, bn, bk, 8, wp, st))
    else:
        # fast_accum: the table's choice from M = 256 up; at 256 both are tried (fp8 only)
        fast = ([False, True] if m <= 512 else [True]) if kind == "fp8" else [False]
        bms = [64, 128] if m <= 512 else [128, 256]
        for bm, bn, bk, (wp, st), fa in itertools.product(
                bms, [128, 256], [64, 128], [(4, 4), (8, 3), (8, 4)], fast):
            out.append(C(bm, bn, bk, 8, wp, st, fast_accum=fa))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="int8,fp8")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="64,256,4096")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    bad = [k for k in kinds if k not in ("int8", "fp8")]
    if bad:
        raise SystemExit(f"unknown kind(s) {', '.join(bad)}: allowed int8, fp8")
    shapes = parse_shapes(a.shapes)
    t_end = time.time() + a.budget_s
    torch.manual_seed(0)
    dev = torch.device("cuda")
    results, best = [], []
    for kind, sname in itertools.product(kinds, shapes):
        k, n = SHAPES[sname]
        table, default = ((i8k.INT8_CONFIGS, i8k.default_int8_config) if kind == "int8"
                          else (fp8k.FP8_CONFIGS, fp8k.default_fp8_config))
        ws = []
        for _ in range(ROT):
            w = torch.randn(n, k, device=dev) * 0.02
            if kind == "int8":
                sc = w.abs().amax(1) / 127
                ws.append((torch.round(w / sc[:, None]).clamp(-127, 127).to(torch.int8), sc))
            else:
                sc = w.abs().amax(1) / 448
                ws.append(((w / sc[:, None]).to(fp8k.FP8_DTYPE), sc))
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = (i8k.quantize_per_token_int8(x) if kind == "int8" else fp8k.quantize_fp8(x))
            if kind == "int8":
                peer = lambda i: torch._int_mm(xq, ws[i][0].t())  # noqa: E731
            else:
                peer = lambda i: torch._scaled_mm(xq, ws[i][0].t(), scale_a=xs, scale_b=ws[i][1].reshape(1, -1),  # noqa: E731
                                                  out_dtype=torch.bfloat16)
            peer_us = rotated_us(peer)
            current = table.get((m_bucket(m), n, k)) or default(m_bucket(m), n, k)
            cfgs = [current] + [c for c in candidates(kind, m) if c != current]
            timed = []
            for cfg in cfgs:
                if time.time() > t_end:
                    break
                try:
                    us = rotated_us(lambda i, cfg=cfg: scaled_mm_triton(xq, xs, ws[i][0], ws[i][1], None,
                                                                        torch.bfloat16, cfg))
                except Exception as e:  # out of shared memory / registers for this tile
                    results.append({"kind": kind, "shape": sname, "M": m, "config": repr(cfg),
                                    "error": str(e).splitlines()[0][:120]})
                    continue
                timed.append((us, cfg))
                results.append({"kind": kind, "shape": sname, "M": m, "config": repr(cfg), "us": us,
                                "peer_us": peer_us})
            if not timed:
                continue
            cur_us = next((t for t, c in timed if c == current), None)
            us, cfg = min(timed, key=lambda t: t[0])
            y = scaled_mm_triton(xq, xs, ws[0][0], ws[0][1], None, torch.bfloat16, cfg).float()
            ref = scaled_mm_ref(xq, xs, ws[0][0], ws[0][1], None, torch.float32)
            err = float((y - ref).norm() / ref.norm())
            best.append((kind, sname, m, n, k, us, cfg, err, cur_us, peer_us))
            print(f"{kind} {sname} M={m}: best {us:.1f} us ({peer_us / us:.2f}x peer {peer_us:.1f} us; "
                  f"table {cur_us and f'{cur_us:.1f}'} us) {cfg} err {err:.1e} ({len(timed)} timed)", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tune_scaled_mm.json").write_text(json.dumps(results, indent=1))
    print("\n# table entries: (m_bucket, N, K): config  # us, x peer, x current")
    for kind, sname, m, n, k, us, cfg, err, cur_us, peer_us in best:
        print(f"  {kind} ({m_bucket(m)}, {n}, {k}): {cfg!r},  # {us:.1f} us, {peer_us / us:.2f}x peer, "
              f"{(cur_us or us) / us:.2f}x current, {sname}")


if __name__ == "__main__":
    main()
