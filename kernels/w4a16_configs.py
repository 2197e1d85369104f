"""Launch configurations of the W4A16 GEMM (kernels/w4a16.py), as data.

A W4A16Config per (M bucket, N, K) for the shapes we have tuned for, and a heuristic for
the rest. Kept apart from the kernels so that tuning edits data, not kernel code.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from types import MappingProxyType

# 128 (forty-third session): M = 65..128 had shared M = 256's entries, where the whole weight is dequantized for
# cuBLAS; at M = 80 that costs 2.9x M = 64's swap-AB tile on down (H100, 106.3 against 36.5 µs). Its own bucket
# lets benchmarks/tune_w4a16.py --ms 128 fill it: the forty-fifth session did, on an H100 (the entries below).
M_BUCKETS = (1, 16, 64, 128, 256, 4096)


@dataclass(frozen=True)
class W4A16Config:
    """Launch shape of the W4A16 kernel.

    gemv: the CUDA-core GEMV (decode sizes); its K loop is software-pipelined num_stages deep
    (1: not pipelined). Over N-major words (``prepack_w4a16(n_major=True)``) a program takes
    up to block_m rows of x (1 ..: the words are read once for all of them); over K-major
    words one row, block_m unused.
    swap_ab: the weight tile is the MMA's M side and x's rows its N side (decode sizes);
    block_m is then the x rows per tile. dequant: dequantize the weight to x's dtype and
    call cuBLAS (large M); the block sizes are unused. block_k counts K values per
    iteration; the kernel halves it until a K-block lies inside one quantization group.
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    swap_ab: bool = False
    dequant: bool = False
    gemv: bool = False

    def __post_init__(self) -> None:
        pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
        lo = 1 if self.gemv else 16
        if not pow2(self.block_m) or not lo <= self.block_m <= 256:
            raise ValueError(f"block_m={self.block_m}: allowed a power of two in {lo}..256")
        hi = 2048 if self.gemv else 512
        if not pow2(self.block_n) or not 16 <= self.block_n <= hi:
            raise ValueError(f"block_n={self.block_n}: allowed a power of two in 16..{hi}")
        if not pow2(self.block_k) or not 32 <= self.block_k <= 1024:
            raise ValueError(f"block_k={self.block_k}: allowed a power of two in 32..1024")
        if self.split_k < 1 or self.num_stages < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"split_k={self.split_k}, num_stages={self.num_stages}, num_warps="
                             f"{self.num_warps}: need split_k, num_stages >= 1, num_warps in 1..16")


