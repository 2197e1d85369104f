"""A bias-free linear layer whose output rows go to scattered rows of a table, in one launch:

    out[slots[t]] = x[t] @ weight^T        (slots[t] = -1: the table's last row, its dump row)

EAGLE-3's feature store: every target forward stores fc(the target's three residual streams) at the
cache slots of the rows it computed. As two kernels (cuBLAS's GEMM, then index_put) they were the
1.1-1.3% a decode step of an engine holding a dormant EAGLE-3 draft paid on the H100
(benchmarks/dormant_cost.py: 7 µs of a 930 µs step at batch 8, the only two kernels its decode graph
has more than a draft-less engine's).

Kernel: grid (cdiv(N, BLOCK_N), cdiv(T, BLOCK_M)); each program accumulates a [BLOCK_M, BLOCK_N]
tile over K in float32 (tl.dot), then writes its rows at their slots. A decode step's T (the batch)
is small, so BLOCK_N is small too (16 at T <= 16: 36 programs over SmolLM2's 576 columns) to keep
the weight's read spread over the SMs. Timed on the H100 (thirty-third session) it took 7.3 µs at
batch 8, no less than the two kernels it replaces: 36 programs, each walking K = 1728 alone, do not
fill 132 SMs. The runtime keeps it opt-in (OPTLLM_FUSED_STORE=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import CompiledLaunch, int_kind, use_triton
from .paged_attention import compute_dot_f32


@triton.jit(do_not_specialize=["T", "DUMP"])
def _fc_scatter_kernel(x_ptr, w_ptr, slot_ptr, out_ptr, T, DUMP, stride_x, stride_w, stride_o,
                       N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm = rm < T
    nm = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        km = kk < K
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + kk[None, :], mask=mm[:, None] & km[None, :],
                    other=0.0)
        b = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_w + kk[:, None], mask=km[:, None] & nm[None, :],
                    other=0.0)
        if DOT_F32:  # (fp32 operands: exact products of 16-bit values, and what the interpreter needs)
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    slot = tl.load(slot_ptr + rm, mask=mm, other=0).to(tl.int64)
    row = tl.where(slot < 0, DUMP, slot)
    tl.store(out_ptr + row[:, None] * stride_o + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mm[:, None] & nm[None, :])


_FC_SCATTER = CompiledLaunch(_fc_scatter_kernel, pointers=4, runtime=True)


def fc_scatter_tiles(t: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for T rows."""
    if t <= 16:
        return 16, 16, 128, 2
    if t <= 64:
        return 64, 32, 64, 4
    return 64, 64, 64, 4


def fc_scatter_ref(x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """torch: the GEMM in x's dtype, then the scatter (slot -1: the last row)."""
    out[slots] = (x @ weight.t()).to(out.dtype)
    return out


def fc_scatter(x: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
               backend: str = "auto") -> torch.Tensor:
    """out[slots[t]] = x[t] @ weight^T for x [T, K], weight [N, K] (x's dtype, unit last stride),
    slots int32 / int64 [T] (-1: out's last row), out [S + 1, N] (unit last stride); returns out.
    No host sync on the Triton path (CUDA-graph safe)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.dtype != x.dtype \
            or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x [T, K] and weight [N, K]: one dtype, unit last stride; got x {x.dtype} "
                         f"{tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}")
    if slots.shape != (x.shape[0],) or slots.dtype not in (torch.int32, torch.int64) or not slots.is_contiguous():
        raise ValueError(f"slots: must be a contiguous int32 / int64 [{x.shape[0]}] tensor, got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    if out.dim() != 2 or out.shape[1] != weight.shape[0] or out.stride(1) != 1:
        raise ValueError(f"out: must be [S + 1, {weight.shape[0]}] with unit last stride, got {tuple(out.shape)}")
    if not use_triton(backend, x):
        return fc_scatter_ref(x, weight, slots, out)
    t, (n, k) = x.shape[0], weight.shape
    if t == 0:
        return out
    bm, bn, bk, warps = fc_scatter_tiles(t)
    constexprs = dict(N=n, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=compute_dot_f32(x))
    ints = (x.stride(0), weight.stride(0), out.stride(0))
    dump = out.shape[0] - 1
    key = (x.dtype, slots.dtype, out.dtype, ints, int_kind(t), int_kind(dump), tuple(constexprs.values()), warps)
    _FC_SCATTER(key, (-(-n // bn), -(-t // bm), 1),
                (x, weight, slots, out, t, dump, *ints), constexprs, dict(num_warps=warps, num_stages=3))
    return out
