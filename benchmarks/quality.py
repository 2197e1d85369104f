"""Quality of the W4A16/W3A16 algorithms on the built-in model: perplexity, time, memory.

    python benchmarks/quality.py --out OUT [--device cuda] [--kernels]

Quantizes SmolLM2-135M with RTN, AWQ and GPTQ at W4 g64 and W3 g64 (the same calibration
tokens for all), measures perplexity of each on the held-out corpus part (same windows for
all), and prints a Markdown table: perplexity, gap to the float model, the share of RTN's
gap each algorithm closes, quantization time and peak memory. With --kernels every W4
checkpoint is evaluated again through the W4A16 Triton kernels (QuantizedLinear), once with
the tuned table (at evaluation sizes, M >= 256: dequantize + cuBLAS) and once forced onto
each fused path (the M = 1 GEMV, the swap-AB and the tiled tensor-core kernels), and the
largest relative perplexity difference to the dequantized evaluation is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from pathlib import Path

import torch

from optllm.eval.evaluate import evaluate_ppl
from optllm.kernels import w4a16 as w4k
from optllm.kernels.w4a16_configs import W4A16Config
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import quantize

KERNEL_PATHS = {
    "table": None,
    "gemv": W4A16Config(16, 64, 128, 4, 4, 1, gemv=True),
    "swap_ab": W4A16Config(16, 64, 128, 4, 4, 2, swap_ab=True),
    "tiled": W4A16Config(64, 128, 64, 2, 4, 3),
}


def overrides(items: list[str]) -> dict:
    """--set FIELD=VALUE pairs; VALUE read as YAML (true, 64, none -> "none")."""
    import yaml

    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--bits", default="4,3")
    ap.add_argument("--algos", default="rtn,awq,gptq")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--eval-dtype", default="float32")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="QuantizeConfig override, e.g. --set actorder=none --set true_sequential=false")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if (a.device == "auto" and torch.cuda.is_available()) else ("cpu" if a.device == "auto" else a.device)

    runs = []
    for bits in [int(b) for b in a.bits.split(",")]:
        for algo in a.algos.split(","):
            name = f"w{bits}a16-{algo}"
            cfg = QuantizeConfig.from_dict({"scheme": name, "group_size": a.group_size, "num_samples": a.num_samples,
                                            "seq_len": a.seq_len, "device": dev, **overrides(a.set)})
            t0 = time.perf_counter()
            rep = quantize(a.model, a.out / f"{name}-g{a.group_size}", cfg, overwrite=True, progress=False)
            runs.append({"scheme": name, "bits": bits, "algo": algo, "dir": str(a.out / f"{name}-g{a.group_size}"),
                         "quant_seconds": time.perf_counter() - t0, "peak_memory_bytes": rep.peak_memory_bytes,
                         "peak_memory_kind": rep.peak_memory_kind,
                         "mean_layer_error": sum(s.rel_error for s in rep.layers) / len(rep.layers)})
            last = runs[-1]
            print(f"{name}: {last['quant_seconds']:.1f} s, layer err {last['mean_layer_error']:.4f}", flush=True)

    rows = evaluate_ppl([a.model] + [r["dir"] for r in runs], dtype=a.eval_dtype, device=dev, progress=False)
    fp = rows[0].ppl
    for r, row in zip(runs, rows[1:]):
        r["ppl"] = row.ppl
    if a.kernels:
        w4 = [r for r in runs if r["bits"] == 4]
        drows = evaluate_ppl([r["dir"] for r in w4], dtype="bfloat16", device=dev, linear="dequant", progress=False)
        for r, d in zip(w4, drows):
            r["ppl_bf16_dequant"] = d.ppl
        for path, cfg in KERNEL_PATHS.items():  # each kernel path on every window, whatever M is
            with w4k.force_config(cfg) if cfg else contextlib.nullcontext():
                krows = evaluate_ppl([r["dir"] for r in w4], dtype="bfloat16", device=dev, linear="kernel",
                                     progress=False)
            for r, k in zip(w4, krows):
                r["ppl_bf16_kernel" if path == "table" else f"ppl_bf16_kernel_{path}"] = k.ppl

    lines = [f"float model ({a.model}): perplexity {fp:.4f} on {rows[0].num_tokens} tokens, "
             f"{rows[0].num_windows} windows of {rows[0].num_windows and rows[0].num_tokens // rows[0].num_windows}",
             "", "| scheme | group | ppl | Δ ppl vs float | gap closed vs RTN | quantize s | peak memory |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        rtn = next(x for x in runs if x["bits"] == r["bits"] and x["algo"] == "rtn")
        closed = "–" if r["algo"] == "rtn" else f"{100 * (rtn['ppl'] - r['ppl']) / (rtn['ppl'] - fp):.0f}%"
        delta = f"{r['ppl'] - fp:+.4f} ({100 * (r['ppl'] / fp - 1):+.1f}%)"
        memory = f"{r['peak_memory_bytes'] / 2**20:.0f} MiB ({r['peak_memory_kind']})"
        lines.append(f"| {r['scheme']} | {a.group_size} | {r['ppl']:.4f} | {delta} "
                     f"| {closed} | {r['quant_seconds']:.1f} | {memory} |")
    if a.kernels:
        paths = list(KERNEL_PATHS)
        lines += ["", "| scheme | ppl bf16 dequant | " + " | ".join(f"kernels: {p}" for p in paths)
                  + " | max rel. diff |", "|---|---|" + "---|" * (len(paths) + 1)]
        for r in runs:
            if "ppl_bf16_kernel" in r:
                ks = [r["ppl_bf16_kernel" if p == "table" else f"ppl_bf16_kernel_{p}"] for p in paths]
                d = max(abs(k / r["ppl_bf16_dequant"] - 1) for k in ks)
                lines.append(f"| {r['scheme']} | {r['ppl_bf16_dequant']:.4f} | "
                             + " | ".join(f"{k:.4f}" for k in ks) + f" | {100 * d:.3f}% |")
    table = "\n".join(lines)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": dev,
           "gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else platform.processor() or "cpu"}
    (a.out / "quality.json").write_text(json.dumps({"env": env, "float_ppl": fp, "runs": runs}, indent=2))
    (a.out / "quality.md").write_text(table + "\n")
    print(json.dumps(env))
    print(table)


if __name__ == "__main__":
    main()
