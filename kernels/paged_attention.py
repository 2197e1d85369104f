"""Paged KV cache: writing new K/V into it (``store_kv_cache``) and decode attention over it
(``paged_decode_attention``, flash-decoding). The prefill / tree-verification kernel over the
same cache is kernels/extend_attention.py; it shares the tile helpers and checks below.

Layout (one layer)
    ``k_cache``, ``v_cache``: [num_blocks, num_kv_heads, BLOCK_SIZE, head_dim], bf16/fp16/fp32
    or float8_e4m3fn; BLOCK_SIZE a power of two. fp8 caches carry ``k_scale``, ``v_scale``:
    float32 [num_blocks, num_kv_heads, BLOCK_SIZE], one scale per (token, head): dynamic,
    scale = max(amax|row| / 448, SCALE_EPS), or static, the head's calibrated scale (a
    checkpoint's kv_cache_scheme; per tensor: the same for every head) written beside each row
    so the attention kernels read both alike; stored = RN_e4m3(clamp(row / scale, +-448))
    (saturating: a row past the calibrated range clips, never NaN), dequantized = stored * scale.
    Token slot = block_id * BLOCK_SIZE + offset; token j of sequence b lives in block
    block_tables[b, j // BLOCK_SIZE] at offset j % BLOCK_SIZE.
    Table entries past a sequence's blocks are never read.
Attention tiles
    Keys are gathered per token (block id from the table, then the row), so a key tile of
    BLOCK_N tokens spans BLOCK_N / BLOCK_SIZE pages and tiles need not align to pages. Softmax
    is online in base 2 with fp32 (max, sum, acc); q.k and p.v run on tl.dot in q's dtype with
    fp32 accumulation (fp32 q, and the CPU interpreter: ieee fp32 dots). fp8 keys enter the
    dot as their E4M3 values (exact in bf16/fp16) and their scales multiply the score
    columns afterwards; fp8 value scales multiply the columns of p (fp16 q: the V tile).
Decode (flash-decoding)
    grid (B, num_kv_heads, num_splits). A program holds the G = num_q_heads / num_kv_heads
    query heads of its kv head as the rows of one tile (padded to >= 16 for tl.dot), so each
    key is loaded once per kv head. The sequence's blocks (those inside the sliding window,
    if any) are cut into num_splits contiguous runs of per = cdiv(blocks, num_splits) inside
    the kernel, from seq_lens: launch arguments depend on shapes only, no host sync, so the
    call can be captured in a CUDA graph and replayed with new seq_lens / block_tables.
    Each split writes a partial (max, sum, acc) into an fp32 workspace (an empty split
    writes -inf, 0, 0) and a second kernel merges them; one split writes the output
    directly. A sequence with seq_len 0 gets zeros.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import interpreting, use_triton
from .fp8 import _to_e4m3
from .scaled_mm import SCALE_EPS, div_rn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = 1.4426950408889634
_SM_COUNTS: dict = {}


# --------------------------------------------------------------------------- checks
def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")
    return value


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: Optional[torch.Tensor],
                v_scale: Optional[torch.Tensor]) -> tuple[int, int, int, bool]:
    """Validate a layer's caches; returns (num_kv_heads, block_size, head_dim, is_fp8)."""
    if k_cache.dim() != 4 or k_cache.dtype not in CACHE_DTYPES:
        raise ValueError("k_cache: must be a 4-D [num_blocks, num_kv_heads, block_size, head_dim] "
                         f"tensor of {CACHE_DTYPES}, got {k_cache.dtype} {tuple(k_cache.shape)}")
    if (v_cache.shape, v_cache.dtype, v_cache.stride(), v_cache.device) != \
            (k_cache.shape, k_cache.dtype, k_cache.stride(), k_cache.device):
        raise ValueError(f"v_cache: must match k_cache ({k_cache.dtype} {tuple(k_cache.shape)}, strides "
                         f"{k_cache.stride()}), got {v_cache.dtype} {tuple(v_cache.shape)}, strides {v_cache.stride()}")
    _, h, bs, d = k_cache.shape
    if bs & (bs - 1) or k_cache.stride(3) != 1:
        raise ValueError(f"k_cache: block_size (dim 2) must be a power of two and head_dim unit-stride, got "
                         f"{bs}, strides {k_cache.stride()}")
    fp8 = k_cache.dtype == FP8_DTYPE
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not fp8 and s is not None:
            raise ValueError(f"{name}: only float8_e4m3fn caches take scales, cache is {k_cache.dtype}")
        if fp8 and (s is None or s.dtype != torch.float32 or s.shape != k_cache.shape[:3]
                    or s.stride(2) != 1 or s.device != k_cache.device
                    or (k_scale is not None and s.stride() != k_scale.stride())):
            raise ValueError(f"{name}: an fp8 cache needs a float32 [num_blocks, num_kv_heads, block_size] = "
                             f"{tuple(k_cache.shape[:3])} scale cache with unit stride along block_size, got "
                             f"{None if s is None else (s.dtype, tuple(s.shape))}")
    return h, bs, d, fp8


