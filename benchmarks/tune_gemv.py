"""Tune the dense decode GEMV (kernels/gemv.py) against cuBLAS at M = 1, on the GPU.

    python benchmarks/tune_gemv.py [--shapes 8b,smol] [--out DIR]

For every (N, K) of the Llama-3-8B and SmolLM2-135M decode step (qkv, o, gate_up, down, LM
head), bf16: cuBLAS (x @ w.t()) and every candidate GemvConfig, timed as benchmarks/gemm.py
times (CUDA-graph replay, weight copies rotated so small weights do not sit in L2), the best
checked against a float64 reference; % of the memory floor (weight bytes / 4.27 TB/s). Prints
the table, and the GEMV_CONFIGS entries for shapes where the best config beats cuBLAS by more
than 3% (paste them into kernels/gemv.py), and writes them as gemv_configs.json for
OPTLLM_GEMV_TABLE (end-to-end measurement before pasting).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch

from optllm.benchmarks.common import BW, ROT, provenance, rotated_us
from optllm.kernels.gemv import GemvConfig, gemv

SHAPES = {  # name -> (N, K)
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
           "lm_head": (128256, 4096)},
    "smol": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
             "lm_head": (49152, 576)},
}
CANDIDATES = [GemvConfig(bn, bk, w, s) for bn, bk, w, s in itertools.product(
    (4, 8, 16, 32), (256, 512, 1024), (2, 4, 8), (1, 3))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8b,smol")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args()
    info = provenance()
    print(json.dumps(info), flush=True)
    rows, table = [], {}
    for model in a.shapes.split(","):
        for name, (n, k) in SHAPES[model].items():
            copies = max(ROT, -(-200 * 2**20 // (n * k * 2)))  # > 200 MB in all: out of the 60 MB L2
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            floor = n * k * 2 / BW * 1e6
            cublas = rotated_us(lambda i: x @ ws[i].t(), copies=copies)
            best = None
            for cfg in CANDIDATES:
                try:
                    us = rotated_us(lambda i, c=cfg: gemv(x, ws[i], config=c), copies=copies)
                except Exception as e:  # a config that does not compile is skipped
                    print(f"skip {cfg}: {type(e).__name__}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            ref = x.double() @ ws[0].double().t()
            err = float((gemv(x, ws[0], config=best[1]).double() - ref).norm() / ref.norm())
            r = dict(model=model, shape=name, n=n, k=k, cublas_us=cublas, gemv_us=best[0], config=vars(best[1]),
                     speedup=cublas / best[0], floor_us=floor, cublas_pct=100 * floor / cublas,
                     gemv_pct=100 * floor / best[0], rel_err=err)
            rows.append(r)
            print(json.dumps(r), flush=True)
            if best[0] < cublas / 1.03:
                table[(n, k)] = best[1]
            ws.clear()
            torch.cuda.empty_cache()
    md = ("| model | shape | N × K | cuBLAS µs (% floor) | GEMV µs (% floor) | speedup | config | rel. err |\n"
          "|---|---|---|---|---|---|---|---|\n")
    for r in rows:
        c = r["config"]
        md += (f"| {r['model']} | {r['shape']} | {r['n']} × {r['k']} | {r['cublas_us']:.1f} ({r['cublas_pct']:.0f}%) | "
               f"{r['gemv_us']:.1f} ({r['gemv_pct']:.0f}%) | {r['speedup']:.2f} | "
               f"{c['block_n']}/{c['block_k']}/w{c['num_warps']}/s{c['num_stages']} | {r['rel_err']:.1e} |\n")
    entries = "\n".join(f"    ({n}, {k}): GemvConfig({c.block_n}, {c.block_k}, {c.num_warps}, {c.num_stages}),"
                        for (n, k), c in table.items())
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tune_gemv.json").write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    (a.out / "tune_gemv.md").write_text(md + "\nGEMV_CONFIGS entries:\n" + entries + "\n")
    # the same table for OPTLLM_GEMV_TABLE (kernels/gemv.py), so decode.py can measure it in this run
    (a.out / "gemv_configs.json").write_text(json.dumps(
        {f"{n},{k}": [c.block_n, c.block_k, c.num_warps, c.num_stages] for (n, k), c in table.items()}))
    print(md)
    print("GEMV_CONFIGS entries:\n" + (entries or "    (none beat cuBLAS by 3%)"))


if __name__ == "__main__":
    main()
