"""What the GPU benchmark and tuning scripts share: the Llama-3-8B projection shapes and the
timing method (median GPU time of a CUDA-graph replay, weight copies rotated inside the graph
so that int4 weights do not sit in the 60 MB L2)."""

from __future__ import annotations

import triton

# name -> (K, N) of y = x W^T, W [N, K]
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROT = 4  # weight copies per timed call


def parse_shapes(csv: str) -> list[str]:
    names = csv.split(",")
    bad = [s for s in names if s not in SHAPES]
    if bad:
        raise SystemExit(f"unknown shape(s) {', '.join(bad)}: allowed {', '.join(SHAPES)}")
    return names


def graph_us(fn, rep: int = 20) -> float:
    """Median µs of one replay of fn captured in a CUDA graph."""
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def rotated_us(op, rep: int = 20) -> float:
    """µs per call of op(i), timed as one graph of op(0) .. op(ROT - 1) divided by ROT."""
    fn = lambda: [op(i) for i in range(ROT)]  # noqa: E731
    fn()
    return graph_us(fn, rep) / ROT
