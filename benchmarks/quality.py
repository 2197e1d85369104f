"""Quality of the W4A16/W3A16 algorithms on the built-in model: perplexity, time, memory.

    python benchmarks/quality.py --out OUT [--device cuda] [--kernels]

Quantizes SmolLM2-135M with RTN, AWQ and GPTQ at W4 g64 and W3 g64, symmetric and/or
asymmetric (--symmetry), plus named --variant runs (the same calibration tokens for all),
and --extra checkpoints made elsewhere (llm-compressor's: benchmarks/peer_llmcompressor.py);
measures the perplexity of each on every built-in text kind's held-out split (same windows
for all), and prints a Markdown table: perplexity per kind and the share of the gap of RTN
(same bits and symmetry) to the float model each run closes, and the quantization time. With --kernels every W4
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

from optllm.benchmarks.common import provenance
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


def variants(items: list[str]) -> list[tuple[str, str, dict]]:
    """--variant NAME:ALGO:FIELD=VALUE,FIELD=VALUE -> (name, algo, overrides)."""
    out = []
    for item in items:
        parts = item.split(":", 2)
        if len(parts) < 2:
            raise SystemExit(f"--variant {item!r}: expected NAME:ALGO[:FIELD=VALUE,...]")
        fields = parts[2] if len(parts) == 3 else ""
        out.append((parts[0], parts[1], overrides([f for f in _split_top(fields) if f])))
    return out


def _split_top(text: str) -> list[str]:
    """text split at the commas outside {...} / [...] (a field's value may be a YAML mapping)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "{[" and 1 or ch in "}]" and -1 or 0
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calib", default="builtin", help="calibration source (QuantizeConfig.calib)")
    ap.add_argument("--bits", default="4,3")
    ap.add_argument("--algos", default="rtn,awq,gptq")
    ap.add_argument("--symmetry", default="sym", help="sym, asym or sym,asym")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--kinds", default=None, help="text kinds to evaluate on (default: all built-in kinds)")
    ap.add_argument("--max-windows", type=int, default=None, help="windows of 512 tokens per kind")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--eval-dtype", default="float32")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="QuantizeConfig override for every run, e.g. --set actorder=none")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:ALGO:FIELD=VALUE,...",
                    help="one more run per bits and symmetry, e.g. gptq-cap16:gptq:token_cap=16")
    ap.add_argument("--extra", action="append", default=[], metavar="LABEL:BITS:SYM=DIR",
                    help="a checkpoint made elsewhere (e.g. llm-compressor) evaluated beside ours")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if (a.device == "auto" and torch.cuda.is_available()) else ("cpu" if a.device == "auto" else a.device)

    runs = []
    for bits in [int(b) for b in a.bits.split(",")]:
        for sym in a.symmetry.split(","):
            plan = [(algo, algo, {}) for algo in a.algos.split(",") if algo] + variants(a.variant)
            for label, algo, fields in plan:
                name = f"w{bits}a16-{algo}"
                tag = f"w{bits}-{label}-g{a.group_size}-{sym}"
                cfg = QuantizeConfig.from_dict({"scheme": name, "group_size": a.group_size,
                                                "num_samples": a.num_samples, "seq_len": a.seq_len,
                                                "device": dev, "calib": a.calib, "symmetric": sym == "sym",
                                                **overrides(a.set), **fields})
                t0 = time.perf_counter()
                rep = quantize(a.model, a.out / tag, cfg, overwrite=True, progress=False)
                runs.append({"scheme": name, "label": label, "bits": bits, "symmetry": sym, "algo": algo,
                             "dir": str(a.out / tag), "config": cfg.to_dict(),
                             "quant_seconds": time.perf_counter() - t0,
                             "peak_memory_bytes": rep.peak_memory_bytes, "peak_memory_kind": rep.peak_memory_kind,
                             "mean_layer_error": sum(s.rel_error for s in rep.layers) / len(rep.layers),
                             "holdout": rep.holdout_summary(), "calibration": rep.calibration})
                last = runs[-1]
                print(f"{tag}: {last['quant_seconds']:.1f} s, layer err {last['mean_layer_error']:.4f}, "
                      f"held-out worse than RTN: {last['holdout']['worse_than_rtn']}", flush=True)
    for item in a.extra:
        spec, _, folder = item.partition("=")
        label, bits, sym = spec.split(":")
        runs.append({"scheme": f"w{bits}a16-{label}", "label": label, "bits": int(bits), "symmetry": sym,
                     "algo": label, "dir": folder, "quant_seconds": None, "peak_memory_bytes": None})

    rows = evaluate_ppl([a.model] + [r["dir"] for r in runs], kinds=a.kinds, max_windows=a.max_windows,
                        dtype=a.eval_dtype, device=dev, progress=False)
    fp = rows[0].ppl_by_kind
    kinds = list(fp)
    for r, row in zip(runs, rows[1:]):
        r["ppl"] = row.ppl_by_kind
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

    lines = [f"float model ({a.model}): " + ", ".join(f"{k} {fp[k]:.4f}" for k in kinds)
             + f" (windows of 512 tokens, at most {a.max_windows or 'all'} per kind)", "",
             "| bits | sym | run | " + " | ".join(f"{k} ppl (gap closed)" for k in kinds) + " | quantize s |",
             "|---|---|---|" + "---|" * (len(kinds) + 1)]
    for r in runs:
        rtn = next((x for x in runs if x["bits"] == r["bits"] and x["symmetry"] == r["symmetry"]
                    and x["label"] == "rtn"), None)
        cells = []
        for k in kinds:
            if rtn is None or r is rtn:
                cells.append(f"{r['ppl'][k]:.3f}")
            else:
                closed = 100 * (rtn["ppl"][k] - r["ppl"][k]) / (rtn["ppl"][k] - fp[k])
                r.setdefault("gap_closed", {})[k] = closed
                cells.append(f"{r['ppl'][k]:.3f} ({closed:.0f}%)")
        secs = "–" if r["quant_seconds"] is None else f"{r['quant_seconds']:.0f}"
        lines.append(f"| {r['bits']} | {r['symmetry']} | {r['label']} | " + " | ".join(cells) + f" | {secs} |")
    if a.kernels:
        paths = list(KERNEL_PATHS)
        lines += ["", "| scheme | ppl bf16 dequant | " + " | ".join(f"kernels: {p}" for p in paths)
                  + " | max rel. diff |", "|---|---|" + "---|" * (len(paths) + 1)]
        for r in runs:
            if "ppl_bf16_kernel" in r:  # the first kind's perplexity
                ks = [r["ppl_bf16_kernel" if p == "table" else f"ppl_bf16_kernel_{p}"] for p in paths]
                d = max(abs(k / r["ppl_bf16_dequant"] - 1) for k in ks)
                lines.append(f"| {r['scheme']} | {r['ppl_bf16_dequant']:.4f} | "
                             + " | ".join(f"{k:.4f}" for k in ks) + f" | {100 * d:.3f}% |")
    table = "\n".join(lines)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": dev,
           "gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else platform.processor() or "cpu",
           **provenance()}
    (a.out / "quality.json").write_text(json.dumps({"env": env, "float_ppl": fp, "runs": runs}, indent=2))
    (a.out / "quality.md").write_text(table + "\n")
    print(json.dumps(env))
    print(table)


if __name__ == "__main__":
    main()
