"""The small-batch tensor-core W4A16 tiles (kernels/w4a16_mma_tile.py) against cuBLAS bf16 and the
runtime's Triton W4A16 path at M = 16..256 (issue 13: M = 64 >= 2.5x cuBLAS bf16, M >= 256 >= 0.9x).

    python benchmarks/w4a16_tile.py [--shapes qkv,o,gate_up,down] [--ms 16,32,64,128,256]
                                    [--configs 4x2x8,4x2x8k4,...] [--out DIR] [--table]

Configs are WARPSxRTxNT[sS][uU][kK][a][w]: warps a CTA, row tiles a warp, column tiles (8 rows) a CTA, S x-ring
stages, U weight chunks loaded ahead, K CTAs along K (split-K), a no dequantization (timing only), w the wgmma
form (4 warps, RT 64-row tiles a CTA, S ring stages, 6 unless given; sm_90a); "auto" is config_for's choice.
Per shape and M: each kernel's relative error against the float32 reference, then µs of a CUDA-graph replay with
weight copies rotated past 200 MB (weights from HBM), the tensor-core GEMV too where M <= 32 (its runtime config),
the best tile's ×cuBLAS and % of the int4 floor (int4 words + bf16 scales + x + y at this card's copy rate,
measured first), and its TFLOPS. --table also prints the kernels' tuned table (w4a16_mma_tile.TILE_TABLE) the run
supports: per shape, an entry at each measured M from RUNTIME_MIN_M up where the best tile beat the Triton path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

import torch

from optllm.benchmarks.common import (
    copy_bandwidth,
    flush_copies,
    provenance,
    rel,
    shape_plan,
    sym_int4,
    time_rotated,
    why,
    write_results,
)
from optllm.kernels import w4a16 as w4k
from optllm.kernels import w4a16_mma as mk
from optllm.kernels import w4a16_mma_tile as tk


def parse_config(text: str) -> tk.TileConfig | None:
    if text == "auto":
        return None
    hit = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:s(\d))?(?:u(\d))?(?:k(\d+))?(a?)(w?)", text)
    if hit is None:
        raise SystemExit(f"--configs: {text!r} is not WARPSxRTxNT[sS][uU][kK][a][w] or auto")
    warps, rt, nt, stages, unroll, split, ablate, wgmma = hit.groups()
    try:
        return tk.TileConfig(int(warps), int(rt), int(nt), stages=int(stages or (6 if wgmma else 4)),
                             unroll=int(unroll or 2), split_k=int(split or 1), ablate=bool(ablate), wgmma=bool(wgmma))
    except ValueError as e:
        raise SystemExit(f"--configs: {text!r}: {e}") from None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="16,32,64,128,256")
    ap.add_argument("--configs", default="auto,4x2x8,4x2x8k2,4x2x8k4,4x2x8k8,8x2x8,4x1x16,4x2x4")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--table", action="store_true", help="print the TILE_TABLE this run supports")
    a = ap.parse_args()
    if not mk.available():
        raise SystemExit(f"the tensor-core kernels do not build here: {mk._UNAVAILABLE}")
    names = a.configs.split(",")
    configs = {n: parse_config(n) for n in names}
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for sname, k, n, G in shape_plan(a.shapes):
        rot = flush_copies(n * k // 2)
        wf, tri, mma = [], [], []
        for _ in range(rot):
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            q, s = sym_int4(w, G)
            p = w4k.prepack_w4a16(q, s.to(torch.bfloat16), None, G, dtype=torch.bfloat16)
            wf.append(w)
            tri.append(p)
            mma.append(mk.from_w4a16(p))
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w4k.dequantize_w4a16(tri[0]).t()
            r = {"shape": sname, "K": k, "N": n, "M": m, "group": G, "copies": rot, "copy_bw": bw,
                 "floor_int4": (n * k / 2 + n * k / G * 2 + m * k * 2 + m * n * 2) / bw * 1e6,
                 "flop": 2 * m * n * k, "err_triton": rel(w4k.w4a16_linear(x, tri[0]), ref)}
            ops = {"cublas_bf16": lambda i: x @ wf[i].t(), "triton_w4a16": lambda i: w4k.w4a16_linear(x, tri[i])}
            if m <= mk.MAX_M:
                ops["gemv"] = lambda i: mk.w4a16_mma_linear(x, mma[i])
            for name, cfg in configs.items():
                try:
                    r["err_tile_" + name] = rel(tk.w4a16_mma_tile(x, mma[0], None, cfg), ref)
                except Exception as e:
                    r["tile_" + name + "_why"] = why(e)
                    continue
                ops["tile_" + name] = lambda i, cfg=cfg: tk.w4a16_mma_tile(x, mma[i], None, cfg)
            r["auto_config"] = repr(tk.config_for(n, k, m))
            time_rotated(r, ops, rot)
            tiles = [c for c in ops if c.startswith("tile_") and r.get(c) is not None
                     and not (configs[c[5:]] and configs[c[5:]].ablate)]
            if tiles:
                best = min(tiles, key=lambda c: r[c])
                r["tile_best"], r["tile_best_config"] = r[best], best[5:]
            rows.append(r)
            print(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in r.items()}), flush=True)
        for held in (wf, tri, mma):
            held.clear()
        torch.cuda.empty_cache()
    table = render(rows, names)
    print(table)
    if a.table:
        print(tuned_table(rows, configs))
    write_results(a.out, "w4a16_tile", table, {"provenance": provenance(), "rows": rows})


def tuned_table(rows, configs) -> str:
    """TILE_TABLE's source for these rows: (N, K) -> ((M, M, best config), ...) at each measured M >= RUNTIME_MIN_M
    where the best tile beat the Triton path (the M between two measured ones are not guessed)."""
    out = ["TILE_TABLE = {"]
    for key in dict.fromkeys((r["N"], r["K"], r["shape"]) for r in rows):
        entries = []
        for r in sorted((r for r in rows if (r["N"], r["K"], r["shape"]) == key), key=lambda r: r["M"]):
            if r["M"] < tk.RUNTIME_MIN_M or r.get("tile_best") is None or r["triton_w4a16"] is None \
                    or r["tile_best"] >= r["triton_w4a16"]:
                continue
            cfg = configs[r["tile_best_config"]] or tk.config_for(r["N"], r["K"], r["M"])
            fields = ", ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                               if f.name != "ablate" and (f.name != "wgmma" or cfg.wgmma))
            entries.append(f"({r['M']}, {r['M']}, TileConfig({fields}))")
        if entries:
            out.append(f"    ({key[0]}, {key[1]}): ({', '.join(entries)},),  # {key[2]}")
    return "\n".join(out + ["}"])


def render(rows, names):
    def f(v):
        return "–" if v is None else f"{v:.1f}"

    head = ("| shape | M | cuBLAS bf16 | Triton W4A16 | GEMV | best tile (config) | ×bf16 | ×Triton | TFLOPS "
            f"| % int4 floor ({rows[0]['copy_bw'] / 1e12:.2f} TB/s) | err | " + " | ".join(names) + " |")
    lines = [head, "|" + "---|" * (11 + len(names))]
    for r in rows:
        b = r.get("tile_best")
        if b is None:
            lines.append(f"| {r['shape']} | {r['M']} | {f(r['cublas_bf16'])} | {f(r['triton_w4a16'])} | – | – |")
            continue
        lines.append(
            f"| {r['shape']} | {r['M']} | {f(r['cublas_bf16'])} | {f(r['triton_w4a16'])} | {f(r.get('gemv'))} "
            f"| {f(b)} ({r['tile_best_config']}) | {r['cublas_bf16'] / b:.2f} | {r['triton_w4a16'] / b:.2f} "
            f"| {r['flop'] / b / 1e6:.0f} | {100 * r['floor_int4'] / b:.0f}% "
            f"| {r['err_tile_' + r['tile_best_config']]:.1e} | "
            + " | ".join(f(r.get("tile_" + nm)) for nm in names) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
