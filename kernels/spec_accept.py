"""Greedy acceptance of B verified token trees and the accepted paths' KV move, in one launch.

The same launch serves sampled verification (``first_match``): with every draft node a point
mass (EAGLE's and Medusa's candidates: the draft's top tokens, siblings distinct), rejection
sampling over the tree is equivalent to drawing one token y from the target's distribution at
every node and accepting the child whose token is y -- child x_i of a node is taken with
probability p(x_i), as the sequential rule (accept x_i with p(x_i) / (1 - sum_{j<i} p(x_j)) once
the earlier siblings were rejected) gives, and when no child is y, y itself is distributed as the
residual (p without the children, renormalised), the token the rule draws last. So ``target``
is then the drawn tokens, and a node matches only as its parent's first child with that token
(a later sibling repeating it would let the deepest-path rule choose among independent draws).

What runtime/spec/acceptance.py's ``greedy_accept`` and kv_compact.py's ``accepted_kv_slots`` /
``move_kv_slots`` compute with tensor ops -- about 60 kernels inside a speculative step's CUDA
graph, each a launch (~2-3 us of a graph replay on the H200 for kernels this small) -- here one:

Inputs (runtime/spec/tree.py's TreeBatch): tokens, parents, depths int64 [B, N], mask bool
[B, N, N] (ancestor-or-self), paths int64 [B, N, N], sizes int64 [B]; the target's greedy token
at every node, target int64 [B, N] (logits.argmax(-1)); block tables int32 [B, W]; context
lengths ctx int64 [B] (the root's position: node i's K/V sits at ctx + i); the caches
[layers, num_blocks, Hkv, block_size, D] (and fp8 scales [layers, num_blocks, Hkv, block_size]).

Program (b, l) recomputes sequence b's acceptance (N <= 128 nodes: a few vector ops): node i
matched when its token is the target's at its parent (the root always), a node is on an
accepted path when every node on its root path matched, the path kept is the deepest (ties: the
lowest index). It then moves layer l's K/V of the path: node a_i's entry at ctx + a_i to ctx + i,
i = 1 .. k, in increasing i (a_i >= i, so no move reads an entry an earlier one wrote). Program
(b, 0) also writes the results, as one int64 row a sequence (``packed`` [B, 1 + 2N + S], the layout
the host reads back in one copy): num (k), out_tokens (the k accepted draft tokens, the target's
token at the path's end, then -1), accepted (path nodes, root first, -1 after) and, given the
adaptive policy's menu of S tree sizes and each node's rank (the nodes of rank < m form the tree of
m nodes), the draft tokens each smaller tree would have accepted: the path cut at its first node
ranked m or later (runtime/spec's ``accepted_per_size``, which cost a step graph eight launches of
its own). For the feature store: rows [B, N] (b * N + a_i: the verify forward's row of path node i;
0 past k) and slots [B, N] (the cache slot of ctx + i; -1 past k).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import pow2, use_triton

MAX_NODES = 128


# sizes that change from step to step (the block tables' width above all) are not specialized on:
# no compile in the middle of serving
@triton.jit(do_not_specialize=["N", "sb_par", "sb_dep", "sb_mask", "sb_path", "sb_rank", "stride_bt"])
def _accept_move_kernel(tok_ptr, par_ptr, dep_ptr, mask_ptr, path_ptr, size_ptr, tgt_ptr, bt_ptr, ctx_ptr,
                        k_ptr, v_ptr, ks_ptr, vs_ptr, pk_ptr, rank_ptr, menu_ptr, row_ptr, slot_ptr,
                        N, S, sb_par, sb_dep, sb_mask, sb_path, sb_rank, stride_bt, stride_cl, stride_cb, stride_ch,
                        stride_ct, stride_sl, stride_sb, stride_sh,
                        H, D, BS: tl.constexpr, HAS_SCALE: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr,
                        BH: tl.constexpr, BD: tl.constexpr, FIRST: tl.constexpr):
    """grid (B, layers); see the module docstring."""
    b = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, NP)
    j = tl.arange(0, NP)
    size = tl.load(size_ptr + b)
    valid = i < size
    in_n = i < N
    base = b * N
    tok = tl.load(tok_ptr + base + i, mask=in_n, other=0)
    par = tl.load(par_ptr + b * sb_par + i, mask=in_n, other=-1)
    at_par = tl.load(tgt_ptr + base + tl.maximum(par, 0), mask=in_n, other=-1)
    matched = ((tok == at_par) | (i == 0)) & valid
    if FIRST:  # an earlier sibling with the same token takes the match
        rep = (par[:, None] == par[None, :]) & (tok[:, None] == tok[None, :]) & (j[None, :] < i[:, None]) \
            & in_n[None, :]
        matched = matched & (tl.max(rep.to(tl.int32), axis=1) == 0)
    anc = tl.load(mask_ptr + b * sb_mask + i[:, None] * N + j[None, :], mask=in_n[:, None] & (j < N)[None, :],
                  other=0)
    bad = (anc != 0) & (matched == 0)[None, :]
    ok = (tl.max(bad.to(tl.int32), axis=1) == 0) & valid
    dep = tl.load(dep_ptr + b * sb_dep + i, mask=in_n, other=0)
    score = tl.where(ok, dep, -1)
    k = tl.max(score, axis=0)  # the root is always ok: k >= 0
    best = tl.min(tl.where(score == k, i, NP), axis=0).to(tl.int64)
    path_row = path_ptr + b * sb_path + best * N
    acc = tl.load(path_row + i, mask=in_n, other=-1)
    ctx = tl.load(ctx_ptr + b)
    bt_row = bt_ptr + b * stride_bt
    if layer == 0:
        final = tl.load(tgt_ptr + base + best)
        nxt = tl.load(path_row + i + 1, mask=(i + 1) < N, other=-1)
        nxt_tok = tl.load(tok_ptr + base + tl.maximum(nxt, 0), mask=in_n, other=0)
        out = tl.where(i < k, nxt_tok, tl.where(i == k, final, -1))
        pk = pk_ptr + b * (1 + 2 * N + S)
        tl.store(pk, k)
        tl.store(pk + 1 + i, out, mask=in_n)
        tl.store(pk + 1 + N + i, acc, mask=in_n)
        if SP > 0:  # per menu size m: the path's nodes at depth 1 .. k before its first of rank >= m
            rank = tl.load(rank_ptr + b * sb_rank + tl.maximum(acc, 0), mask=in_n, other=0)
            sv = tl.arange(0, SP)
            m = tl.load(menu_ptr + sv, mask=sv < S, other=0)
            cut = (i >= 1)[None, :] & (i <= k)[None, :] & (rank[None, :] >= m[:, None])
            first = tl.min(tl.where(cut, i[None, :], k + 1), axis=1)
            tl.store(pk + 1 + 2 * N + sv, first - 1, mask=sv < S)
        pos = ctx + i
        slot = tl.load(bt_row + pos // BS, mask=in_n & (i <= k), other=0).to(tl.int64) * BS + pos % BS
        tl.store(row_ptr + base + i, tl.where(acc >= 0, base + acc, 0), mask=in_n)
        tl.store(slot_ptr + base + i, tl.where(i <= k, slot, -1), mask=in_n)
    # this layer's K/V (and scales) of path node a_c at ctx + a_c -> ctx + c, c = 1 .. k, in order
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    hd_ok = (h < H)[:, None] & (d < D)[None, :]
    hd = h[:, None] * stride_ch + d[None, :]
    for c in range(1, k + 1):  # the path's k moves only (a loop over all N nodes cost 16 us at 41 nodes, H100)
        a = tl.load(path_row + c)
        if a != c:
            src = ctx + a
            dst = ctx + c
            sblk = tl.load(bt_row + src // BS).to(tl.int64)
            dblk = tl.load(bt_row + dst // BS).to(tl.int64)
            so = layer * stride_cl + sblk * stride_cb + (src % BS) * stride_ct
            do = layer * stride_cl + dblk * stride_cb + (dst % BS) * stride_ct
            kv = tl.load(k_ptr + so + hd, mask=hd_ok)
            tl.store(k_ptr + do + hd, kv, mask=hd_ok)
            vv = tl.load(v_ptr + so + hd, mask=hd_ok)
            tl.store(v_ptr + do + hd, vv, mask=hd_ok)
            if HAS_SCALE:
                sso = layer * stride_sl + sblk * stride_sb + (src % BS)
                sdo = layer * stride_sl + dblk * stride_sb + (dst % BS)
                hs = h * stride_sh
                ksv = tl.load(ks_ptr + sso + hs, mask=h < H)
                tl.store(ks_ptr + sdo + hs, ksv, mask=h < H)
                vsv = tl.load(vs_ptr + sso + hs, mask=h < H)
                tl.store(vs_ptr + sdo + hs, vsv, mask=h < H)


def greedy_accept_move_ref(tokens, parents, depths, mask, paths, sizes, target, block_tables, ctx, k_cache, v_cache,
                           k_scale=None, v_scale=None, first_match: bool = False):
    """The same with tensor ops (runtime/spec's greedy acceptance and KV move, written out here so
    kernels/ imports nothing of the runtime): (accepted, num, out_tokens, rows, slots)."""
    bsz, n = tokens.shape
    dev = tokens.device
    idx = torch.arange(n, device=dev)
    valid = idx[None, :] < sizes[:, None]
    matched = (tokens == target.gather(1, parents.clamp_min(0))) | (idx[None, :] == 0)
    matched &= valid
    if first_match:
        rep = (parents[:, :, None] == parents[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :]) \
            & (idx[None, None, :] < idx[None, :, None])
        matched &= ~rep.any(dim=-1)
    ok = valid & ~(mask & ~matched[:, None, :]).any(dim=-1)
    best = torch.where(ok, depths, -1).argmax(dim=1)
    rows = torch.arange(bsz, device=dev)
    acc = paths[rows, best]
    num = depths[rows, best]
    final = target[rows, best]
    nxt = torch.cat([acc[:, 1:], torch.full_like(acc[:, :1], -1)], dim=1)
    out = torch.where(idx[None, :] < num[:, None], tokens.gather(1, nxt.clamp_min(0)),
                      torch.where(idx[None, :] == num[:, None], final[:, None], -1))
    bs = k_cache.shape[3]
    pos = ctx[:, None] + idx[None, :]
    table = block_tables.long()
    slot_of = table.gather(1, (pos // bs).clamp_max(table.shape[1] - 1)) * bs + pos % bs
    slots = torch.where(idx[None, :] <= num[:, None], slot_of, -1)
    feat_rows = torch.where(acc >= 0, rows[:, None] * n + acc, 0)
    moves = (acc >= 0) & (acc != idx[None, :])
    src = torch.where(moves, ctx[:, None] + acc, ctx[:, None])
    dst = torch.where(moves, pos, ctx[:, None])
    s = (table.gather(1, src // bs) * bs + src % bs).reshape(-1)
    t = (table.gather(1, dst // bs) * bs + dst % bs).reshape(-1)
    for cache in (k_cache, v_cache, k_scale, v_scale):
        if cache is None:
            continue
        x = cache.view(torch.uint8) if cache.element_size() == 1 else cache
        vals = x[:, s // bs, :, s % bs]
        x[:, t // bs, :, t % bs] = vals
    return acc, num, out, feat_rows, slots


def accepted_per_size_ref(accepted: torch.Tensor, ranks: torch.Tensor, menu: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: the draft tokens a tree of the first m ranks would have accepted, for each m in
    menu (int64 [S]), from the accepted path of the whole tree (accepted int64 [B, N], root first, -1
    after) and each node's rank (ranks int64 [B, N], every parent ranked before its children):
    the path's running maximum rank, counted below each m, entries past the path ranked past every
    m. runtime/spec/acceptance.py's ``accepted_per_size``, written out here as greedy_accept_move_ref
    is (kernels/ imports nothing of the runtime); the tests hold the two equal. Tensor ops, no host
    value."""
    path = accepted[:, 1:]
    r = ranks.gather(1, path.clamp_min(0)).masked_fill(path < 0, torch.iinfo(torch.int64).max)
    return (r.cummax(dim=1).values.unsqueeze(-1) < menu).sum(dim=1)


