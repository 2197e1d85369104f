"""Layer-level screen of GPTQ variants on text the calibration never saw (CPU, minutes).

    python benchmarks/gptq_ood_proxy.py --calib CALIB.pt --ood docs=EVAL.pt --ood code=CODE.pt \
        [--bits 4] [--group-size 64] [--asym] [--variants base,damp0.1,...] [--json OUT]

Every linear of the float model gets two Gram matrices of its inputs: H_c on the calibration
windows (CALIB.pt: int64 ids [num_samples, seq_len]) and H_o on each out-of-domain text (a 1-D
id tensor, cut into windows of --window tokens). Each variant quantizes every linear from H_c
alone; its out-of-domain error is ‖X_o (W − Ŵ)ᵀ‖² / ‖X_o Wᵀ‖² = tr(Δ H_o Δᵀ) / tr(W H_o Wᵀ),
reported as a ratio to RTN's (same grid) — geometric mean over linears, and the number of
linears worse than RTN. The float model's inputs are used throughout (no sequential
quantization), so this ranks variants quickly; perplexity decides (benchmarks/quality.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time

import torch

from optllm.formats.args import QuantArgs
from optllm.quant.gptq import gptq_quantize
from optllm.quant.rtn import rtn_quantize

_SHARED = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # same input


def _input_key(name: str) -> str:
    head, _, last = name.rpartition(".")
    return f"{head}.{_SHARED.get(last, last)}"


def grams(model, windows: torch.Tensor, caps: tuple[float, ...] = (), pattern: str = "") -> dict[str, torch.Tensor]:
    """Σ x xᵀ / n of every linear's input (float64 for the OOD traces), keyed by linear name;
    with caps, also "NAME@tokcapC": each token's outer product weighted by
    min(1, C · median ‖x‖² / ‖x_t‖²) (median over the window)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name, mod in model.named_modules():
        if (isinstance(mod, torch.nn.Linear) and "layers." in name and _input_key(name) == name
                and (not pattern or re.search(pattern, name))):
            def hook(_m, args, _name=name):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
                sums[_name] = sums.get(_name, 0) + x.T @ x
                counts[_name] = counts.get(_name, 0) + x.shape[0]
                sq = x.pow(2).sum(1)
                for c in caps:
                    wt = (c * sq.median() / sq).clamp(max=1.0)
                    key = f"{_name}@tokcap{c:g}"
                    sums[key] = sums.get(key, 0) + (x * wt[:, None]).T @ x
                    counts[key] = counts.get(key, 0) + x.shape[0]
            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        for w in windows:
            model(w.unsqueeze(0))
    for h in hooks:
        h.remove()
    return {k: (v / counts[k]).double() for k, v in sums.items()}