def check_scale(scale) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale: must be a positive float (e.g. head_dim ** -0.5), got {scale!r}")
    return float(scale)


def check_q(q: torch.Tensor, num_kv_heads: int, head_dim: int, device: torch.device) -> int:
    """Validate q [N, num_q_heads, head_dim]; returns G = num_q_heads // num_kv_heads."""
    if q.dim() != 3 or q.dtype not in Q_DTYPES or q.shape[2] != head_dim or q.device != device:
        raise ValueError(f"q: must be a 3-D [tokens, num_q_heads, head_dim={head_dim}] tensor of "
                         f"{Q_DTYPES} on {device}, got {q.dtype} {tuple(q.shape)} on {q.device}")
    if q.shape[1] == 0 or q.shape[1] % num_kv_heads:
        raise ValueError(f"q: num_q_heads must be a positive multiple of num_kv_heads={num_kv_heads}, "
                         f"got {q.shape[1]}")
    return q.shape[1] // num_kv_heads


def check_index(name: str, t: torch.Tensor, dim: int, dtype: torch.dtype, device: torch.device,
                rows: Optional[int] = None) -> None:
    if t.dim() != dim or t.dtype != dtype or t.device != device or t.stride(-1) != 1 \
            or (rows is not None and t.shape[0] != rows):
        want = f"[{'' if rows is None else rows}{', ...' if dim == 2 else ''}]"
        raise ValueError(f"{name}: must be a {dim}-D {dtype} tensor {want} on {device} with unit last stride, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")


