"""Extend attention over the paged KV cache: prefill, chunked prefill, prefill after a
prefix-cache hit, and token-tree verification, in one kernel. The cache layout and the tile
helpers are kernels/paged_attention.py's.

Inputs: q [T, num_q_heads, head_dim] holds the new tokens of B sequences back to back
(sequence b's rows are cu_seqlens_q[b]:cu_seqlens_q[b + 1]), their K/V already in the cache.
Sequence b has seq_lens[b] keys, of which the first prefix_b = seq_lens[b] - q_len_b were
cached before; new token i sits at position prefix_b + i. Visibility of key j to new token i
(position p = prefix_b + i):
    causal (default): j <= p
    mask (token tree): j < seq_len_b - C, or mask_b[i, j - (seq_len_b - C)] (mask_b = the
        [q_len_b, C] row-major bool block at mask_offsets[b] of the flat ``mask``, over the last C
        keys; C = mask_cols, or q_len_b when mask_cols is 0: the new tokens themselves; the caller
        sets the diagonal). C > q_len_b lets a draft's tree level attend its ancestors among the
        rows earlier levels wrote, without computing them again. A sequence whose mask_offsets[b] < 0
        is causal (a speculative step's verify forward carries prefill chunks beside its trees)
    sliding_window > 0, also: p - j < sliding_window
Kernel: grid (cdiv(max_seqlen_q, QPT) * num_splits, B, num_kv_heads). GQA is packed into the tile: its
BLOCK_M rows are (query, head) pairs, row r = query q0 + r // G, head kvh * G + r % G, QPT =
BLOCK_M // G queries per tile, so each key tile is loaded once for all G heads (G need not be
a power of two; the last BLOCK_M - QPT * G rows idle). The key loop runs in two phases: key
tiles every row sees whole (j < prefix + q0, or j < prefix with a mask) without per-element
masks (bar the window), then the tiles up to the causal limit of the tile's last query
(or seq_len with a mask) with full masks. Rows past q_len_b are never written.
Short runs (a token tree's verify, a draft's tree level) cut those key tiles into num_splits
runs, as in flash-decoding: each split writes its partial (max, sum, acc) to an fp32 workspace
and paged_attention's combine kernel merges them, for the rows of the B sequences only.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import CompiledLaunch, int_kind, pow2, use_triton
from .paged_attention import (
    LOG2E,
    _combine_kernel,
    _int,
    attend_tile,
    attention_ref,
    check_cache,
    check_index,
    check_out,
    check_q,
    check_scale,
    compute_dot_f32,
    gather_kv,
    kv_tile,
    sm_count,
)


# sizes that change from step to step are not specialized on (== 1, % 16): no compile mid-serving
@triton.jit(do_not_specialize=["window", "mask_cols", "num_splits", "stride_bt"])
def _extend_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, sl_ptr, cu_ptr, mask_ptr, moff_ptr,
                   out_ptr, wm_ptr, wl_ptr, wacc_ptr, qk_scale, window, mask_cols, num_splits, stride_qt,
                   stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_ct, stride_sb, stride_sh, stride_bt,
                   G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, FP8: tl.constexpr,
                   HAS_MASK: tl.constexpr, SLIDING: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                   QPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """grid (query tiles * num_splits, B, num_kv_heads); see the module docstring."""
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    split = tl.program_id(0) % num_splits
    q0 = (tl.program_id(0) // num_splits) * QPT
    if q0 >= q_len:
        return
    seq_len = tl.load(sl_ptr + b)
    prefix = seq_len - q_len

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    qi = q0 + offs_r // G
    heads = kvh * G + offs_r % G
    row_ok = (offs_r < QPT * G) & (qi < q_len)
    d_mask = offs_d < D
    pos = prefix + qi
    tok = (q_start + qi).to(tl.int64)
    io_mask = row_ok[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=io_mask, other=0.0)

    if HAS_MASK:
        moff = tl.load(moff_ptr + b)
        is_tree = moff >= 0  # else causal
        cols = tl.where(mask_cols > 0, mask_cols, q_len)
        # the keys read through the mask, [tree_lo, seq_len): none when causal
        tree_lo = tl.where(is_tree, seq_len - cols, seq_len)
        full_hi = tl.where(is_tree, tree_lo, prefix + q0)
        hi = tl.where(is_tree, seq_len, prefix + tl.minimum(q0 + QPT, q_len))
        mask_row = mask_ptr + tl.maximum(moff, 0) + qi.to(tl.int64) * cols
    else:
        full_hi = prefix + q0
        hi = prefix + tl.minimum(q0 + QPT, q_len)
    lo = 0
    if SLIDING:
        lo = tl.maximum(prefix + q0 - window + 1, 0)
    n_full = tl.maximum(full_hi - lo, 0) // BLOCK_N
    # split s of num_splits takes its run of the key tiles: the unmasked ones, then the masked ones up to hi
    n_tiles = n_full + tl.cdiv(tl.maximum(hi - lo - n_full * BLOCK_N, 0), BLOCK_N)
    per = tl.cdiv(n_tiles, num_splits)
    t_lo = split * per
    t_hi = tl.minimum(t_lo + per, n_tiles)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    all_keys = offs_n >= 0
    for t in range(t_lo, tl.minimum(t_hi, n_full)):  # every row sees these keys (bar the window)
        keys = lo + t * BLOCK_N + offs_n
        k, v, k_s, v_s = kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, keys, all_keys, kvh, stride_cb,
                                 stride_ch, stride_ct, stride_sb, stride_sh, offs_d, d_mask, BS, FP8)
        visible = all_keys[None, :]
        if SLIDING:
            visible = pos[:, None] - keys[None, :] < window
        m_i, l_i, acc = attend_tile(q, k, v, k_s, v_s, visible, m_i, l_i, acc, qk_scale, FP8, DOT_F32)
    for t in range(tl.maximum(t_lo, n_full), t_hi):  # the diagonal / tree part
        keys = lo + t * BLOCK_N + offs_n
        key_ok = keys < hi
        k, v, k_s, v_s = kv_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, keys, key_ok, kvh, stride_cb,
                                 stride_ch, stride_ct, stride_sb, stride_sh, offs_d, d_mask, BS, FP8)
        if HAS_MASK:
            new = keys >= tree_lo
            tree = tl.load(mask_row[:, None] + (keys - tree_lo)[None, :],
                           mask=row_ok[:, None] & (new & key_ok)[None, :], other=0)
            seen = tl.where(is_tree, (keys < tree_lo)[None, :] | (tree != 0), keys[None, :] <= pos[:, None])
            visible = key_ok[None, :] & seen
        else:
            visible = key_ok[None, :] & (keys[None, :] <= pos[:, None])
        if SLIDING:
            visible = visible & (pos[:, None] - keys[None, :] < window)
        m_i, l_i, acc = attend_tile(q, k, v, k_s, v_s, visible, m_i, l_i, acc, qk_scale, FP8, DOT_F32)

    if SPLIT:  # partial (max, sum, acc) for paged_attention's combine kernel: [T, Hq, splits (, D)] fp32
        row = (tok * (tl.num_programs(2) * G) + heads) * num_splits + split
        tl.store(wm_ptr + row, m_i, mask=row_ok)
        tl.store(wl_ptr + row, l_i, mask=row_ok)
        tl.store(wacc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=io_mask)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=io_mask)


_EXTEND = CompiledLaunch(_extend_kernel, pointers=14, runtime=True)
_COMBINE = CompiledLaunch(_combine_kernel, pointers=5, runtime=True)


# 128-row tiles (8 warps, 128 keys a tile, 3 stages) only for new runs of at least this many (query, head)
# rows: below it a sequence's queries fit one or two such tiles, and each tile walks every key alone.
# H100, forty-fifth session: a 41-node tree verify (SmolLM2, 123 rows, batch 1) took 17.7 µs a call in one
# 128-row tile against 5.8 µs for a 20-node tree in one 64-row tile (profile_step.py), 0.42 ms a step.
BIG_TILE_ROWS = 512


def extend_tiles(max_seqlen_q: int, group: int, head_dim: int, elem_bytes: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages): up to 128 (query, head) rows for long
    new runs (BIG_TILE_ROWS), 64 for shorter ones (a token tree), fewer when the run needs fewer;
    head_dim 256 halves the tiles.
    float32 queries / caches (elem_bytes 4) take 64 keys a tile in two stages: 128 x 128 tiles
    of d 128 in three stages ask 256 KiB of shared memory, over the H200's 227 KiB (found by
    tests/kernels/test_tree_attention.py on the H200).
    H200, triton 3.6, causal 4096 tokens, 32 q / 8 kv heads, d 128: 128 x 128, 8 warps, 3
    stages 444 us (310 TFLOP/s); 128 x 64, 2 stages 489 us; 64 x 64, 4 warps, 3 stages 456 us."""
    big = head_dim <= 128
    rows = triton.next_power_of_2(max(1, max_seqlen_q) * group)
    cap = 128 if big and max_seqlen_q * group >= BIG_TILE_ROWS else 64
    block_m = max(16, triton.next_power_of_2(group), min(cap, rows))
    if elem_bytes > 2:
        return block_m, 64 if big else 32, 8 if block_m >= 128 else 4, 2
    if big and block_m >= 128:
        return block_m, 128, 8, 3
    return block_m, 64 if big else 32, 4, 2


