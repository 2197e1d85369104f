"""RMSNorm, optionally fused with the residual add, with the numerics of HF's LlamaRMSNorm.

    h = x + residual                        (in x.dtype: that rounding is new_residual)
    out = weight * (h32 * rsqrt(mean(h32^2) + eps)).to(x.dtype)   h32 = h in float32

Rows are all leading dims of x [..., H]; each row is one program's (or, for small H, a few
rows share one program). The row addressing is two-level (outer, inner), so a
[T, heads, head_dim] view whose tokens are not contiguous with each other (Qwen3's per-head
q/k norm on a slice of the fused qkv output) is read in place; only the last dim must have
unit stride. Outputs are new contiguous tensors of x's shape, but for the fused add's
new_residual when the caller gives where it goes (``residual_out``: rows of any stride, e.g. a
column block of the EAGLE-3 aux buffer, which then costs no copy of its own).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import CompiledLaunch, int_kind, pow2, use_triton

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_H = 16384


@triton.jit
def _normed(v, w, H, eps, dtype: tl.constexpr):
    """Rows v float32 [R, BLOCK_H] (zeros past H) normed and scaled by w [BLOCK_H], in dtype, as
    HF's LlamaRMSNorm rounds: the normalised value to dtype, then its product with the weight (two
    16-bit floats multiply exactly in fp32: one rounding, as torch's bf16 multiply)."""
    rstd = tl.math.rsqrt(tl.sum(v * v, axis=1) / H + eps)
    normed = (v * rstd[:, None]).to(dtype)
    return (normed.to(tl.float32) * w.to(tl.float32)[None, :]).to(dtype)