def variant_hessian(hc: dict, name: str, spec: str) -> tuple[torch.Tensor, float]:
    """(Hessian handed to GPTQ, dampening) for a variant name."""
    damp = 0.01
    h = hc[name].clone()
    for part in spec.split("+"):
        if part == "base":
            continue
        if part.startswith("tokcap"):
            h = hc[f"{name}@{part}"].clone()
            continue
        if part.startswith("damp"):
            damp = float(part[4:])
        elif part.startswith("shrink"):  # H ← (1 − λ) H + λ diag(H)
            lam = float(part[6:])
            d = torch.diagonal(h).clone()
            h.mul_(1 - lam)
            h.diagonal().add_(lam * d)
        elif part.startswith("cap"):  # cap each channel's energy at c × median(diag): H ← D H D
            c = float(part[3:])
            d = torch.diagonal(h)
            cap = c * d.median()
            f = torch.where(d > cap, (cap / d).sqrt(), torch.ones_like(d))
            h = h * f[:, None] * f[None, :]
        elif part.startswith("local"):  # massive channels (diag > c × median): no cross terms
            c = float(part[5:])
            d = torch.diagonal(h)
            big = d > c * d.median()
            keep = torch.diagonal(h).clone()
            h[big, :] = 0
            h[:, big] = 0
            h[big, big] = keep[big]
        else:
            raise SystemExit(f"unknown variant part {part!r}")
    return h, damp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib", required=True)
    ap.add_argument("--ood", action="append", default=[], help="NAME=IDS.pt (1-D ids)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=16)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--asym", action="store_true")
    ap.add_argument("--variants", default="base,damp0.1")
    ap.add_argument("--layers", default="", help="regex on linear names (default all)")
    ap.add_argument("--json")
    ap.add_argument("--cache", help="keep the Gram matrices here, reused when the inputs are the same")
    a = ap.parse_args()

    from optllm.hub.loader import load_model

    model, _tok, _ = load_model(a.model, dtype="float32", device="cpu")
    t0 = time.perf_counter()
    calib = torch.load(a.calib)
    caps = tuple(sorted({float(p[6:]) for v in a.variants.split(",") for p in v.split("+") if p.startswith("tokcap")}))
    cached = torch.load(a.cache) if a.cache and os.path.exists(a.cache) else None
    if cached is not None and cached["key"] == [a.calib, a.ood, caps, a.layers, a.window, a.max_windows]:
        hc, ho = cached["hc"], cached["ho"]
    else:
        hc = grams(model, calib, caps, a.layers)
        ho = {}
        for spec in a.ood:
            name, path = spec.split("=", 1)
            ids = torch.load(path).reshape(-1)
            n = min(a.max_windows, ids.numel() // a.window)
            ho[name] = grams(model, ids[: n * a.window].reshape(n, a.window), (), a.layers)
        if a.cache:
            torch.save({"key": [a.calib, a.ood, caps, a.layers, a.window, a.max_windows], "hc": hc, "ho": ho}, a.cache)
    print(f"grams: {time.perf_counter() - t0:.0f} s", flush=True)
    args = QuantArgs(a.bits, a.group_size, not a.asym, "static")
    rtn_args = QuantArgs(a.bits, a.group_size, not a.asym)
    params = dict(model.named_parameters())
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers." in n
             and (not a.layers or re.search(a.layers, n))]

    def rel(d, w, h):
        return float(torch.einsum("nk,kl,nl->", d, h, d) / torch.einsum("nk,kl,nl->", w, h, w))

    def ood_err(w, dq):
        d, w = w.double() - dq.double(), w.double()
        key = _input_key(n_)
        return {k: rel(d, w, h[key]) for k, h in ho.items()} | {"calib": rel(d, w, hc[key])}

    results: dict[str, dict[str, dict[str, float]]] = {}
    for n_ in names:
        w = params[n_ + ".weight"].detach().float()
        results.setdefault("rtn", {})[n_] = ood_err(w, rtn_quantize(w, rtn_args).dequantize(torch.float32))
    for v in a.variants.split(","):
        tv = time.perf_counter()
        for n_ in names:
            w = params[n_ + ".weight"].detach().float()
            h, damp = variant_hessian(hc, _input_key(n_), v)
            h = h.float() * 2
            qw, _ = gptq_quantize(w, h, args, dampening=damp)
            results.setdefault(v, {})[n_] = ood_err(w, qw.dequantize(torch.float32))
        print(f"{v}: {time.perf_counter() - tv:.0f} s", flush=True)

    kinds = ["calib", *ho]
    print("| variant | " + " | ".join(f"{k}: gmean ratio to RTN, worse/total" for k in kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    summary = {}
    for v, per in results.items():
        cells = []
        for k in kinds:
            ratios = [per[n][k] / results["rtn"][n][k] for n in names]
            g = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            worse = sum(r > 1 for r in ratios)
            summary.setdefault(v, {})[k] = {"gmean_ratio": g, "worse": worse, "max_ratio": max(ratios)}
            cells.append(f"{g:.3f}, {worse}/{len(ratios)} (max {max(ratios):.2f})")
        print(f"| {v} | " + " | ".join(cells) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "summary": summary, "per_linear": results}, f, indent=1)


if __name__ == "__main__":
    main()
