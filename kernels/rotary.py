"""Rotary position embedding, NeoX / HF-Llama style, in place on q and k.

For each head, with r = rotary_dim (<= head_dim), its first r dims split into halves
x1 = x[:r/2], x2 = x[r/2:r] that rotate together (HF's rotate_half):
    x1' = x1 * cos - x2 * sin,   x2' = x2 * cos + x1 * sin
with cos/sin of position p read from ``cos_sin_cache`` [max_position, r] float32, row p =
[cos(p * f_0) .. cos(p * f_{r/2-1}) | sin(p * f_0) .. sin(p * f_{r/2-1})]. Dims past r are left
as they are (partial rotary). Computed in float32 and rounded once to q's dtype; HF rounds
cos/sin and each product to the activation dtype instead, so in bf16 the two differ by about
one bf16 ulp.
q [T, num_heads * head_dim] and k [T, num_kv_heads * head_dim] may be row-strided views
(slices of the fused qkv output); one program rotates a block of heads of one token in both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import CompiledLaunch, pow2, use_triton

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rotate(base, cos, sin, heads, n_heads, d, HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """Rotate heads [BLOCK_H] (masked to < n_heads) of one token row starting at ``base``."""
    mask = (heads < n_heads)[:, None] & (d < HALF)[None, :]
    p1 = base + heads[:, None] * HEAD_DIM + d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = base.dtype.element_ty
    tl.store(p1, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _cos_sin(pos_ptr, cache_ptr, t, stride_c, d, HALF: tl.constexpr):
    """cos and sin [1, BLOCK_D] (float32, zero past HALF) of token t's position."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = cache_ptr + pos * stride_c + d
    cos = tl.load(c, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(c + HALF, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cache_ptr, stride_q, stride_k, stride_c, NQ, NK,
                   HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid (T, cdiv(max(NQ, NK), BLOCK_H)): token t, heads [pid1 * BLOCK_H, +BLOCK_H) of q and k."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, t, stride_c, d, HALF)
    _rotate(q_ptr + t * stride_q, cos, sin, heads, NQ, d, HEAD_DIM, HALF)
    _rotate(k_ptr + t * stride_k, cos, sin, heads, NK, d, HEAD_DIM, HALF)


def rotary_cos_sin(inv_freq: torch.Tensor, max_position: int,
                   attention_scaling: float = 1.0) -> torch.Tensor:
    """The cos/sin cache [max_position, rotary_dim] float32 of inv_freq [rotary_dim / 2]
    (the frequencies f_j, radians per position), on inv_freq's device: row p =
    [cos(p f) | sin(p f)] * attention_scaling, with p * f_j formed in float32 as HF does."""
    if inv_freq.dim() != 1 or not inv_freq.is_floating_point():
        raise ValueError(f"inv_freq: must be a 1-D float tensor, got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if not isinstance(max_position, int) or max_position < 1:
        raise ValueError(f"max_position: must be an integer >= 1, got {max_position!r}")
    t = torch.arange(max_position, device=inv_freq.device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_scaling


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place reference: rotated copies of q and k (float32 math, one rounding)."""
    r = cos_sin_cache.shape[1]
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, : r // 2], cs[:, None, r // 2:]

    def rot(x):
        xh = x.reshape(x.shape[0], -1, head_dim).float()
        x1, x2 = xh[..., : r // 2], xh[..., r // 2: r]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xh[..., r:]), dim=-1)
        return out.to(x.dtype).reshape(x.shape)

    return rot(q), rot(k)


def _check(positions, q, k, cos_sin_cache, head_dim):
    if q.dim() != 2 or q.dtype not in DTYPES or head_dim <= 0 or q.shape[1] % head_dim:
        raise ValueError(f"q: must be a bf16/fp16/fp32 [T, num_heads * head_dim] tensor with "
                         f"head_dim={head_dim}, got {q.dtype} {tuple(q.shape)}")
    if k.dim() != 2 or k.dtype != q.dtype or k.shape[0] != q.shape[0] or k.shape[1] % head_dim:
        raise ValueError(f"k: must be a {q.dtype} [{q.shape[0]}, num_kv_heads * {head_dim}] tensor, "
                         f"got {k.dtype} {tuple(k.shape)}")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions: must be int64 (or int32) of shape ({q.shape[0]},), got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    r = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 else -1
    if (r <= 0 or r % 2 or r > head_dim or not cos_sin_cache.is_floating_point()):
        raise ValueError(f"cos_sin_cache: must be a float [max_position, rotary_dim] tensor with an "
                         f"even rotary_dim <= head_dim={head_dim}, got {cos_sin_cache.dtype} "
                         f"{tuple(cos_sin_cache.shape)}")


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_dim: int,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, num_heads * head_dim] and k [T, num_kv_heads * head_dim] in place (views
    with unit stride along dim 1, any row stride) at positions [T] (int64; must lie in
    [0, max_position): not checked, that would sync) with cos_sin_cache [max_position,
    rotary_dim] float32 (see ``rotary_cos_sin``). Returns (q, k).

    backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch".
    """
    _check(positions, q, k, cos_sin_cache, head_dim)
    if not use_triton(backend, q):
        q_new, k_new = apply_rotary_ref(positions, q, k, cos_sin_cache, head_dim)
        q.copy_(q_new)
        k.copy_(k_new)
        return q, k
    if q.stride(1) != 1 or k.stride(1) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("q, k, cos_sin_cache: the last dim must have unit stride")
    T = q.shape[0]
    nq, nk = q.shape[1] // head_dim, k.shape[1] // head_dim
    heads = max(nq, nk)
    if T == 0 or heads == 0:
        return q, k
    half = cos_sin_cache.shape[1] // 2
    block_d = pow2(half)
    block_h = min(pow2(heads), max(1, 1024 // block_d))
    _rotary_kernel[(T, -(-heads // block_h))](
        positions, q, k, cos_sin_cache, q.stride(0), k.stride(0), cos_sin_cache.stride(0), nq, nk,
        HEAD_DIM=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 512 else 2)
    return q, k


# --------------------------------------------------------------------------- rotary + KV store
@triton.jit
def _rotary_store_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, kc_ptr, vc_ptr, slot_ptr, stride_q, stride_k,
                         stride_v, stride_c, stride_cb, stride_ch, stride_ct, NQ, NK, BS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """grid (T, head tiles): rotate token t's q heads in place, and write its rotated k heads
    and its v heads into their cache slot (skipped for slot < 0); k itself is left as it was."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, t, stride_c, d, HALF)
    _rotate(q_ptr + t * stride_q, cos, sin, heads, NQ, d, HEAD_DIM, HALF)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        mask = (heads < NK)[:, None] & (d < HALF)[None, :]
        src = k_ptr + t * stride_k + heads[:, None] * HEAD_DIM + d[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        dst = (slot // BS) * stride_cb + heads[:, None] * stride_ch + (slot % BS) * stride_ct + d[None, :]
        out = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + dst, (x1 * cos - x2 * sin).to(out), mask=mask)
        tl.store(kc_ptr + dst + HALF, (x2 * cos + x1 * sin).to(out), mask=mask)
        vsrc = v_ptr + t * stride_v + heads[:, None] * HEAD_DIM + d[None, :]
        tl.store(vc_ptr + dst, tl.load(vsrc, mask=mask, other=0.0).to(out), mask=mask)
        tl.store(vc_ptr + dst + HALF, tl.load(vsrc + HALF, mask=mask, other=0.0).to(out), mask=mask)


_ROTARY_STORE = CompiledLaunch(_rotary_store_kernel, pointers=8, runtime=True)


def fused_store_ok(head_dim: int, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """apply_rotary_and_store serves full rotary (rotary_dim == head_dim) into a bf16 / fp16 /
    fp32 cache; partial rotary and FP8 caches take the two separate kernels."""
    return cos_sin_cache.shape[-1] == head_dim and k_cache.dtype in DTYPES


def apply_rotary_and_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cos_sin_cache: torch.Tensor, head_dim: int, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """One kernel instead of rotary + store_kv_cache: q rotated in place (returned); the rotated
    k and v [T, num_kv_heads * head_dim] written to the paged caches [num_blocks, Hkv,
    block_size, head_dim] at slot_mapping (int64 [T], negative: skip), as
    kernels/paged_attention.store_kv_cache lays them out. k is not modified."""
    from .paged_attention import store_kv_cache_ref

    _check(positions, q, k, cos_sin_cache, head_dim)
    nk = k.shape[1] // head_dim
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v: must match k {k.dtype} {tuple(k.shape)}, got {v.dtype} {tuple(v.shape)}")
    if not fused_store_ok(head_dim, cos_sin_cache, k_cache) or k_cache.shape[1] != nk or \
            k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() \
            or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache / v_cache: must be [num_blocks, {nk}, block_size, {head_dim}] bf16/fp16/fp32 "
                         f"with full rotary; got {k_cache.dtype} {tuple(k_cache.shape)}")
    if slot_mapping.shape != (q.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping: must be int64 of shape ({q.shape[0]},)")
    if not use_triton(backend, q):
        q_new, k_new = apply_rotary_ref(positions, q, k, cos_sin_cache, head_dim)
        q.copy_(q_new)
        t = q.shape[0]
        store_kv_cache_ref(k_new.view(t, nk, head_dim), v.reshape(t, nk, head_dim), k_cache, v_cache, slot_mapping)
        return q
    if q.stride(1) != 1 or k.stride(1) != 1 or v.stride(1) != 1:
        raise ValueError("q, k, v: the last dim must have unit stride")
    T, nq = q.shape[0], q.shape[1] // head_dim
    heads = max(nq, nk)
    if T == 0:
        return q
    half = head_dim // 2
    block_d = pow2(half)
    block_h = min(pow2(heads), max(1, 1024 // block_d))
    ints = (q.stride(0), k.stride(0), v.stride(0), cos_sin_cache.stride(0), *k_cache.stride()[:3], nq, nk)
    warps = 4 if block_h * block_d >= 512 else 2
    key = (positions.dtype, q.dtype, k.dtype, v.dtype, cos_sin_cache.dtype, k_cache.dtype, v_cache.dtype, ints,
           k_cache.shape[2], head_dim, block_h, block_d, warps)
    _ROTARY_STORE(key, (T, -(-heads // block_h), 1),
                  (positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, *ints),
                  dict(BS=k_cache.shape[2], HEAD_DIM=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_D=block_d),
                  dict(num_warps=warps))
    return q
