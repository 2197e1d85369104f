"""What a GEMM costs the first time torch runs it at a row count it has not seen: the catch-ups of
an EAGLE draft run its four linears (qkv, o, gate_up, down of SmolLM2's shapes) over a number of
rows that differs at nearly every catch-up, and the H100's temperature-1 waves measured those
catch-ups at 4.7-5.0 ms where benchmarks/catch_up_cost.py's, which repeat their shapes, took 1.3-1.7.
Per row count M (each new to the process): the first call's wall µs (synchronised), the second's,
bf16 on the GPU. A first call that costs far more than the second is a per-shape cost (cuBLAS's
heuristics, or its kernels' first load) that a catch-up over a new row count pays.

    python benchmarks/first_call_cost.py [--ms 517,543,1086,2431,2720,3001] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SHAPES = {"qkv": (1152, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # (K, N)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="517,543,1086,2431,2720,3001")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    w = {k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16) for k, (kk, n) in SHAPES.items()}
    F.linear(torch.randn(64, 576, device=dev, dtype=torch.bfloat16), w["o"])  # cuBLAS's handle and workspace
    torch.cuda.synchronize()

    def call(m: int, name: str) -> float:
        x = torch.randn(m, SHAPES[name][0], device=dev, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t = time.perf_counter()
        F.linear(x, w[name])
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6

    rows = []
    print(f"torch {torch.__version__}, cuBLAS {torch.backends.cuda.preferred_blas_library()}\n")
    print("| M | shape | first call µs | second µs |\n|---|---|---|---|")
    for m in (int(v) for v in a.ms.split(",")):
        for name in SHAPES:
            first, second = call(m, name), call(m, name)
            rows.append({"m": m, "shape": name, "first_us": first, "second_us": second})
            print(f"| {m} | {name} | {first:.0f} | {second:.0f} |", flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "first_call_cost.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
