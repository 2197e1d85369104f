"""SiLU-and-multiply, the gated MLP's activation: x [..., 2I] -> silu(x[..., :I]) * x[..., I:].

Numerics as HF's LlamaMLP (act_fn(gate) * up on x.dtype tensors): silu in float32 as torch
computes it, g / (1 + exp(-g)), rounded to x.dtype; then the product, rounded once (a product
of two 16-bit floats is exact in float32, so that is x.dtype's multiply).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import CompiledLaunch, pow2, use_triton

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr):
    """grid (rows, cdiv(inter, BLOCK)); x rows are [gate | up], each ``inter`` wide; out is
    contiguous [rows, inter]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    src = x_ptr + row * stride_x + cols
    g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(src + inter, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dtype)
    tl.store(out_ptr + row * inter + cols, (s.to(tl.float32) * u.to(tl.float32)).to(dtype), mask=mask)


_SILU = CompiledLaunch(_silu_and_mul_kernel, pointers=2, runtime=True)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """HF's act_fn(gate) * up on x [..., 2I] -> [..., I] in x.dtype."""
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


def silu_and_mul(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """x [..., 2I] (gate | up; last dim unit-stride, rows any stride) -> silu(gate) * up,
    a new contiguous [..., I] tensor in x.dtype (bf16/fp16/fp32).

    backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch".
    """
    if x.dim() == 0 or x.dtype not in DTYPES or x.shape[-1] % 2:
        raise ValueError(f"x: must be a bf16/fp16/fp32 tensor [..., 2I], got {x.dtype} {tuple(x.shape)}")
    if not use_triton(backend, x):
        return silu_and_mul_ref(x)
    if x.stride(-1) != 1:
        raise ValueError(f"x: the last dim must have unit stride, got strides {tuple(x.stride())}")
    i = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], i), device=x.device, dtype=x.dtype)
    x2 = x.reshape(-1, x.shape[-1])  # a view for 2-D x and whenever the leading dims merge
    rows = x2.shape[0]
    if rows == 0 or i == 0:
        return out
    # few rows (decode): smaller blocks, so more programs share the work
    block = min(pow2(i), 1024 if rows >= 64 else 256)
    warps = 4 if block >= 512 else 2
    _SILU((x2.dtype, i, x2.stride(0), block, warps), (rows, -(-i // block), 1), (x2, out, i, x2.stride(0)),
          dict(BLOCK=block), dict(num_warps=warps))
    return out
