"""Launch configurations of the W4A16 GEMM (kernels/w4a16.py), as data.

A W4A16Config per (M bucket, N, K) for the shapes we have tuned for, and a heuristic for
the rest. Kept apart from the kernels so that tuning edits data, not kernel code.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

M_BUCKETS = (1, 16, 64, 256, 4096)


@dataclass(frozen=True)
class W4A16Config:
    """Launch shape: block_m == 1 selects the CUDA-core GEMV kernel (one x row per program,
    so M rows re-read the weights, from L2), block_m >= 16 the tensor-core kernel.

    block_k counts K values per iteration (block_k // 8 packed rows); the tensor-core
    kernel needs block_k >= 128 (each of its eight per-nibble dots has K = block_k // 8).
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
        if self.block_m != 1 and (not pow2(self.block_m) or not 16 <= self.block_m <= 256):
            raise ValueError(f"block_m={self.block_m}: allowed 1 or a power of two in 16..256")
        if not pow2(self.block_n) or self.block_n < 16:
            raise ValueError(f"block_n={self.block_n}: allowed a power of two >= 16")
        min_k = 128 if self.block_m > 1 else 32
        if not pow2(self.block_k) or self.block_k < min_k:
            raise ValueError(f"block_k={self.block_k}: allowed a power of two >= {min_k} "
                             f"for block_m={self.block_m}")
        if self.split_k < 1 or self.num_stages < 1 or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"split_k={self.split_k}, num_stages={self.num_stages}, num_warps="
                             f"{self.num_warps}: need split_k, num_stages >= 1, num_warps in 1..16")


def m_bucket(m: int) -> int:
    """Smallest of M_BUCKETS >= m (the last bucket takes every larger m)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


_C = W4A16Config
# (m_bucket, N, K) -> config, Llama-3-8B projections qkv / o / gate_up / down. Roofline
# guesses for the H200 (132 SMs), not tuned: decode keeps ~4-8 programs per SM through
# split-K while partials (split * M * N * 4 bytes) stay small beside the weights; from
# M = 64 up, tensor-core tiles with little or no split. One untuned H200 run (the 3-D GEMV
# since replaced by the 2-D one) gave 0.6-1.0x cuBLAS bf16 at M <= 16, ~0.2x at M >= 256.
W4A16_CONFIGS = MappingProxyType({
    (1, 6144, 4096): _C(1, 128, 128, 16, 4, 2),
    (1, 4096, 4096): _C(1, 128, 128, 16, 4, 2),
    (1, 28672, 4096): _C(1, 128, 128, 4, 4, 2),
    (1, 4096, 14336): _C(1, 128, 128, 16, 4, 2),
    (16, 6144, 4096): _C(16, 64, 128, 4, 4, 3),
    (16, 4096, 4096): _C(16, 32, 128, 4, 4, 3),
    (16, 28672, 4096): _C(16, 128, 128, 2, 4, 3),
    (16, 4096, 14336): _C(16, 64, 128, 8, 4, 3),
    (64, 6144, 4096): _C(64, 128, 128, 2, 4, 3),
    (64, 4096, 4096): _C(64, 64, 128, 2, 4, 3),
    (64, 28672, 4096): _C(64, 128, 128, 1, 4, 3),
    (64, 4096, 14336): _C(64, 128, 128, 4, 4, 3),
    (256, 6144, 4096): _C(128, 128, 128, 2, 8, 3),
    (256, 4096, 4096): _C(128, 128, 128, 2, 8, 3),
    (256, 28672, 4096): _C(128, 128, 128, 1, 8, 3),
    (256, 4096, 14336): _C(128, 128, 128, 2, 8, 3),
    (4096, 6144, 4096): _C(128, 128, 128, 1, 8, 3),
    (4096, 4096, 4096): _C(128, 128, 128, 1, 8, 3),
    (4096, 28672, 4096): _C(128, 128, 128, 1, 8, 3),
    (4096, 4096, 14336): _C(128, 128, 128, 1, 8, 3),
})


def default_w4a16_config(m: int, n: int, k: int) -> W4A16Config:
    """Heuristic for shapes absent from W4A16_CONFIGS: pick the tile by M, then split K
    until about `target` programs run (each split keeping >= 2 iterations)."""
    bn = min(128, max(16, 1 << (n - 1).bit_length()))
    if m == 1:
        bm, warps, stages, target = 1, 4, 2, 512
    elif m <= 16:
        bm, bn, warps, stages, target = 16, min(bn, 64), 4, 3, 384
    elif m <= 64:
        bm, warps, stages, target = 64, 4, 3, 192
    else:
        bm, warps, stages, target = 128, 8, 3, 192 if m <= 256 else 0
    tiles = -(-m // bm) * -(-n // bn)
    iters = -(-k // 128)
    split = max(1, min(target // tiles, iters // 2))
    return W4A16Config(bm, bn, 128, split, warps, stages)
