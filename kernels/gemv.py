"""Dense GEMV for decode: y [1, N] = x [1, K] @ W[N, K]^T (+ b), bf16 / fp16 weights.

At batch 1 a decode step is a chain of matrix-vector products that only have to stream each
weight once; cuBLAS reaches 49-87% of the memory floor on the Llama-3-8B shapes at M = 1
(docs/BENCHMARKS.md), which caps bf16 decode below 85% of the roofline. This kernel is the
plain streaming form: program p owns BLOCK_N output rows and walks K in BLOCK_K steps with
16-byte loads along K, products and sums in fp32, one store per row; no split-K (every shape
of interest has N / BLOCK_N >= 2 x the SM count), so no workspace, no second launch, no
atomics: deterministic and CUDA-graph safe.

It is used only for the (N, K) shapes in GEMV_CONFIGS (a table a tuning run on the GPU fills:
benchmarks/tune_gemv.py); every other call stays on cuBLAS.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import use_triton

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v}: allowed a power of two")


# (N, K) -> config, from benchmarks/tune_gemv.py on the H200 (2026-12-02, CUDA-graph replay, cold
# weights): shapes where the GEMV beats cuBLAS at M = 1 by > 3% (Llama-3-8B qkv 1.07x, o 1.30x,
# down 1.09x, LM head 1.05x; gate_up stays on cuBLAS, which reaches 98% of the floor there).
_MEASURED: dict = {
    (6144, 4096): GemvConfig(4, 256, 2, 3),
    (4096, 4096): GemvConfig(8, 512, 4, 3),
    (4096, 14336): GemvConfig(8, 512, 4, 3),
    (128256, 4096): GemvConfig(4, 256, 2, 3),
}


def _table_from_env() -> dict:
    """OPTLLM_GEMV_TABLE=FILE (the gemv_configs.json tune_gemv.py writes: {"N,K": [block_n,
    block_k, num_warps, num_stages]}) adds to the table, read once at import: a tuning run
    measures its configs end to end before they are pasted above."""
    path = os.environ.get("OPTLLM_GEMV_TABLE")
    if not path:
        return {}
    with open(path) as f:
        raw = json.load(f)
    return {tuple(int(v) for v in key.split(",")): GemvConfig(*cfg) for key, cfg in raw.items()}


GEMV_CONFIGS: MappingProxyType = MappingProxyType({**_MEASURED, **_table_from_env()})


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 reference: x [1, K], w [N, K] -> [1, N] in x.dtype."""
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
         config: Optional[GemvConfig] = None, backend: str = "auto") -> torch.Tensor:
    """y = x @ w^T + bias for one row: x [1, K] (unit stride along K), w [N, K] contiguous rows,
    bias [N] or None; all one dtype (bf16 / fp16 / fp32). Returns [1, N] in x.dtype."""
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in DTYPES or x.stride(1) != 1:
        raise ValueError(f"x: must be a bf16/fp16/fp32 [1, K] tensor with unit stride, got {x.dtype} "
                         f"{tuple(x.shape)}")
    n, k = w.shape
    if x.shape[1] != k or w.dtype != x.dtype or w.stride(1) != 1:
        raise ValueError(f"w: must be {x.dtype} [N, {x.shape[1]}] with unit stride along K, got {w.dtype} "
                         f"{tuple(w.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias: must be {x.dtype} of shape ({n},), got {bias.dtype} {tuple(bias.shape)}")
    if not use_triton(backend, x):
        return gemv_ref(x, w, bias)
    cfg = config or GEMV_CONFIGS.get((n, k)) or GemvConfig()
    y = torch.empty((1, n), device=x.device, dtype=x.dtype)
    _gemv_kernel[(-(-n // cfg.block_n),)](
        x, w, y if bias is None else bias, y, n, k, w.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, except one-row CUDA calls on shapes the tuning table lists run the GEMV."""
    if x.shape[0] == 1 and x.dim() == 2 and x.is_cuda and (w.shape[0], w.shape[1]) in GEMV_CONFIGS:
        return gemv(x, w, bias, backend="triton")
    return F.linear(x, w, bias)
