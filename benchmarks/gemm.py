"""GEMM benchmark on the GPU: our Triton kernels against the peers, at Llama-3-8B shapes (and
SmolLM2-135M's: --shapes smol_qkv,smol_o,smol_gate_up,smol_down,smol_lm_head).

    python benchmarks/gemm.py [--shapes qkv,o,gate_up,down] [--ms 1,16,64,256,4096] [--out DIR]

For each shape (K×N, y = x·Wᵀ) and M: GPU time of a CUDA-graph replay (median, weight copies
rotated past 200 MB of int4 weights so that they are read from HBM, not the 60 MB L2, as in a
model: --l2 flush, the default; --l2 warm: 4 copies, the earlier sessions' tables, where
SmolLM2's weights and the 8B qkv / o int4 weights stayed in the L2) of
  ours: W4A16 (sym, g128; g64 on SmolLM2's shapes), W8A8-INT8 (per-token activation quantize + GEMM), FP8 (dynamic
        per-token + GEMM), NVFP4 weight-only; INT8 and FP8 also as the GEMM alone on the
        quantized x (the peers' terms: they are given quantized operands);
  peers: cuBLAS bf16 (x @ w.t()), tinygemm int4 (aten._weight_int4pack_mm, g128),
        torch._scaled_mm fp8 (row-wise scales), torch._int_mm int8 (no scaling);
plus our eager time (host overhead included), each kernel's relative error against its
torch reference on the same inputs, and % of the floor: max(bytes / 4.27 TB/s,
FLOPs / 694 TFLOP/s) with the bytes each format must move.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton

from optllm.benchmarks.common import ROT, flush_copies, graph_us, rel, shape_plan, sym_int4
from optllm.kernels import fp8 as fp8k
from optllm.kernels import nvfp4 as nvfp4k
from optllm.kernels import w4a16 as w4k
from optllm.kernels import w8a8_int8 as i8k

BW, FLOPS = 4.27e12, 694e12


def floor_us(m, n, k, wbytes_per_el, extra_w=0.0, act_bytes=2):
    bytes_ = n * k * wbytes_per_el + extra_w + m * k * act_bytes + m * n * 2
    return max(bytes_ / BW, 2 * m * n * k / FLOPS) * 1e6


def bench(fn, copies, graph=True):
    """Median microseconds of one call of fn (fn runs `copies` calls over rotated weights)."""
    if graph:
        return graph_us(fn, rep=60) / copies
    return 1000 * triton.testing.do_bench(fn, warmup=20, rep=60, return_mode="median") / copies


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--ms", default="1,16,64,256,4096")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--w4-layout", choices=("k", "n"), default="k",
                    help="the W4A16 words the table's column times: K-major (the checkpoint's) or N-major "
                         "(prepack_w4a16(n_major=True)); the other layout is timed too, as ours_w4a16_other "
                         "in gemm.json")
    ap.add_argument("--ops", default="", help="comma list of op names to time (default: all)")
    ap.add_argument("--l2", choices=("flush", "warm"), default="flush",
                    help=f"flush: weight copies rotated past 200 MB (read from HBM); warm: {ROT} copies")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for sname, k, n, G in shape_plan(a.shapes):
        rot = flush_copies(n * k // 2) if a.l2 == "flush" else ROT  # int4 bytes: every format moves as many or more
        wf = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(rot)]
        # int4 sym, group G
        w4 = []
        for w in wf:
            q, s = sym_int4(w, G)
            w4.append((q, s.to(torch.bfloat16)))
        n_major = a.w4_layout == "n"
        w4p = [w4k.prepack_w4a16(q, s, None, G, dtype=torch.bfloat16, n_major=n_major) for q, s in w4]
        w4o = [w4k.prepack_w4a16(q, s, None, G, dtype=torch.bfloat16, n_major=not n_major) for q, s in w4]
        # tinygemm: uint8 [N, K/2] + scales_and_zeros [K/G, N, 2]
        tg = []
        for q, s in w4:
            u = (q.to(torch.int32) + 8).to(torch.uint8)
            packed = (u[:, ::2] << 4 | u[:, 1::2]).contiguous()
            wp = None
            for inner in (8, 4, 2):  # tinygemm's inner K tiles: 8 needs K % 128 (not SmolLM2's 576)
                try:
                    wp = torch.ops.aten._convert_weight_to_int4pack(packed, inner)
                    break
                except Exception:
                    pass
            # tinygemm dequantizes (u - 8) * scale + zero: a symmetric grid has zero 0
            sz = torch.stack([s.t().float(), torch.zeros_like(s.t().float())], dim=-1).to(torch.bfloat16).contiguous()
            tg.append((wp, sz))
        # int8 / fp8 per-channel
        i8 = []
        f8 = []
        for w in wf:
            sc = w.float().abs().amax(1) / 127
            i8.append(i8k.prepack_w8a8(torch.round(w.float() / sc[:, None]).clamp(-127, 127).to(torch.int8), sc))
            sf = w.float().abs().amax(1) / 448
            f8.append(fp8k.prepack_fp8((w.float() / sf[:, None]).to(torch.float8_e4m3fn), sf))
        nv = [nvfp4k.prepack_nvfp4(*nvfp4k.quantize_nvfp4(w)) for w in wf]

        for m in [int(x) for x in a.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            r = {"shape": sname, "K": k, "N": n, "M": m, "copies": rot}
            ops = {
                "cublas_bf16": lambda i: x @ wf[i].t(),
                "ours_w4a16": lambda i: w4k.w4a16_linear(x, w4p[i]),
                "ours_w4a16_other": lambda i: w4k.w4a16_linear(x, w4o[i]),
                "ours_int8": lambda i: i8k.w8a8_int8_linear(x, i8[i]),
                "ours_fp8": lambda i: fp8k.fp8_linear(x, f8[i]),
                "ours_nvfp4": lambda i: nvfp4k.nvfp4_linear(x, nv[i]),
            }
            if tg[0][0] is not None:
                ops["tinygemm_int4"] = lambda i: torch.ops.aten._weight_int4pack_mm(x, tg[i][0], G, tg[i][1])
            xq8, xs8 = i8k.quantize_per_token_int8(x)
            ops["torch_int_mm"] = lambda i: torch._int_mm(xq8, i8[i].weight.t())
            xf8, xsf8 = fp8k.quantize_fp8(x)
            wt = [f.weight.t() for f in f8]
            wsc = [f.scale.reshape(1, -1) for f in f8]
            ops["torch_scaled_mm"] = lambda i: torch._scaled_mm(xf8, wt[i], scale_a=xsf8, scale_b=wsc[i],
                                                                out_dtype=torch.bfloat16)
            # our GEMMs alone on the pre-quantized x, as the peers are timed: the gap to the
            # columns above is the activation-quantize kernel
            ops["ours_int8_gemm"] = lambda i: i8k.w8a8_int8_gemm(xq8, xs8, i8[i].weight, i8[i].scale)
            ops["ours_fp8_gemm"] = lambda i: fp8k.fp8_gemm(xf8, xsf8, f8[i].weight, f8[i].scale)
            ops["ours_int8_quant"] = lambda i: i8k.quantize_per_token_int8(x)  # in gemm.json only
            ops["ours_fp8_quant"] = lambda i: fp8k.quantize_fp8(x)
            # correctness of ours on these inputs
            ref4 = x.float() @ w4k.dequantize_w4a16(w4p[0]).t()
            r["err_w4a16"] = rel(ops["ours_w4a16"](0), ref4) if not a.ops or "ours_w4a16" in a.ops else 0.0
            if not a.ops or "ours_w4a16_other" in a.ops:
                r["err_w4a16_other"] = rel(ops["ours_w4a16_other"](0), ref4)
            r["err_int8"] = rel(ops["ours_int8"](0), i8k.w8a8_int8_linear_ref(x, i8[0]))
            r["err_fp8"] = rel(ops["ours_fp8"](0), fp8k.fp8_linear_ref(x, f8[0]))
            if a.ops and "ours_nvfp4" not in a.ops:
                r["err_nvfp4"] = 0.0
            else:
                ref_nv = x.float() @ nvfp4k.dequantize_nvfp4(*nv[0].checkpoint_tensors(), torch.float32).t()
                r["err_nvfp4"] = rel(ops["ours_nvfp4"](0), ref_nv)
            for name, op in ops.items():
                if a.ops and name not in a.ops.split(","):
                    continue
                def fn(op=op):
                    return [op(i) for i in range(rot)]

                try:
                    fn()
                    r[name] = bench(fn, rot)
                    if name.startswith("ours") and not name.endswith(("_gemm", "_quant")) and not a.no_eager:
                        r[name + "_eager"] = bench(fn, rot, graph=False)
                except Exception as e:  # a peer that does not take this shape (e.g. _int_mm at M <= 16)
                    r[name] = None
                    r[name + "_why"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
            r["floor_bf16"] = floor_us(m, n, k, 2)
            r["floor_int4"] = floor_us(m, n, k, 0.5, extra_w=n * k / G * 2)
            r["floor_8bit"] = floor_us(m, n, k, 1, extra_w=n * 4, act_bytes=2)
            rows.append(r)
            print(json.dumps({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in r.items()}), flush=True)
        for held in (wf, w4, w4p, w4o, tg, i8, f8, nv):  # this shape's weights, before the next shape's
            held.clear()
        torch.cuda.empty_cache()

    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gemm.json").write_text(json.dumps(rows, indent=1))
    table = render(rows) + "\n" + render_w4(rows, a.w4_layout)
    (a.out / "gemm.md").write_text(table)
    print(table)


def fmt(v):
    return "–" if v is None else f"{v:.1f}"


def render(rows):
    env = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    copies = ", ".join(f"{k} {v}" for k, v in {r["shape"]: r.get("copies", ROT) for r in rows}.items())
    out = [f"GPU time per call, µs, CUDA-graph replay, weight copies rotated ({copies}; {env})", "",
           "| shape | M | cuBLAS bf16 | tinygemm | ours W4A16 (eager) | ×bf16 | ×tinygemm | % int4 floor "
           "| _scaled_mm | ours FP8 (eager) | ×_scaled_mm (GEMM only) | _int_mm | ours INT8 (eager) "
           "| ×_int_mm (GEMM only) | ours NVFP4 | max rel. err |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def pct(floor, t):
        return "–" if t is None else f"{100 * floor / t:.0f}%"

    def ratio(a, b):
        return "–" if a is None or b is None else f"{a / b:.2f}"

    for r in rows:
        g = r.get
        out.append(
            f"| {r['shape']} {r['K']}×{r['N']} | {r['M']} | {fmt(g('cublas_bf16'))} | {fmt(g('tinygemm_int4'))} "
            f"| {fmt(g('ours_w4a16'))} ({fmt(g('ours_w4a16_eager'))}) | {ratio(g('cublas_bf16'), g('ours_w4a16'))} "
            f"| {ratio(g('tinygemm_int4'), g('ours_w4a16'))} | {pct(r['floor_int4'], g('ours_w4a16'))} "
            f"| {fmt(g('torch_scaled_mm'))} | {fmt(g('ours_fp8'))} ({fmt(g('ours_fp8_eager'))}) "
            f"| {ratio(g('torch_scaled_mm'), g('ours_fp8'))} ({ratio(g('torch_scaled_mm'), g('ours_fp8_gemm'))}) "
            f"| {fmt(g('torch_int_mm'))} | {fmt(g('ours_int8'))} ({fmt(g('ours_int8_eager'))}) "
            f"| {ratio(g('torch_int_mm'), g('ours_int8'))} ({ratio(g('torch_int_mm'), g('ours_int8_gemm'))}) "
            f"| {fmt(g('ours_nvfp4'))} | {max(r['err_w4a16'], r['err_int8'], r['err_fp8'], r['err_nvfp4']):.1e} |"
        )
    return "\n".join(out) + "\n"


def render_w4(rows, layout):
    """W4A16 alone: the table's layout beside the other one (ours_w4a16_other)."""
    this, other = ("N-major", "K-major") if layout == "n" else ("K-major", "N-major")
    out = [f"W4A16 sym g128, µs: ours with {this} words beside {other}", "",
           f"| shape | M | cuBLAS bf16 | tinygemm | ours {this} | ours {other} | ×bf16 | ×tinygemm "
           "| % int4 floor | rel. err |", "|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(a, b):
        return "–" if a is None or not b else f"{a / b:.2f}"

    for r in rows:
        g = r.get
        t = g("ours_w4a16")
        pct = "–" if not t else f"{100 * r['floor_int4'] / t:.0f}%"
        out.append(f"| {r['shape']} | {r['M']} | {fmt(g('cublas_bf16'))} | {fmt(g('tinygemm_int4'))} | {fmt(t)} "
                   f"| {fmt(g('ours_w4a16_other'))} | {ratio(g('cublas_bf16'), t)} | {ratio(g('tinygemm_int4'), t)} "
                   f"| {pct} | {max(r['err_w4a16'], r.get('err_w4a16_other', 0.0)):.1e} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
