"""The tensor-core W4A16 GEMV (kernels/w4a16_mma.py) against the Triton W4A16 path, cuBLAS bf16 and
tinygemm at decode sizes, on the H200.

    python benchmarks/w4a16_mma.py [--shapes qkv,o,gate_up,down,smol_qkv,...] [--ms 1,2,4,8]
                                   [--configs 8x4,4x4,...] [--out DIR]

Per shape and M: the relative error of each kernel against the float32 reference on the same
inputs, then µs per call of a CUDA-graph replay with weight copies rotated past 200 MB (read from
HBM, benchmarks/common.flush_copies), for every tensor-core config (WARPS x UNROLL) and the best of
them; % of the int4 floor (int4 words + bf16 scales + x + y at this card's copy rate, measured first:
common.copy_bandwidth; the H200's is BW, 4.27 TB/s). Symmetric int4, group
128 on the 8B shapes, 64 on SmolLM2's. M = 1 also eager (host cost included): the runtime's call
(w4a16_mma_linear, its tuned config) eager -- one call timed alone after an L2 flush (do_bench), and
calls issued back to back over the rotated copies (common.eager_stream_us) -- and as a graph replay,
and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from optllm.benchmarks.common import (
    BW,
    copy_bandwidth,
    eager_stream_us,
    flush_copies,
    graph_us,
    provenance,
    rel,
    shape_plan,
    sym_int4,
    time_rotated,
    write_results,
)
from optllm.kernels import w4a16 as w4k
from optllm.kernels import w4a16_mma as mk


def parse_config(text: str) -> mk.MmaConfig:
    import re

    hit = re.fullmatch(r"(\d+)x(\d+)([spa]*)(?:c(\d))?(?:k(\d+))?(?:r(\d+))?(?:t(\d+))?", text)
    if hit is None:
        raise SystemExit(f"--configs: {text!r} is not WARPSxUNROLL[s][p][a][cN][kS][rR][tT]")
    warps, unroll, flags, persist, split, ring, tiles = hit.groups()
    try:
        return mk.MmaConfig(int(warps), int(unroll), offset_mma="s" not in flags, xpre="p" in flags,
                            ablate="a" in flags, persist=int(persist or 0), split_k=int(split or 1),
                            ring=int(ring or 0), tiles=int(tiles or 1))
    except ValueError as e:
        raise SystemExit(f"--configs: {text!r}: {e}") from None


def cname(c: mk.MmaConfig) -> str:
    return (f"{c.warps}x{c.unroll}" + ("" if c.offset_mma else "s") + ("p" if c.xpre else "")
            + ("a" if c.ablate else "") + (f"c{c.persist}" if c.persist else "")
            + (f"k{c.split_k}" if c.split_k > 1 else "") + (f"r{c.ring}" if c.ring else "")
            + (f"t{c.tiles}" if c.tiles > 1 else ""))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,smol_qkv,smol_o,smol_gate_up,smol_down,smol_lm_head")
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--configs", default="4x2,4x4,8x2,8x4,8x8,16x4",
                    help="WARPSxUNROLL[s][p][a][cN][kS][rR][tT]: s the offset by a bf16x2 fma before each mma (no "
                         "all-ones mma), p x prefetched with the weights, a no dequantization (timing only), cN the "
                         "persistent form with N CTAs a SM, kS S CTAs a row tile (split-K), rR the weights through "
                         "a shared-memory ring of R chunks a warp (cp.async, a group's scales and zeros with its "
                         "first chunk), tT T row tiles a CTA (warps / T warps a tile)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    if not mk.available():
        raise SystemExit(f"the tensor-core GEMV does not build here: {mk._UNAVAILABLE}")
    configs = [parse_config(c) for c in a.configs.split(",")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    bw = copy_bandwidth()  # this card's: the floor below is against it, not the H200's BW
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (BW, the H200's, {BW / 1e12:.2f})", flush=True)
    rows = []
    for sname, k, n, G in shape_plan(a.shapes):
        rot = flush_copies(n * k // 2)
        wf, tri, mma, tg = [], [], [], []
        for _ in range(rot):
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            q, s = sym_int4(w, G)
            p = w4k.prepack_w4a16(q, s.to(torch.bfloat16), None, G, dtype=torch.bfloat16)
            wf.append(w)
            tri.append(p)
            mma.append(mk.from_w4a16(p))
            u = (q.to(torch.int32) + 8).to(torch.uint8)
            try:
                wp = torch.ops.aten._convert_weight_to_int4pack((u[:, ::2] << 4 | u[:, 1::2]).contiguous(),
                                                               8 if k % 128 == 0 else 4)
                sz = torch.stack([s.t(), torch.zeros_like(s.t())], dim=-1).to(torch.bfloat16).contiguous()
                tg.append((wp, sz))
            except Exception:
                pass
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ w4k.dequantize_w4a16(tri[0]).t()
            r = {"shape": sname, "K": k, "N": n, "M": m, "group": G, "copies": rot,
                 "copy_bw": bw, "floor_int4": (n * k / 2 + n * k / G * 2 + m * k * 2 + m * n * 2) / bw * 1e6,
                 "err_triton": rel(w4k.w4a16_linear(x, tri[0]), ref)}
            ops = {"cublas_bf16": lambda i: x @ wf[i].t(), "triton_w4a16": lambda i: w4k.w4a16_linear(x, tri[i])}
            if len(tg) == rot:
                ops["tinygemm"] = lambda i: torch.ops.aten._weight_int4pack_mm(x, tg[i][0], G, tg[i][1])
            for cfg in configs:
                name = "mma_" + cname(cfg)
                r["err_" + name] = rel(mk.w4a16_mma_gemv(x, mma[0], None, cfg), ref)
                ops[name] = lambda i, cfg=cfg: mk.w4a16_mma_gemv(x, mma[i], None, cfg)
            time_rotated(r, ops, rot)
            ablated = {"mma_" + cname(c) for c in configs if c.ablate}  # wrong numbers: never the best
            best = min((c for c in ops if c.startswith("mma_") and c not in ablated and r[c] is not None),
                       key=lambda c: r[c])
            r["mma_best"], r["mma_best_config"] = r[best], best
            if m == 1:
                def eager(fn):
                    return 1000 * triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
                # the runtime's call (w4a16_mma_linear: its tuned config, no argument checks), eager
                # and as a graph replay over the rotated copies: issue 13's host-cost ratio
                r["mma_eager"] = eager(lambda: mk.w4a16_mma_linear(x, mma[0]))
                r["mma_runtime_graph"] = graph_us(lambda: [mk.w4a16_mma_linear(x, mma[i]) for i in range(rot)],
                                                  rep=40) / rot
                r["triton_eager"] = eager(lambda: w4k.w4a16_linear(x, tri[0]))
                # the same calls back to back over the rotated copies (a model's eager forward)
                r["mma_eager_stream"] = eager_stream_us(lambda i: mk.w4a16_mma_linear(x, mma[i]), rot)
                r["triton_eager_stream"] = eager_stream_us(lambda i: w4k.w4a16_linear(x, tri[i]), rot)
            rows.append(r)
            print(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in r.items()}), flush=True)
        for held in (wf, tri, mma, tg):
            held.clear()
        torch.cuda.empty_cache()
    table = render(rows, configs)
    print(table)
    write_results(a.out, "w4a16_mma", table, {"provenance": provenance(), "rows": rows})


def render(rows, configs):
    def f(v):
        return "–" if v is None else f"{v:.1f}"

    head = ("| shape | M | cuBLAS bf16 | tinygemm | Triton W4A16 | tensor-core GEMV (best config) | ×bf16 | ×Triton "
            f"| % int4 floor ({rows[0]['copy_bw'] / 1e12:.2f} TB/s) | err (tensor core) | "
            + " | ".join(cname(c) for c in configs) + " |")
    lines = [head, "|" + "---|" * (10 + len(configs))]
    for r in rows:
        b = r["mma_best"]
        lines.append(
            f"| {r['shape']} | {r['M']} | {f(r['cublas_bf16'])} | {f(r.get('tinygemm'))} | {f(r['triton_w4a16'])} "
            f"| {f(b)} ({r['mma_best_config'][4:]}) | {r['cublas_bf16'] / b:.2f} | {r['triton_w4a16'] / b:.2f} "
            f"| {100 * r['floor_int4'] / b:.0f}% | {r['err_' + r['mma_best_config']]:.1e} | "
            + " | ".join(f(r.get("mma_" + cname(c))) for c in configs) + " |")
    eager = [r for r in rows if "mma_eager" in r]
    if eager:
        lines += ["", "| shape | M = 1 eager µs: the runtime's tensor-core call, one after an L2 flush (do_bench) "
                  "| back to back | its graph µs | eager / graph: one, back to back | Triton W4A16 eager: one, "
                  "back to back | graph µs (tensor core, best) |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['mma_eager']:.1f} | {r['mma_eager_stream']:.1f} | {r['mma_runtime_graph']:.1f} "
                  f"| {r['mma_eager'] / r['mma_runtime_graph']:.2f}, "
                  f"{r['mma_eager_stream'] / r['mma_runtime_graph']:.2f} | {r['triton_eager']:.1f}, "
                  f"{r['triton_eager_stream']:.1f} | {r['mma_best']:.1f} |" for r in eager]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