# sizes that change from step to step are not specialized on (== 1, % 16): no compile mid-serving
@triton.jit(do_not_specialize=["R", "inner"])
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, R, H, inner,
                     sx_o, sx_i, sr_o, sr_i, s_ro, eps,
                     HAS_RES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """grid (cdiv(R, BLOCK_R),): rows [pid * BLOCK_R, +BLOCK_R); row r lives at
    (r // inner) * s_o + (r % inner) * s_i; out is contiguous [R, H], res_out [R, H] of row stride
    s_ro."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    mask = (rows < R)[:, None] & col_mask[None, :]
    outer = rows // inner
    in_row = rows % inner
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + (outer * sx_o + in_row * sx_i)[:, None] + cols[None, :], mask=mask, other=0.0)
    dst = rows[:, None] * H + cols[None, :]
    if HAS_RES:
        r = tl.load(r_ptr + (outer * sr_o + in_row * sr_i)[:, None] + cols[None, :], mask=mask, other=0.0)
        # one rounding of the exact-in-fp32-or-nearly sum: what torch's x + r does in x.dtype
        h = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + rows[:, None] * s_ro + cols[None, :], h, mask=mask)
        v = h.to(tl.float32)
    else:
        v = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
    tl.store(out_ptr + dst, _normed(v, w, H, eps, dtype), mask=mask)


_RMS = CompiledLaunch(_rms_norm_kernel, pointers=5, runtime=True)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None):
    """HF LlamaRMSNorm (after the decoder layer's residual add when residual is given):
    out [..., H] in x.dtype, or (out, x + residual) with residual."""
    h = x if residual is None else x + residual
    v = h.float()
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * v.to(x.dtype)
    return out if residual is None else (out, h)


def _rows(t: torch.Tensor, name: str):
    """t [..., H] as (t with <= 3 dims, rows per outer index, outer stride, inner stride)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must have unit stride, got strides {tuple(t.stride())}")
    if t.dim() > 3:
        t = t.reshape(-1, t.shape[-2], t.shape[-1])  # a view whenever the leading dims merge
    if t.dim() == 3:
        return t, t.shape[1], t.stride(0), t.stride(1)
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    return t, 1, 0, 0


def _launch(x, weight, eps, residual, residual_out=None):
    H = x.shape[-1]
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    res_out = residual_out if residual_out is not None else torch.empty_like(out) if residual is not None else out
    s_ro = res_out.stride(0) if residual_out is not None else H
    R = x.numel() // H
    if R == 0:
        return out, res_out
    x3, inner, sx_o, sx_i = _rows(x, "x")
    if residual is not None:
        residual, _, sr_o, sr_i = _rows(residual, "residual")  # x's shape: the same inner
    else:
        sr_o = sr_i = 0
    block_h = pow2(H)
    # small H: several rows per program, while keeping >= ~256 programs when R allows
    block_r = max(1, min(2048 // block_h, pow2(-(-R // 256))))
    num_warps = min(16, max(1, block_r * block_h // 256))
    r = x3 if residual is None else residual
    # the key: what Triton specializes on (R and inner are do_not_specialize: their width only)
    key = (x3.dtype, r.dtype, weight.dtype, H, sx_o, sx_i, sr_o, sr_i, s_ro, int_kind(R), int_kind(inner),
           residual is not None, block_r, block_h, num_warps)
    _RMS(key, (-(-R // block_r), 1, 1), (x3, r, weight, out, res_out, R, H, inner, sx_o, sx_i, sr_o, sr_i, s_ro,
                                         eps),
         dict(HAS_RES=residual is not None, BLOCK_R=block_r, BLOCK_H=block_h), dict(num_warps=num_warps))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None,
             backend: str = "auto", residual_out: Optional[torch.Tensor] = None,
             ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm of each row of x [..., H] (H <= 16384; last dim unit-stride, rows any
    strides that two levels describe, e.g. [T, heads, head_dim] views of a fused qkv).

    weight [H] in x.dtype; eps added to the mean square. With residual [..., H] (x's shape
    and dtype): returns (out, new_residual) where new_residual = x + residual in x.dtype and
    out is the norm of it, both contiguous; else returns out. Numerics as HF LlamaRMSNorm.
    residual_out (with residual; x 2-D [T, H]): a [T, H] view of x's dtype with unit last stride and
    any row stride that new_residual is written into and returned as.
    backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch".
    """
    if x.dim() == 0 or x.dtype not in DTYPES or not 0 < x.shape[-1] <= MAX_H:
        raise ValueError(f"x: must be a bf16/fp16/fp32 tensor [..., H] with 0 < H <= {MAX_H}, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],) or weight.dtype != x.dtype:
        raise ValueError(f"weight: must be {x.dtype} of shape ({x.shape[-1]},), got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual: must be {x.dtype} of shape {tuple(x.shape)}, got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    if residual_out is not None and (residual is None or x.dim() != 2 or residual_out.shape != x.shape
                                     or residual_out.dtype != x.dtype or residual_out.stride(-1) != 1):
        raise ValueError(f"residual_out: must come with a residual and be {x.dtype} [T, H] of x's shape "
                         f"{tuple(x.shape)} with unit last stride, got "
                         f"{None if residual_out is None else (residual_out.dtype, tuple(residual_out.shape))}")
    if not use_triton(backend, x):
        if residual_out is None:
            return rms_norm_ref(x, weight, eps, residual)
        out, h = rms_norm_ref(x, weight, eps, residual)
        return out, residual_out.copy_(h)
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    out, res_out = _launch(x, weight, eps, residual, residual_out)
    return out if residual is None else (out, res_out)


# ---------------------------------------------------------------- two norms side by side
@triton.jit(do_not_specialize=["T"])
def _norm_pair_kernel(a_ptr, ids_ptr, wa_ptr, b_ptr, wb_ptr, out_ptr, T, H, sa, sb, eps,
                      GATHER: tl.constexpr, BLOCK_H: tl.constexpr):
    """grid (T,): out[t, :H] = norm(a[ids[t]] (GATHER) or a[t]) * wa, out[t, H:] = norm(b[t]) * wb."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    dtype = out_ptr.dtype.element_ty
    if GATHER:
        src = tl.load(ids_ptr + t).to(tl.int64)
    else:
        src = t
    for half in tl.static_range(2):
        if half == 0:
            x = tl.load(a_ptr + src * sa + cols, mask=m, other=0.0).to(dtype)  # the row in out's dtype first
            w = tl.load(wa_ptr + cols, mask=m, other=0.0)
        else:
            x = tl.load(b_ptr + t * sb + cols, mask=m, other=0.0).to(dtype)
            w = tl.load(wb_ptr + cols, mask=m, other=0.0)
        y = _normed(x.to(tl.float32)[None, :], w, H, eps, dtype)
        tl.store(out_ptr + t * 2 * H + half * H + cols[None, :], y, mask=m[None, :])


_PAIR = CompiledLaunch(_norm_pair_kernel, pointers=6, runtime=True)


def rms_norm_pair_ref(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float,
                      ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch: cat([rms_norm(a[ids] in b's dtype, wa), rms_norm(b, wb)], -1)."""
    x = (a if ids is None else F.embedding(ids, a)).to(b.dtype)
    return torch.cat([rms_norm_ref(x, wa, eps), rms_norm_ref(b, wb, eps)], dim=-1)


def rms_norm_pair(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float,
                  ids: Optional[torch.Tensor] = None, backend: str = "auto") -> torch.Tensor:
    """[T, 2H] in b's dtype: the RMSNorm of a's rows (a [T, H]; with ids int [T]: a is a table [V, H]
    and its rows ids are read, as an embedding lookup, then cast to b's dtype) beside the RMSNorm of
    b [T, H], each with its weight (wa, wb: [H] in b's dtype). What EAGLE-3's draft layer feeds
    its attention (its normed input embedding and normed feature, concatenated): one launch for
    what was an embedding, two norms and a concatenation. Numerics as rms_norm."""
    if b.dim() != 2 or b.dtype not in DTYPES or not 0 < b.shape[1] <= MAX_H or b.stride(1) != 1:
        raise ValueError(f"b: must be a bf16/fp16/fp32 [T, H] tensor with 0 < H <= {MAX_H} and unit stride along H, "
                         f"got {b.dtype} {tuple(b.shape)}")
    t, h = b.shape
    rows = t if ids is None else a.shape[0]
    if a.dim() != 2 or a.shape != (rows, h) or a.dtype not in DTYPES or a.stride(1) != 1:
        raise ValueError(f"a: must be a float [{'V' if ids is not None else t}, {h}] tensor with unit stride along "
                         f"H, got {a.dtype} {tuple(a.shape)}")
    if ids is not None and (ids.shape != (t,) or ids.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"ids: must be int32/int64 [{t}], got {ids.dtype} {tuple(ids.shape)}")
    for name, w in (("wa", wa), ("wb", wb)):
        if w.shape != (h,) or w.dtype != b.dtype:
            raise ValueError(f"{name}: must be {b.dtype} of shape ({h},), got {w.dtype} {tuple(w.shape)}")
    if not use_triton(backend, b):
        return rms_norm_pair_ref(a, wa, b, wb, eps, ids)
    out = torch.empty(t, 2 * h, dtype=b.dtype, device=b.device)
    if t:
        ids_ = b if ids is None else (ids if ids.stride(0) == 1 else ids.contiguous())
        wa, wb = wa.contiguous(), wb.contiguous()
        block_h = pow2(h)
        warps = min(8, max(1, block_h // 256))
        ints = (t, h, a.stride(0), b.stride(0))
        key = (a.dtype, b.dtype, ids_.dtype, ids is not None, block_h, warps, h, a.stride(0), b.stride(0),
               int_kind(t))
        _PAIR(key, (t, 1, 1), (a, ids_, wa, b, wb, out, *ints, eps), dict(GATHER=ids is not None, BLOCK_H=block_h),
              dict(num_warps=warps))
    return out