def check_out(out: Optional[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if (out.shape, out.dtype, out.device, out.stride(2)) != (q.shape, q.dtype, q.device, 1):
        raise ValueError(f"out: must be a {q.dtype} {tuple(q.shape)} tensor on {q.device} with unit stride along "
                         f"head_dim, got {out.dtype} {tuple(out.shape)}")
    return out


def compute_dot_f32(q: torch.Tensor) -> bool:
    # fp32 q needs ieee dots (tf32 would lose 10 bits); the interpreter multiplies bf16 as raw
    # uint16, so it gets fp32 operands too (the products of 16-bit values are exact in fp32)
    return q.dtype == torch.float32 or interpreting()


# --------------------------------------------------------------------------- references
def gather_kv(cache: torch.Tensor, scale: Optional[torch.Tensor], blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens in ``blocks`` (a table row) as float32 [n, num_kv_heads, head_dim]."""
    bs = cache.shape[2]
    ids = blocks[: -(-n // bs)].long()
    x = cache[ids].float()
    if scale is not None:
        x = x * scale[ids].unsqueeze(-1)
    return x.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:n]


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """float32 softmax attention: q [L, Hq, D], k/v [n, Hkv, D], visible bool [L, n];
    rows that see no key give zeros."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (torch.einsum("lhd,nhd->hln", q.float(), k) * scale).masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hln,nhd->lhd", p, v)


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, *, k_scale=None, v_scale=None,
                               sliding_window: int = 0) -> torch.Tensor:
    """float32 [B, Hq, D] from the gathered pages (loops over sequences; syncs)."""
    out = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    for b, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        k = gather_kv(k_cache, k_scale, block_tables[b], n)
        v = gather_kv(v_cache, v_scale, block_tables[b], n)
        j = torch.arange(n, device=q.device)
        vis = (n - 1 - j < sliding_window) if sliding_window > 0 else torch.ones_like(j, dtype=torch.bool)
        out[b] = attention_ref(q[b:b + 1], k, v, vis[None, :], scale)[0]
    return out


# --------------------------------------------------------------------------- store
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, sk_ptr, sv_ptr, slot_ptr, H, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_cb, stride_ch, stride_ct, stride_sb, stride_sh, D: tl.constexpr,
                     BS: tl.constexpr, FP8: tl.constexpr, STATIC: tl.constexpr, EPS: tl.constexpr,
                     INTERPRET: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid (T, head tiles): token t's heads [BLOCK_H, BLOCK_D] into its slot. STATIC: the fp8
    scales are the heads' calibrated ones (sk_ptr, sv_ptr: float32 [H]), not the rows' amax."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk, off = slot // BS, slot % BS
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m2 = (offs_h < H)[:, None] & (offs_d < D)[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=m2, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=m2, other=0.0)
    dst = blk * stride_cb + offs_h[:, None] * stride_ch + off * stride_ct + offs_d[None, :]
    if FP8:
        k, v = k.to(tl.float32), v.to(tl.float32)
        if STATIC:
            k_s = tl.load(sk_ptr + offs_h, mask=offs_h < H, other=1.0)
            v_s = tl.load(sv_ptr + offs_h, mask=offs_h < H, other=1.0)
        else:
            k_s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(k), axis=1), 448.0), EPS)
            v_s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=1), 448.0), EPS)
        k_inv, v_inv = tl.math.div_rn(1.0, k_s), tl.math.div_rn(1.0, v_s)
        tl.store(kc_ptr + dst, _to_e4m3(div_rn(k, k_s[:, None], k_inv[:, None], INTERPRET), INTERPRET), mask=m2)
        tl.store(vc_ptr + dst, _to_e4m3(div_rn(v, v_s[:, None], v_inv[:, None], INTERPRET), INTERPRET), mask=m2)
        s_dst = blk * stride_sb + offs_h * stride_sh + off
        tl.store(ks_ptr + s_dst, k_s, mask=offs_h < H)
        tl.store(vs_ptr + s_dst, v_s, mask=offs_h < H)
    else:
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m2)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m2)