def m_bucket(m: int) -> int:
    """Smallest of M_BUCKETS >= m (the last bucket takes every larger m)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


_C = W4A16Config
# (m_bucket, N, K) -> config, Llama-3-8B projections qkv / o / gate_up / down, the fastest of
# benchmarks/tune_w4a16.py's candidates on the H200 (2026-11-30; µs of a CUDA-graph replay,
# sym g128, bf16). M = 1: the CUDA-core GEMV; M = 16, 64: swap_ab tensor-core tiles; M >= 256:
# dequantize + cuBLAS, which beat every fused tile tried (0.2-0.5x cuBLAS bf16), except a
# 128-row swap_ab tile on gate_up at M = 256.
# SmolLM2-135M's shapes (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536, the LM
# head 49152 x 576; sym g64), tuned on the H200 on 2026-12-04 (tune_w4a16.py --shapes smol_...;
# µs, the heuristic's before): the GEMV with 16-32-wide tiles and no split where K is 576; at M = 64
# dequantize + cuBLAS (the LM head's M = 64 winner tied the heuristic: 26.4 vs 26.5).
# M = 1 re-tuned the same day with the weights read from HBM (tune_w4a16.py --l2 flush: copies
# rotated past 200 MB; four copies of these few-hundred-kB weights had sat in the L2, and the
# winners of that, 2.8-3.7 µs there, took 5.05-5.59 µs from HBM): split 8, one stage. Inside
# SmolLM2's W4A16 decode graph the GEMV went from 4.88 to 4.03 µs a call (profile_step.py).
W4A16_CONFIGS = MappingProxyType({
    (1, 960, 576): _C(16, 32, 128, 8, 4, 1, gemv=True),          # 4.2 from HBM (5.39 the L2 winner)
    (1, 576, 576): _C(16, 16, 256, 8, 4, 1, gemv=True),          # 4.0 (5.39)
    (1, 3072, 576): _C(16, 64, 256, 8, 8, 1, gemv=True),         # 4.4 (5.59)
    (1, 576, 1536): _C(16, 32, 256, 8, 8, 1, gemv=True),         # 4.7 (5.05)
    (1, 49152, 576): _C(16, 32, 256, 4, 2, 1, gemv=True),        # 9.0 (16.4)
    (16, 960, 576): _C(16, 64, 256, 8, 8, 1, swap_ab=True),      # 4.4 (7.9)
    (16, 576, 576): _C(16, 64, 256, 8, 8, 1, swap_ab=True),      # 4.4 (8.0)
    (16, 3072, 576): _C(16, 64, 256, 8, 8, 1, swap_ab=True),     # 5.0 (8.6)
    (16, 576, 1536): _C(16, 64, 256, 8, 8, 1, swap_ab=True),     # 5.0 (7.6)
    (16, 49152, 576): _C(16, 64, 128, 2, 4, 1, swap_ab=True),    # 17.7 (22.7)
    **{(64, n, k): _C(128, 128, 128, dequant=True)                # 4.5-6.4 (9.8-11.8)
       for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536))},
    (1, 6144, 4096): _C(16, 64, 256, 8, 4, 1, gemv=True),        # 8.4
    (1, 4096, 4096): _C(16, 32, 128, 8, 2, 1, gemv=True),        # 6.2
    (1, 28672, 4096): _C(16, 128, 256, 4, 2, 2, gemv=True),      # 24.6 (25.2 unpipelined)
    (1, 4096, 14336): _C(16, 64, 256, 8, 4, 3, gemv=True),       # 15.5 (16.7 before)
    (16, 6144, 4096): _C(16, 64, 128, 8, 4, 2, swap_ab=True),    # 14.3
    (16, 4096, 4096): _C(16, 128, 128, 8, 8, 3, swap_ab=True),   # 10.2
    (16, 28672, 4096): _C(16, 64, 256, 2, 4, 2, swap_ab=True),   # 43.3
    (16, 4096, 14336): _C(16, 64, 128, 8, 4, 4, swap_ab=True),   # 26.8
    (64, 6144, 4096): _C(64, 64, 128, 4, 4, 3, swap_ab=True),    # 20.8
    (64, 4096, 4096): _C(64, 128, 128, 4, 8, 3, swap_ab=True),   # 16.2
    (64, 28672, 4096): _C(64, 128, 128, 1, 4, 3, swap_ab=True),  # 58.5
    (64, 4096, 14336): _C(64, 128, 128, 8, 8, 3, swap_ab=True),  # 35.1
    **{(m, n, k): _C(128, 128, 128, dequant=True)
       for m in (256, 4096) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))},
    (256, 28672, 4096): _C(128, 128, 64, 1, 8, 4, swap_ab=True),  # 168.6 (dequant 188.1)
    # tune_w4a16.py --ms 256 on an H100 (forty-sixth session, 110 s): qkv's swap-AB 64-row tiles beat dequantize +
    # cuBLAS (50.0 µs); o (32.5 against 32.9) and gate_up stay; down's fastest computed wrong (kernels/w4a16._plan)
    (256, 6144, 4096): _C(64, 64, 128, 1, 4, 3, swap_ab=True),    # 45.6
    # down again with every candidate checked (forty-seventh session, H100, 80 s, 80 timed, none wrong): a 64-row
    # swap-AB tile split 2 (relative error 2.2e-3) against dequantize + cuBLAS's 114.8
    (256, 4096, 14336): _C(64, 128, 128, 2, 8, 3, swap_ab=True),  # 95.0
    # M = 65..128: tune_w4a16.py --ms 128 on an H100 (forty-fifth session, 75 s; µs at M = 128, what the bucket
    # ran before in brackets: M = 256's entries). cuBLAS bf16 read 20.6 / 15.1 / 84.7 / 50.9 in the same run.
    (128, 6144, 4096): _C(64, 64, 128, 2, 4, 3, swap_ab=True),    # 30.4 (43.7)
    (128, 4096, 4096): _C(64, 128, 128, 4, 8, 3, swap_ab=True),   # 22.3 (27.4)
    (128, 28672, 4096): _C(128, 128, 64, 1, 8, 4, swap_ab=True),  # 86.6 (86.6)
    (128, 4096, 14336): _C(64, 128, 128, 4, 8, 3, swap_ab=True),  # 54.2 (108.5)
})


# The runtime's W4A16 word layout per (N, K) (runtime/layers/linear_methods.W4A16Method packs
# at load): N-major where benchmarks/gemm.py --w4-layout n measured it ahead at decode sizes
# (H200, 2026-12-03, docs/BENCHMARKS.md): Llama-3-8B down, M = 16 22.0 vs 27.2 µs, M = 64
# 32.2 vs 35.3, M = 1 15.6 vs 15.5, M = 256 90.8 vs 92.8. Every other shape keeps K-major,
# the checkpoint's (qkv, o, gate_up are faster K-major at M = 1..16).
N_MAJOR_SHAPES = frozenset({(4096, 14336)})

# (gemv_bucket, N, K) -> config for N-major words (prepack_w4a16(n_major=True)), where they
# differ from W4A16_CONFIGS: the N-major GEMV at M = 1, from benchmarks/tune_w4a16.py --layout
# n on the H200 (2026-12-03, µs of a CUDA-graph replay, sym g128, bf16). Its M = 4 / 8 winners
# (22.7 / 71.1 µs on qkv: x rows per program multiply the registers) lose to the swap_ab
# tiles, which those sizes take from W4A16_CONFIGS' M = 16 entries.
W4A16_CONFIGS_N = MappingProxyType({
    (1, 6144, 4096): _C(1, 256, 64, 11, 4, 3, gemv=True),     # 9.8 (K-major GEMV 8.5)
    (1, 4096, 4096): _C(1, 256, 32, 16, 4, 3, gemv=True),     # 7.5 (6.3)
    (1, 28672, 4096): _C(1, 512, 32, 9, 4, 3, gemv=True),     # 25.5 (24.6)
    (1, 4096, 14336): _C(1, 256, 128, 16, 4, 3, gemv=True),   # 15.5 (15.5)
})


def gemv_bucket(m: int) -> int:
    """The N-major GEMV's buckets: the power of two >= m up to 8 (x rows per program), then
    m_bucket's."""
    return 1 << (m - 1).bit_length() if m <= 8 else m_bucket(m)


