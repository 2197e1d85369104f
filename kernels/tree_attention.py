"""Tree attention for speculative verification: the draft tree's query tokens of B sequences
over their paged KV context plus the tree tokens themselves, under each tree's mask.

Layout: padded per sequence, for static shapes (a CUDA graph per batch size and tree size):
q [B, N, num_q_heads, head_dim]; sequence b has context_lens[b] cached keys and
tree_sizes[b] <= N tree nodes whose K/V are already in the cache at positions
context_lens[b] + i (tree order; kernels/paged_attention.py's cache layout and
``store_kv_cache``). Query i < tree_sizes[b] sees every context key j < context_lens[b], and
tree key context_lens[b] + j iff tree_mask[b, i, j] (the caller sets the diagonal); rows
i >= tree_sizes[b] see nothing and come out zero. No sliding window.

kernels/extend_attention.py's masked mode computes the same for ragged rows; this kernel is
its decode-shaped sibling: few queries per sequence over a long context, so the context is
cut into num_splits runs as in flash-decoding. Grid (B, num_kv_heads, query tiles * splits);
a program's BLOCK_M rows are (query, head) pairs of one kv head (GQA packed as in the extend
kernel); split s attends its run of context blocks, and the last split also the tree keys.
Splits write partial (max, sum, acc) to an fp32 workspace that paged_attention's combine
kernel merges; one split writes the output directly. Launch arguments depend on shapes only
(no host sync).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import use_triton
from .extend_attention import extend_tiles
from .paged_attention import (
    LOG2E,
    _combine_kernel,
    _int,
    attend_tile,
    attention_ref,
    check_cache,
    check_index,
    check_scale,
    compute_dot_f32,
    default_num_splits,
    gather_kv,
    kv_tile,
    sm_count,
)


@triton.jit
def _tree_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, ctx_ptr, size_ptr, mask_ptr, out_ptr,
                 wm_ptr, wl_ptr, wacc_ptr, qk_scale, N, num_splits,
                 stride_qb, stride_qn, stride_qh, stride_ob, stride_on, stride_oh,
                 stride_cb, stride_ch, stride_ct, stride_sb, stride_sh, stride_bt, stride_mb, stride_mi,
                 G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr,
                 DOT_F32: tl.constexpr, QPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """grid (B, num_kv_heads, query tiles * num_splits); see the module docstring."""
    b, kvh, pid = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    split = pid % num_splits
    q0 = (pid // num_splits) * QPT
    ctx = tl.load(ctx_ptr + b)
    size = tl.load(size_ptr + b)

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    qi = q0 + offs_r // G
    heads = kvh * G + offs_r % G
    row_ok = (offs_r < QPT * G) & (qi < N)  # rows this program writes
    row_live = row_ok & (qi < size)  # rows that attend
    d_mask = offs_d < D
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + qi[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_live[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    bt_row = bt_ptr + b64 * stride_bt
    per = tl.cdiv(tl.cdiv(ctx, BS), num_splits)
    lo = split * per * BS
    hi = tl.minimum(lo + per * BS, ctx)
    for n0 in range(lo, hi, BLOCK_N):  # this split's run of the context: visible to every live row
        keys = n0 + offs_n
        key_ok = keys < hi
        k, v, k_s, v_s = kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, keys, key_ok, kvh, stride_cb, stride_ch,
                                 stride_ct, stride_sb, stride_sh, offs_d, d_mask, BS, FP8)
        visible = row_live[:, None] & key_ok[None, :]
        m_i, l_i, acc = attend_tile(q, k, v, k_s, v_s, visible, m_i, l_i, acc, qk_scale, FP8, DOT_F32)
    tree_hi = tl.where(split == num_splits - 1, size, 0)
    mask_rows = mask_ptr + b64 * stride_mb + qi.to(tl.int64) * stride_mi
    for t0 in range(0, tree_hi, BLOCK_N):  # the tree's own keys, under its mask (last split only)
        j = t0 + offs_n
        j_ok = j < tree_hi
        k, v, k_s, v_s = kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, ctx + j, j_ok, kvh, stride_cb, stride_ch,
                                 stride_ct, stride_sb, stride_sh, offs_d, d_mask, BS, FP8)
        seen = tl.load(mask_rows[:, None] + j[None, :], mask=row_live[:, None] & j_ok[None, :], other=0)
        m_i, l_i, acc = attend_tile(q, k, v, k_s, v_s, seen != 0, m_i, l_i, acc, qk_scale, FP8, DOT_F32)

    if SPLIT:
        row = ((b64 * N + qi) * tl.num_programs(1) * G + heads) * num_splits + split
        tl.store(wm_ptr + row, m_i, mask=row_ok)
        tl.store(wl_ptr + row, l_i, mask=row_ok)
        tl.store(wacc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None] & d_mask[None, :])
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b64 * stride_ob + qi[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


def paged_tree_attention_ref(q, k_cache, v_cache, block_tables, context_lens, tree_sizes, tree_mask, scale, *,
                             k_scale=None, v_scale=None) -> torch.Tensor:
    """float32 [B, N, Hq, D] from the gathered pages (loops over sequences; syncs); padding rows zero."""
    out = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    for b, (ctx, n) in enumerate(zip(context_lens.tolist(), tree_sizes.tolist())):
        if n == 0:
            continue
        k = gather_kv(k_cache, k_scale, block_tables[b], ctx + n)
        v = gather_kv(v_cache, v_scale, block_tables[b], ctx + n)
        vis = torch.cat([torch.ones(n, ctx, dtype=torch.bool, device=q.device), tree_mask[b, :n, :n]], dim=1)
        out[b, :n] = attention_ref(q[b, :n], k, v, vis, scale)
    return out


def paged_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, tree_sizes: torch.Tensor, tree_mask: torch.Tensor, scale: float,
                         *, k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                         num_splits: Optional[int] = None, out: Optional[torch.Tensor] = None,
                         backend: str = "auto") -> torch.Tensor:
    """Attention of B padded token trees over their paged keys (see the module docstring).

    q [B, N, num_q_heads, head_dim] bf16/fp16/fp32 (unit stride along head_dim); caches as in
    kernels/paged_attention.py; block_tables int32 [B, max_blocks]; context_lens int32 [B];
    tree_sizes int32 [B] (each <= N); tree_mask bool [B, N, N] (unit last stride); scale:
    softmax scale; num_splits: context runs per sequence (None: from the shapes). Returns out
    [B, N, num_q_heads, head_dim] in q's dtype (contiguous when given), rows past a tree's
    size zero.
    """
    h, bs, d, fp8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    dev = k_cache.device
    if q.dim() != 4 or q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or q.shape[3] != d \
            or q.device != dev or q.stride(3) != 1 or q.shape[2] == 0 or q.shape[2] % h:
        raise ValueError(f"q: must be a [B, N, num_q_heads (a multiple of {h}), head_dim={d}] bf16/fp16/fp32 tensor "
                         f"on {dev} with unit stride along head_dim, got {q.dtype} {tuple(q.shape)} on {q.device}")
    bsz, n, hq, _ = q.shape
    g = hq // h
    check_index("block_tables", block_tables, 2, torch.int32, dev, bsz)
    check_index("context_lens", context_lens, 1, torch.int32, dev, bsz)
    check_index("tree_sizes", tree_sizes, 1, torch.int32, dev, bsz)
    check_index("tree_mask", tree_mask, 3, torch.bool, dev, bsz)
    if tree_mask.shape[1:] != (n, n):
        raise ValueError(f"tree_mask: must be [B, N, N] = [{bsz}, {n}, {n}], got {tuple(tree_mask.shape)}")
    scale = check_scale(scale)
    if num_splits is not None:
        _int("num_splits", num_splits, 1)
    if out is None:
        out = torch.empty(q.shape, device=dev, dtype=q.dtype)
    elif (out.shape, out.dtype, out.device) != (q.shape, q.dtype, dev) or not out.is_contiguous():
        raise ValueError(f"out: must be a contiguous {q.dtype} {tuple(q.shape)} tensor on {dev}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if not use_triton(backend, q):
        out.copy_(paged_tree_attention_ref(q, k_cache, v_cache, block_tables, context_lens, tree_sizes, tree_mask,
                                           scale, k_scale=k_scale, v_scale=v_scale))
        return out
    if bsz == 0 or n == 0:
        return out
    block_m, block_n, warps, stages = extend_tiles(n, g, d, q.element_size())
    block_d = max(16, triton.next_power_of_2(d))
    qpt = block_m // g
    q_tiles = triton.cdiv(n, qpt)
    splits = num_splits or default_num_splits(bsz * q_tiles, h, block_tables.shape[1], bs, block_n, sm_count(dev))
    if splits > 1:
        wm = torch.empty((bsz * n, hq, splits), device=dev, dtype=torch.float32)
        wl = torch.empty_like(wm)
        wacc = torch.empty((bsz * n, hq, splits, d), device=dev, dtype=torch.float32)
    else:
        wm = wl = wacc = out
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)
    _tree_kernel[(bsz, h, q_tiles * splits)](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, tree_sizes, tree_mask.view(torch.uint8), out,
        wm, wl, wacc, scale * LOG2E, n, splits, q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2), *k_cache.stride()[:3], ks.stride(0), ks.stride(1),
        block_tables.stride(0), tree_mask.stride(0), tree_mask.stride(1),
        G=g, D=d, BS=bs, FP8=fp8, SPLIT=splits > 1, DOT_F32=compute_dot_f32(q), QPT=qpt, BLOCK_M=block_m,
        BLOCK_D=block_d, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    if splits > 1:
        flat = out.view(bsz * n, hq, d)
        _combine_kernel[(bsz * n, hq)](wm, wl, wacc, flat, wm, 0, splits, flat.stride(0), flat.stride(1), D=d,
                                       BOUNDED=False, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
                                       num_warps=4)
    return out