def extend_num_splits(q_tiles: int, batch: int, num_kv_heads: int, rows: int, max_keys: int, block_n: int,
                      sms: int) -> int:
    """Key splits from shapes only (as flash-decoding; the step's graphs replay them): one for runs of
    BIG_TILE_ROWS (query, head) rows or more (prefill: its query tiles fill the GPU); else up to 4,
    while the programs stay within half the sms SMs, no more than the key tiles a block table row can
    describe (max_keys). H100, forty-sixth session (extend_tiles.py, SmolLM2's heads, 256 cached keys,
    one call with its combine): a 20-node tree at batch 1, 3 programs, 7.97 µs in one split, 6.35 in
    4, 7.03 in 32; at batch 8 (24 programs) 8.06 / 7.84 in 1 / 2 splits; at batch 64 splits only
    cost (9.78 µs in 1, 20.77 in 2). In a speculative step's graph (profile_step.py, 35 calls a step)
    4 splits took 223 µs against 206 unsplit at 20 nodes and 230 against 271 at 41: the combine's
    1.5 µs launch is as much as the key walk it shortens at 20."""
    if rows >= BIG_TILE_ROWS:
        return 1
    return max(1, min(4, sms // 2 // max(1, q_tiles * batch * num_kv_heads), -(-max_keys // block_n)))


def paged_extend_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, *,
                               mask=None, mask_offsets=None, k_scale=None, v_scale=None,
                               sliding_window: int = 0, mask_cols: int = 0) -> torch.Tensor:
    """float32 [T, Hq, D] from the gathered pages (loops over sequences; syncs)."""
    out = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    cu = cu_seqlens_q.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        k = gather_kv(k_cache, k_scale, block_tables[b], n)
        v = gather_kv(v_cache, v_scale, block_tables[b], n)
        prefix = n - (e - s)
        pos = prefix + torch.arange(e - s, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        off = -1 if mask is None else int(mask_offsets[b])
        if off < 0:
            vis = j <= pos
        else:
            cols = mask_cols or e - s
            tree = mask[off:off + (e - s) * cols].view(e - s, cols)
            vis = torch.cat([torch.ones(e - s, n - cols, dtype=torch.bool, device=q.device), tree], dim=1)
        if sliding_window > 0:
            vis = vis & (pos - j < sliding_window)
        out[s:e] = attention_ref(q[s:e], k, v, vis, scale)
    return out


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, max_seqlen_q: int, scale: float, *,
                           mask: Optional[torch.Tensor] = None, mask_offsets: Optional[torch.Tensor] = None,
                           k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                           sliding_window: int = 0, mask_cols: int = 0, num_splits: Optional[int] = None,
                           out: Optional[torch.Tensor] = None, backend: str = "auto") -> torch.Tensor:
    """Attention of the new tokens of B sequences over their paged keys (see the module
    docstring for the visibility rules).

    q [T, num_q_heads, head_dim] bf16/fp16/fp32 (any strides along T and heads);
    block_tables int32 [B, max_blocks]; seq_lens int32 [B] keys per sequence, new tokens
    included; cu_seqlens_q int32 [B + 1]; max_seqlen_q: host int >= every q_len_b (sizes the
    grid only); scale: softmax scale; mask: flat bool tree masks with mask_offsets int64 [B]
    (element offsets of each [q_len_b, C] block; negative: that sequence is causal), or None for
    causal; mask_cols: C, the keys each mask row covers, the last of each sequence (0: C = q_len_b;
    else q_len_b <= C <= seq_lens[b] for every tree sequence, unchecked: no host sync); num_splits:
    the key range cut into that many runs, merged by a combine kernel (None: extend_num_splits).
    Returns out [T, num_q_heads, head_dim] in q's dtype; only rows of the B sequences are
    written. No host sync on the Triton path.
    """
    h, bs, d, fp8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    dev = k_cache.device
    g = check_q(q, h, d, dev)
    check_index("block_tables", block_tables, 2, torch.int32, dev)
    bsz = block_tables.shape[0]
    check_index("seq_lens", seq_lens, 1, torch.int32, dev, bsz)
    check_index("cu_seqlens_q", cu_seqlens_q, 1, torch.int32, dev, bsz + 1)
    _int("max_seqlen_q", max_seqlen_q, 0)
    scale = check_scale(scale)
    _int("sliding_window", sliding_window, 0)
    _int("mask_cols", mask_cols, 0)
    if num_splits is not None:
        _int("num_splits", num_splits, 1)
    if (mask is None) != (mask_offsets is None):
        raise ValueError("mask, mask_offsets: give both (a tree mask) or neither (causal)")
    if mask is not None:
        check_index("mask", mask, 1, torch.bool, dev)
        check_index("mask_offsets", mask_offsets, 1, torch.int64, dev, bsz)
    out = check_out(out, q)
    if not use_triton(backend, q):
        ref = paged_extend_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale,
                                         mask=mask, mask_offsets=mask_offsets, mask_cols=mask_cols, k_scale=k_scale,
                                         v_scale=v_scale, sliding_window=sliding_window)
        cu = cu_seqlens_q.tolist()
        for s, e in zip(cu[:-1], cu[1:]):
            out[s:e] = ref[s:e]
        return out
    if bsz == 0 or max_seqlen_q == 0 or q.shape[0] == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    block_m, block_n, warps, stages = extend_tiles(max_seqlen_q, g, d, q.element_size())
    qpt = block_m // g
    q_tiles = -(-max_seqlen_q // qpt)
    splits = num_splits or extend_num_splits(q_tiles, bsz, h, max_seqlen_q * g, block_tables.shape[1] * bs, block_n,
                                             sm_count(dev))
    hq = q.shape[1]
    if splits > 1:  # partials of every row of q; the combine writes those of the B sequences only
        wm = torch.empty((q.shape[0], hq, splits), device=dev, dtype=torch.float32)
        wl = torch.empty_like(wm)
        wacc = torch.empty((q.shape[0], hq, splits, d), device=dev, dtype=torch.float32)
    else:
        wm = wl = wacc = out
    ks, vs = (k_scale, v_scale) if fp8 else (k_cache, v_cache)
    m = q if mask is None else mask.view(torch.uint8)
    moff = cu_seqlens_q if mask_offsets is None else mask_offsets
    # window, mask_cols, num_splits and stride_bt are do_not_specialize (their width only); every other int exactly
    ints = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], ks.stride(0), ks.stride(1))
    block_d = max(16, pow2(d))
    constexprs = dict(G=g, D=d, BS=bs, FP8=fp8, HAS_MASK=mask is not None, SLIDING=sliding_window > 0, SPLIT=splits > 1,
                      DOT_F32=compute_dot_f32(q), QPT=qpt, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n)
    key = (q.dtype, k_cache.dtype, ks.dtype, block_tables.dtype, m.dtype, moff.dtype, out.dtype, wm.dtype, ints,
           int_kind(sliding_window), int_kind(mask_cols), int_kind(splits), int_kind(block_tables.stride(0)),
           tuple(constexprs.values()), warps, stages)
    _EXTEND(key, (q_tiles * splits, bsz, h),
            (q, k_cache, v_cache, ks, vs, block_tables, seq_lens, cu_seqlens_q, m, moff, out, wm, wl, wacc,
             scale * LOG2E, sliding_window, mask_cols, splits, *ints, block_tables.stride(0)),
            constexprs, dict(num_warps=warps, num_stages=stages))
    if splits > 1:
        const = dict(D=d, BOUNDED=True, BLOCK_S=pow2(splits), BLOCK_D=block_d)
        ints = (splits, out.stride(0), out.stride(1))
        _COMBINE((out.dtype, cu_seqlens_q.dtype, int_kind(bsz), ints, tuple(const.values())), (q.shape[0], hq, 1),
                 (wm, wl, wacc, out, cu_seqlens_q, bsz, *ints), const, dict(num_warps=4))
    return out