def table_to_json(entries: dict) -> str:
    """{(n_major, bucket, N, K): W4A16Config} as the JSON OPTLLM_W4A16_TABLE reads."""
    return json.dumps([{"n_major": nm, "m": b, "n": n, "k": k, "config": asdict(c)}
                       for (nm, b, n, k), c in entries.items()], indent=1)


def _table_from_env() -> dict:
    """OPTLLM_W4A16_TABLE=FILE (what tune_w4a16.py writes, table_to_json) adds to the tables,
    read once at import: a tuning run measures its winners end to end (benchmarks/gemm.py)
    before they are pasted above."""
    path = os.environ.get("OPTLLM_W4A16_TABLE")
    if not path:
        return {}
    with open(path) as f:
        return {(bool(e["n_major"]), int(e["m"]), int(e["n"]), int(e["k"])): W4A16Config(**e["config"])
                for e in json.load(f)}


_ENV = _table_from_env()
if _ENV:
    W4A16_CONFIGS = MappingProxyType({**W4A16_CONFIGS, **{key[1:]: c for key, c in _ENV.items() if not key[0]}})
    W4A16_CONFIGS_N = MappingProxyType({**W4A16_CONFIGS_N, **{key[1:]: c for key, c in _ENV.items() if key[0]}})


def lookup_w4a16_config(m: int, n: int, k: int, n_major: bool = False) -> W4A16Config:
    """The table's entry for this call, else the heuristic. N-major words: their own table
    first (by gemv_bucket), then above M = 1 the K-major table (the tile kernels read either
    layout), then the heuristic."""
    if n_major:
        cfg = W4A16_CONFIGS_N.get((gemv_bucket(m), n, k))
        if cfg is None and m > 1:
            cfg = W4A16_CONFIGS.get((m_bucket(m), n, k))
        return cfg or default_w4a16_config(m, n, k, n_major=True)
    return W4A16_CONFIGS.get((m_bucket(m), n, k)) or default_w4a16_config(m, n, k)


def default_w4a16_config(m: int, n: int, k: int, n_major: bool = False) -> W4A16Config:
    """Heuristic for shapes absent from the tables: the GEMV at M = 1 (N-major words: 512 n
    per program of 4 warps, split over K until about 264 programs run, each split keeping
    >= 4 steps of 8 word rows), swap_ab tiles up to
    M = 64, split over K until about 528 programs run (each split keeping >= 2 K-blocks),
    dequantize + cuBLAS above (at M = 256 on the H200 it beat the plain tiled kernel on all
    four Llama shapes by 5-40%, docs/bench/tune_w4a16_h200_m256.json)."""
    if n_major and m == 1:
        split = max(1, min(264 // -(-n // 512), k // (64 * 4)))
        return W4A16Config(1, 512, 64, split, 4, 3, gemv=True)
    if m > 64:
        return W4A16Config(128, 128, 128, dequant=True)
    if m == 1:
        return W4A16Config(16, 64, 256, max(1, min(8, k // 1024)), 4, 2, gemv=True)
    bm = 16 if m <= 16 else 64
    tiles = -(-m // bm) * -(-n // 128)
    split = max(1, min(528 // tiles, -(-k // 128) // 2))
    return W4A16Config(bm, 128, 128, split, 4, 3, swap_ab=True)