def pack_results(num: torch.Tensor, out_tokens: torch.Tensor, accepted: torch.Tensor,
                 per_size: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The layout the kernel writes, with tensor ops: int64 [B, 1 + 2N (+ S)], num, out_tokens,
    accepted (and per_size)."""
    parts = [num.view(-1, 1), out_tokens, accepted] + ([] if per_size is None else [per_size])
    return torch.cat([p.to(torch.int64) for p in parts], dim=1)


def greedy_accept_move(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor,
                       paths: torch.Tensor, sizes: torch.Tensor, target: torch.Tensor, block_tables: torch.Tensor,
                       ctx: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                       backend: str = "auto", first_match: bool = False):
    """(accepted int64 [B, N], num int64 [B], out_tokens int64 [B, N], rows int64 [B, N], slots
    int64 [B, N]) as the module docstring says; the caches are moved in place. No host sync on the
    Triton path (a speculative step's CUDA graph captures it). first_match: target holds tokens
    drawn from the target at each node (sampled verification), a repeated sibling never matches.
    The first three are views of ``greedy_accept_move_packed``'s row."""
    n = tokens.shape[1]
    packed, rows, slots = greedy_accept_move_packed(tokens, parents, depths, mask, paths, sizes, target,
                                                    block_tables, ctx, k_cache, v_cache, k_scale, v_scale,
                                                    backend=backend, first_match=first_match)
    return packed[:, 1 + n:1 + 2 * n], packed[:, 0], packed[:, 1:1 + n], rows, slots


def greedy_accept_move_packed(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                              mask: torch.Tensor, paths: torch.Tensor, sizes: torch.Tensor, target: torch.Tensor,
                              block_tables: torch.Tensor, ctx: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, k_scale: Optional[torch.Tensor] = None,
                              v_scale: Optional[torch.Tensor] = None, backend: str = "auto",
                              first_match: bool = False, ranks: Optional[torch.Tensor] = None,
                              menu: Optional[torch.Tensor] = None):
    """``greedy_accept_move`` with the results as one int64 row a sequence: (packed [B, 1 + 2N + S]:
    num, out_tokens, accepted, then with ranks (int64 [B, N], unit stride along N) and menu (int64
    [S]) the draft tokens each menu size would have accepted, ``accepted_per_size_ref``; rows,
    slots). S = 0 without a menu."""
    bsz, n = tokens.shape
    if n > MAX_NODES:
        raise ValueError(f"trees of {n} nodes: at most {MAX_NODES} allowed")
    if (ranks is None) != (menu is None):
        raise ValueError("ranks and menu: give both or neither")
    if menu is not None and (menu.dim() != 1 or menu.dtype != torch.int64 or ranks.shape != tokens.shape
                             or ranks.dtype != torch.int64 or menu.device != tokens.device
                             or ranks.device != tokens.device):
        raise ValueError(f"ranks, menu: must be int64 [{bsz}, {n}] and int64 [S] on {tokens.device}, got "
                         f"{ranks.dtype} {tuple(ranks.shape)} on {ranks.device} and {menu.dtype} "
                         f"{tuple(menu.shape)} on {menu.device}")
    if not use_triton(backend, tokens):
        acc, num, out, rows, slots = greedy_accept_move_ref(tokens, parents, depths, mask, paths, sizes, target,
                                                            block_tables, ctx, k_cache, v_cache, k_scale, v_scale,
                                                            first_match)
        per_size = None if menu is None else accepted_per_size_ref(acc, ranks, menu)
        return pack_results(num, out, acc, per_size), rows, slots
    # one tree's structure may be shared over the batch (a Medusa tree: expanded, batch stride 0);
    # within a sequence each tensor is read as contiguous
    tokens, target = tokens.contiguous(), target.contiguous()
    parents, depths, mask, paths = (t if t.stride()[1:] == t[0].contiguous().stride() else t.contiguous()
                                    for t in (parents, depths, mask, paths))
    if ranks is not None and ranks.stride(1) != 1:
        ranks = ranks.contiguous()
    s = 0 if menu is None else menu.numel()
    dev = tokens.device
    packed = torch.empty(bsz, 1 + 2 * n + s, dtype=torch.int64, device=dev)
    rows = torch.empty(bsz, n, dtype=torch.int64, device=dev)
    slots = torch.empty_like(rows)
    if bsz == 0:
        return packed, rows, slots
    layers, _, h, bs, d = k_cache.shape
    if k_cache.stride(4) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache, v_cache: must share strides, unit stride along head_dim")
    kc = k_cache.view(torch.uint8) if k_cache.element_size() == 1 else k_cache
    vc = v_cache.view(torch.uint8) if v_cache.element_size() == 1 else v_cache
    scaled = k_scale is not None
    ks, vs = (k_scale, v_scale) if scaled else (kc, vc)
    sstr = k_scale.stride() if scaled else (0, 0, 0, 0)
    _accept_move_kernel[(bsz, layers)](
        tokens, parents, depths, mask.view(torch.uint8), paths, sizes, target, block_tables, ctx,
        kc, vc, ks, vs, packed, packed if ranks is None else ranks, packed if menu is None else menu, rows, slots,
        n, s, parents.stride(0), depths.stride(0), mask.stride(0), paths.stride(0),
        0 if ranks is None else ranks.stride(0), block_tables.stride(0),
        *kc.stride()[:4], sstr[0], sstr[1], sstr[2], h, d,
        BS=bs, HAS_SCALE=scaled, NP=max(16, pow2(n)), SP=0 if s == 0 else max(2, pow2(s)), BH=max(2, pow2(h)),
        BD=max(16, pow2(d)), FIRST=first_match, num_warps=4)
    return packed, rows, slots