def quantize_kv_ref(x: torch.Tensor, static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., num_kv_heads, head_dim] -> (float8_e4m3fn values, float32 scales [..., num_kv_heads])
    as the cache stores them: dynamic per (token, head), or static_scale (float32 [num_kv_heads])."""
    x = x.float()
    if static_scale is None:
        amax = x.abs().amax(dim=-1)
        # a tensor divisor: CUDA torch turns division by a Python scalar into a reciprocal multiply
        s = (amax / torch.full_like(amax, FP8_MAX)).clamp_min(SCALE_EPS)
    else:
        s = static_scale.float().expand(x.shape[:-1])
    return (x / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def store_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, static_k_scale=None,
                       static_v_scale=None) -> None:
    """In-place torch version of ``store_kv_cache``."""
    keep = slot_mapping >= 0
    blk, off = slot_mapping[keep] // k_cache.shape[2], slot_mapping[keep] % k_cache.shape[2]
    for x, cache, sc, static in ((k[keep], k_cache, k_scale, static_k_scale),
                                 (v[keep], v_cache, v_scale, static_v_scale)):
        if sc is None:
            cache[blk, :, off] = x.to(cache.dtype)
        else:
            cache[blk, :, off], sc[blk, :, off] = quantize_kv_ref(x, static)


def check_static_scales(static_k_scale: Optional[torch.Tensor], static_v_scale: Optional[torch.Tensor],
                        num_kv_heads: int, fp8: bool, device: torch.device) -> bool:
    """Validate the calibrated per-head scales of an fp8 cache (both or neither); True when given."""
    if static_k_scale is None and static_v_scale is None:
        return False
    if not fp8:
        raise ValueError("static_k_scale / static_v_scale: only float8_e4m3fn caches take static scales")
    for name, s in (("static_k_scale", static_k_scale), ("static_v_scale", static_v_scale)):
        if s is None or s.dtype != torch.float32 or tuple(s.shape) != (num_kv_heads,) or s.stride(0) != 1 \
                or s.device != device:
            raise ValueError(f"{name}: must be a contiguous float32 [{num_kv_heads}] tensor on {device} (both static "
                             f"scales or neither), got {None if s is None else (s.dtype, tuple(s.shape), s.device)}")
    return True


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
                   v_scale: Optional[torch.Tensor] = None, backend: str = "auto", *,
                   static_k_scale: Optional[torch.Tensor] = None,
                   static_v_scale: Optional[torch.Tensor] = None) -> None:
    """Write k, v [T, num_kv_heads, head_dim] (any strides along T and heads) into the caches at
    ``slot_mapping`` (int64 [T], slot = block * block_size + offset; negative: skip the token).
    fp8 caches quantize per (token, head) and write the scales into k_scale / v_scale: each
    row's own amax / 448, or with static_k_scale / static_v_scale (float32 [num_kv_heads], > 0:
    calibrated scales, a per-tensor one repeated per head) those, saturating at +-448."""
    h, bs, d, fp8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    static = check_static_scales(static_k_scale, static_v_scale, h, fp8, k_cache.device)
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or tuple(x.shape[1:]) != (h, d) or not x.is_floating_point() \
                or x.device != k_cache.device or x.shape[0] != k.shape[0]:
            raise ValueError(f"{name}: must be a float [T, {h}, {d}] tensor on {k_cache.device}, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
    check_index("slot_mapping", slot_mapping, 1, torch.int64, k_cache.device, k.shape[0])
    if not use_triton(backend, k_cache):
        return store_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, static_k_scale,
                                  static_v_scale)
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    if k.shape[0] == 0:
        return None
    block_d = max(16, triton.next_power_of_2(d))
    block_h = min(triton.next_power_of_2(h), max(1, 4096 // block_d))
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)
    sk, sv = (static_k_scale, static_v_scale) if static else (ks, vs)  # unread placeholders when dynamic
    _store_kv_kernel[(k.shape[0], triton.cdiv(h, block_h))](
        k, v, k_cache, v_cache, ks, vs, sk, sv, slot_mapping, h, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], ks.stride(0), ks.stride(1), D=d, BS=bs, FP8=fp8, STATIC=static, EPS=SCALE_EPS,
        INTERPRET=interpreting(), BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return None


# --------------------------------------------------------------------------- shared tiles
@triton.jit
def kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, keys, key_ok, kvh, stride_cb, stride_ch, stride_ct, stride_sb,
            stride_sh, offs_d, d_mask, BS: tl.constexpr, FP8: tl.constexpr):
    """Gather keys (token indices [BLOCK_N], key_ok masks them) of kv head kvh through the
    table row: K, V [BLOCK_N, BLOCK_D] as stored, and their fp8 scales [BLOCK_N] (when FP8)."""
    blk = tl.load(bt_row + keys // BS, mask=key_ok, other=0).to(tl.int64)
    off = keys % BS
    rows = blk * stride_cb + kvh * stride_ch + off * stride_ct
    m2 = key_ok[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0.0)
    v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=m2, other=0.0)
    if FP8:
        s_rows = blk * stride_sb + kvh * stride_sh + off
        k_s = tl.load(ks_ptr + s_rows, mask=key_ok, other=0.0)
        v_s = tl.load(vs_ptr + s_rows, mask=key_ok, other=0.0)
    else:  # unused placeholders
        k_s = off.to(tl.float32)
        v_s = k_s
    return k, v, k_s, v_s


@triton.jit
def attend_tile(q, k, v, k_s, v_s, visible, m_i, l_i, acc, qk_scale, FP8: tl.constexpr, DOT_F32: tl.constexpr):
    """One key tile of the base-2 online softmax for the rows of q [M, BLOCK_D] (q's dtype is
    the dot dtype; qk_scale = softmax scale * log2 e). visible [M, BLOCK_N]. A row that has seen
    no visible key keeps m = -inf and contributes nothing (no NaN). fp8 V scales multiply the
    columns of p ([M, BLOCK_N], cheaper than the V tile), except with fp16 q, where p * scale
    could fall below fp16's normal range: there V is dequantized into fp16 instead."""
    if DOT_F32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    if FP8:
        s = s * (k_s * qk_scale)[None, :]
    else:
        s = s * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP8:
        if q.dtype == tl.float16:
            v = v.to(tl.float32) * v_s[:, None]
        else:
            p = p * v_s[None, :]
    if DOT_F32:
        acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
    return m_new, l_i, acc


# --------------------------------------------------------------------------- decode
# sizes that change from step to step are not specialized on (== 1, % 16): no compile mid-serving
@triton.jit(do_not_specialize=["window", "stride_bt"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, sl_ptr, out_ptr, wm_ptr, wl_ptr, wacc_ptr, qk_scale,
                   window, stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_ch, stride_ct, stride_sb,
                   stride_sh, stride_bt, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, FP8: tl.constexpr,
                   SLIDING: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """grid (B, num_kv_heads, num_splits); see the module docstring."""
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(sl_ptr + b)
    win_lo = 0
    if SLIDING:
        win_lo = tl.maximum(seq_len - window, 0)
    blk_lo = win_lo // BS
    per = tl.cdiv(tl.cdiv(seq_len, BS) - blk_lo, num_splits)
    tok_lo = tl.maximum((blk_lo + split * per) * BS, win_lo)
    tok_hi = tl.minimum((blk_lo + split * per + per) * BS, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(tok_lo, tok_hi, BLOCK_N):
        keys = n0 + offs_n
        key_ok = keys < tok_hi
        k, v, k_s, v_s = kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, keys, key_ok, kvh, stride_cb, stride_ch,
                                 stride_ct, stride_sb, stride_sh, offs_d, d_mask, BS, FP8)
        m_i, l_i, acc = attend_tile(q, k, v, k_s, v_s, key_ok[None, :], m_i, l_i, acc, qk_scale, FP8, DOT_F32)
    if SPLIT:
        row = (b * tl.num_programs(1) * G + heads).to(tl.int64) * num_splits + split
        tl.store(wm_ptr + row, m_i, mask=g_ok)
        tl.store(wl_ptr + row, l_i, mask=g_ok)
        tl.store(wacc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_mask[None, :])
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["end_at"])
def _combine_kernel(wm_ptr, wl_ptr, wacc_ptr, out_ptr, end_ptr, end_at, num_splits, stride_ob, stride_oh,
                    D: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """grid (rows, num_q_heads): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s. A row is a
    sequence (decode) or a new token (extend attention, BOUNDED: rows from end_ptr[end_at] on, the
    padding past the last sequence, are not written)."""
    b, h = tl.program_id(0), tl.program_id(1)
    if BOUNDED:
        if b >= tl.load(end_ptr + end_at):
            return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    row = (b * tl.num_programs(1) + h).to(tl.int64) * num_splits
    m = tl.load(wm_ptr + row + offs_s, mask=s_ok, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    l_tot = tl.sum(w * tl.load(wl_ptr + row + offs_s, mask=s_ok, other=0.0), axis=0)
    acc = tl.load(wacc_ptr + (row + offs_s)[:, None] * D + offs_d[None, :],
                  mask=s_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_tot == 0.0, 1.0, l_tot)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


def decode_block_n(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Keys per tile: about 16 KiB of K per tile (H200, triton 3.6, 32 q / 8 kv heads, d 128,
    B 64 x 4096 keys: bf16 64 keys 249 us, 32: 278, 128: 293; fp8 128 keys 258 us, 64: 347)."""
    size = torch.empty((), dtype=cache_dtype).element_size()
    per_tile = 16384 // (max(16, triton.next_power_of_2(head_dim)) * size)
    return max(16, min(per_tile, 128 if cache_dtype == FP8_DTYPE else 64))


def sm_count(device: torch.device) -> int:
    """The device's SMs (looked up once a device): the split rules' grid size. Off CUDA 1: the
    interpreter runs one program at a time, so splits buy it nothing and cost it their combine (the
    kernel tests cover the split paths with explicit num_splits)."""
    if device.type != "cuda":
        return 1
    sms = _SM_COUNTS.get(device.index)
    if sms is None:
        sms = _SM_COUNTS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return sms


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                       block_n: int, sms: int) -> int:
    """Splits from shapes only: enough programs to fill the sms SMs twice, no more splits than
    key tiles in the longest sequence a table row can describe, at most 64."""
    want = -(-2 * sms // max(1, batch * num_kv_heads))
    tiles = -(-max_blocks * block_size // block_n)
    return max(1, min(want, tiles, 64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, *, k_scale: Optional[torch.Tensor] = None,
                           v_scale: Optional[torch.Tensor] = None, sliding_window: int = 0,
                           num_splits: Optional[int] = None, out: Optional[torch.Tensor] = None,
                           backend: str = "auto") -> torch.Tensor:
    """Attention of one new token per sequence over its paged keys.

    q [B, num_q_heads, head_dim] bf16/fp16/fp32 (any strides along B and heads); caches as in
    the module docstring; block_tables int32 [B, max_blocks]; seq_lens int32 [B] keys per
    sequence, the new token's included; scale: softmax scale (e.g. head_dim ** -0.5);
    sliding_window > 0: key j visible iff seq_len - 1 - j < sliding_window; num_splits: None
    picks one from the shapes. Returns out [B, num_q_heads, head_dim] in q's dtype.
    The Triton path never syncs with the host and its launches depend on shapes only.
    """
    h, bs, d, fp8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    dev = k_cache.device
    g = check_q(q, h, d, dev)
    bsz = q.shape[0]
    check_index("block_tables", block_tables, 2, torch.int32, dev, bsz)
    check_index("seq_lens", seq_lens, 1, torch.int32, dev, bsz)
    scale = check_scale(scale)
    _int("sliding_window", sliding_window, 0)
    if num_splits is not None:
        _int("num_splits", num_splits, 1)
    out = check_out(out, q)
    if not use_triton(backend, q):
        out.copy_(paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=k_scale,
                                             v_scale=v_scale, sliding_window=sliding_window))
        return out
    if bsz == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    block_n = decode_block_n(d, k_cache.dtype)
    splits = num_splits or default_num_splits(bsz, h, block_tables.shape[1], bs, block_n, sm_count(dev))
    block_d = max(16, triton.next_power_of_2(d))
    hq = q.shape[1]
    if splits > 1:
        wm = torch.empty((bsz, hq, splits), device=dev, dtype=torch.float32)
        wl = torch.empty_like(wm)
        wacc = torch.empty((bsz, hq, splits, d), device=dev, dtype=torch.float32)
    else:
        wm = wl = wacc = out
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)
    _decode_kernel[(bsz, h, splits)](
        q, k_cache, v_cache, ks, vs, block_tables, seq_lens, out, wm, wl, wacc, scale * LOG2E, sliding_window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], ks.stride(0), ks.stride(1),
        block_tables.stride(0), G=g, D=d, BS=bs, FP8=fp8, SLIDING=sliding_window > 0, SPLIT=splits > 1,
        DOT_F32=compute_dot_f32(q), BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=4, num_stages=2)
    if splits > 1:
        _combine_kernel[(bsz, hq)](wm, wl, wacc, out, wm, 0, splits, out.stride(0), out.stride(1), D=d, BOUNDED=False,
                                   BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4)
    return out
