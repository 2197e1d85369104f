"""EAGLE-2 tree growth for B sequences: each level's bookkeeping in one launch, the final
selection and the tree's structure in one more.

The EAGLE-2 paper's algorithm. Scores are cumulative draft log-probabilities (the root: 0).
Start: the root's top_k children join the candidate pool and form the frontier. Each level takes
the draft's k best log-probs after each frontier node, adds those top_k^2 children to the pool,
and makes the top_k of them, by score, the next frontier. The tree is the root plus the n - 1
best candidates of the whole pool. Log-probs are <= 0, so a child never outscores its parent,
and ties go to the earlier candidate (a parent always precedes its children): the kept set is a
tree. Kept nodes are in pool (creation) order, siblings by rank.

With tensor ops a level's bookkeeping (the cumulative scores, a stable sort, five gathers, the
next level's features and its ancestor mask) and the final selection (two sorts, a scatter,
gathers, then the structure's launch) were about 75 kernels of a speculative step's CUDA graph at
depth 5 (benchmarks/spec_step_launches.py); here they are depth + 1 launches. Each function has
its torch reference (``backend="torch"``, the runtime's CPU path).

The candidate pool, int64 tokens / float32 scores / int64 parents [B, P] with P = 1 + top_k +
(depth - 1) top_k^2, is filled a level at a time: the root at 0, the
root's children at 1 .. top_k, then each level's top_k^2 candidates (frontier node f's child c
at f * top_k + c of the level's block).

``grow`` (grid (B,)): a level's candidates -- children log-probs lp [B, F * k] (each frontier
node's k best, descending, <= 0, as kernels/topk.py gives them) and their tokens -- into the
pool; then, unless it is the last level, the next frontier: the k best candidates (stable:
among equal scores the earlier), their pool ids, scores and tokens, the draft's next input
features (the output row of each one's parent) and the next level's ancestor-or-self mask over
the draft's scratch rows (the parent's row, then the new rows' own diagonal). F = 1 at the root.

``select`` (grid (B,)): each candidate's rank in the whole pool by score (a comparison count:
P^2 compares a sequence, no sort); the n of rank < n in creation order (parents before
children), their parents as tree indices, their ranks (the adaptive policy's prefix sizes),
then depths, ancestor-or-self mask and root-to-node paths (``tree_structure_ref``), the parent
walk done by one-hot reductions in registers.

NaN scores count as -inf (a sort would put them first), in the kernels and the references.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .common import CompiledLaunch, int_kind, pow2, use_triton

MAX_NODES = 128  # the selected tree's nodes (the one-hot walks are [n, n] in registers)


class Pool(NamedTuple):
    tokens: torch.Tensor  # int64 [B, P]
    scores: torch.Tensor  # float32 [B, P]
    parents: torch.Tensor  # int64 [B, P]: a candidate's parent pool index (the root: -1)


class Frontier(NamedTuple):
    ids: torch.Tensor  # int64 [B, k]: pool indices
    scores: torch.Tensor  # float32 [B, k]
    tokens: torch.Tensor  # int64 [B, k]: the draft's next input tokens
    features: torch.Tensor  # [B, k, H]: the draft's next input features (the parents' outputs)
    mask: torch.Tensor  # bool [B, k, M]: the next level's ancestor-or-self rows over M = (level + 1) k scratch rows


class Tree(NamedTuple):
    tokens: torch.Tensor  # int64 [B, n]
    parents: torch.Tensor  # int64 [B, n]: tree indices, the root -1
    ranks: torch.Tensor  # int64 [B, n]: each node's rank by score (the root 0)
    scores: torch.Tensor  # float32 [B, n]: cumulative draft log-probabilities (the root 0)
    depths: torch.Tensor  # int64 [B, n]
    mask: torch.Tensor  # bool [B, n, n]
    paths: torch.Tensor  # int64 [B, n, n]


def pool_size(top_k: int, depth: int) -> int:
    """Candidates of a tree grown to `depth` levels below the root, the root included."""
    return 1 + top_k + (depth - 1) * top_k * top_k


def new_pool(bsz: int, top_k: int, depth: int, device) -> Pool:
    p = pool_size(top_k, depth)
    return Pool(torch.empty(bsz, p, dtype=torch.int64, device=device),
                torch.empty(bsz, p, dtype=torch.float32, device=device),
                torch.empty(bsz, p, dtype=torch.int64, device=device))


@triton.jit
def _scores(ptr, mask):
    """float32 log-probs / scores at ptr, -inf where masked off or NaN."""
    x = tl.load(ptr, mask=mask, other=float("-inf")).to(tl.float32)
    return tl.where(x != x, float("-inf"), x)


@triton.jit
def _ahead(sj, j, si, i):
    """[I, J]: candidate j ranks ahead of candidate i (a higher score, or equal and earlier)."""
    return (sj[None, :] > si[:, None]) | ((sj[None, :] == si[:, None]) & (j[None, :] < i[:, None]))


@triton.jit(do_not_specialize=["P", "SIZE", "H", "M", "SR"])
def _grow_kernel(root_ptr, fs_ptr, fid_ptr, lp_ptr, tok_ptr, prev_ptr, mcur_ptr,
                 ptok_ptr, pscore_ptr, ppar_ptr, nid_ptr, nscore_ptr, ntok_ptr, feat_ptr, mnext_ptr,
                 P, SIZE, H, M, SR,
                 K: tl.constexpr, F: tl.constexpr, KP: tl.constexpr, CP: tl.constexpr, MP: tl.constexpr,
                 BLOCK_H: tl.constexpr, BJ: tl.constexpr, ROOT: tl.constexpr, LAST: tl.constexpr):
    """grid (B,): sequence b's F * K candidates into the pool at SIZE .., then (not LAST) the
    next frontier, features and mask."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CP)
    cv = c < F * K
    f = c // K  # the candidate's frontier node
    s = _scores(lp_ptr + b * (F * K) + c, cv)
    t = tl.load(tok_ptr + b * (F * K) + c, mask=cv, other=0)
    if ROOT:
        cum = s
        par = tl.zeros([CP], dtype=tl.int64)
        tl.store(ptok_ptr + b * P, tl.load(root_ptr + b * SR))  # roots: any stride (a graph's ids[:, -1])
        tl.store(pscore_ptr + b * P, 0.0)
        tl.store(ppar_ptr + b * P, -1)
    else:
        cum = tl.load(fs_ptr + b * F + f, mask=cv, other=0.0) + s
        par = tl.load(fid_ptr + b * F + f, mask=cv, other=0)
    tl.store(ptok_ptr + b * P + SIZE + c, t, mask=cv)
    tl.store(pscore_ptr + b * P + SIZE + c, cum, mask=cv)
    tl.store(ppar_ptr + b * P + SIZE + c, par, mask=cv)
    if not LAST:
        # candidate i's rank: the candidates ahead of it (higher score, or equal and earlier),
        # counted BJ candidates at a time (their scores recomputed from the inputs, the same add)
        rank = tl.zeros([CP], dtype=tl.int32)
        for j0 in tl.static_range(0, CP, BJ):
            j = j0 + tl.arange(0, BJ)
            jv = j < F * K
            sj = _scores(lp_ptr + b * (F * K) + j, jv)
            if not ROOT:
                sj = tl.load(fs_ptr + b * F + j // K, mask=jv, other=0.0) + sj
            rank += tl.sum((_ahead(sj, j, cum, c) & jv[None, :]).to(tl.int32), axis=1)
        r = tl.arange(0, KP)
        rv = r < K
        sel = (rank[None, :] == r[:, None]) & cv[None, :]  # [KP, CP]: frontier slot r holds candidate c
        ids = tl.sum(tl.where(sel, SIZE + c[None, :], 0), axis=1).to(tl.int64)
        score = tl.sum(tl.where(sel, cum[None, :], 0.0), axis=1)
        tok = tl.sum(tl.where(sel, t[None, :], 0), axis=1)
        j = tl.sum(tl.where(sel, f[None, :], 0), axis=1).to(tl.int64)  # the parent's row in prev
        tl.store(nid_ptr + b * K + r, ids, mask=rv)
        tl.store(nscore_ptr + b * K + r, score, mask=rv)
        tl.store(ntok_ptr + b * K + r, tok, mask=rv)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            ok = rv[:, None] & (hh < H)[None, :]
            x = tl.load(prev_ptr + (b * F + j)[:, None] * H + hh[None, :], mask=ok)
            tl.store(feat_ptr + (b * K + r)[:, None] * H + hh[None, :], x, mask=ok)
        col = tl.arange(0, MP)
        old = tl.load(mcur_ptr + (b * F + j)[:, None] * M + col[None, :], mask=rv[:, None] & (col < M)[None, :],
                      other=0)
        new = tl.where(col[None, :] < M, old != 0, (col[None, :] - M) == r[:, None])
        tl.store(mnext_ptr + (b * K + r)[:, None] * (M + K) + col[None, :], new,
                 mask=rv[:, None] & (col < M + K)[None, :])


@triton.jit(do_not_specialize=["P", "N"])
def _select_kernel(ptok_ptr, pscore_ptr, ppar_ptr, tok_ptr, par_ptr, rank_ptr, score_ptr, depth_ptr, mask_ptr,
                   path_ptr, at_ptr, P, N, MAX_DEPTH: tl.constexpr, NP: tl.constexpr, PP: tl.constexpr,
                   RB: tl.constexpr):
    """grid (B,): sequence b's tree of the N best candidates of its P. The pool is ranked by one
    bitonic sort of PP = pow2(P) int64 keys in registers: the score's bits made monotone as a
    signed int (-0.0 taken as 0.0) above the complement of the pool index (ties: the earlier first);
    the first NP sorted keys are the kept candidates in rank order, each one's creation position
    the count of kept ones before it in pool order. The outputs are scattered there; at_ptr
    (int32 [B, P], scratch) holds each kept candidate's position for its children's parent index,
    read after a CTA barrier (global writes are then visible to the CTA). Indices are int32 inside
    (a pool, a vocabulary: < 2^31). The P^2 comparison count it replaces took 26 µs a 265-candidate
    pool at batch 1 (the H100's 20-node step profile)."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, PP)
    iv = i < P
    si = _scores(pscore_ptr + b * P + i, iv)
    bits = tl.where(si == 0.0, 0.0, si).to(tl.int32, bitcast=True)
    mono = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = tl.where(iv, (mono << 32) | (0x7FFFFFFF - i).to(tl.int64), -9223372036854775807 - 1)
    srt = tl.sort(key, descending=True)
    top = tl.reshape(srt, (PP // NP, NP))  # row 0: the NP best, in rank order
    best = tl.sum(tl.where((tl.arange(0, PP // NP) == 0)[:, None], top, 0), axis=0)
    r = tl.arange(0, NP)
    kept = r < N
    idx = tl.where(kept, 0x7FFFFFFF - (best & 0x7FFFFFFF), 0).to(tl.int32)  # the low word: < 2^31
    # creation order: parents before children (a parent scores at least as high and comes first)
    pos = tl.sum(((idx[None, :] < idx[:, None]) & kept[None, :]).to(tl.int32), axis=1)
    ti = tl.load(ptok_ptr + b * P + idx, mask=kept, other=0)
    pi = tl.load(ppar_ptr + b * P + idx, mask=kept, other=0)
    si = _scores(pscore_ptr + b * P + idx, kept)
    tl.store(at_ptr + b * P + idx, pos, mask=kept)
    tl.store(tok_ptr + b * N + pos, ti, mask=kept)
    tl.store(par_ptr + b * N + pos, pi, mask=kept)  # the parent's pool index for now
    tl.store(rank_ptr + b * N + pos, r.to(tl.int64), mask=kept)
    tl.store(score_ptr + b * N + pos, si, mask=kept)
    tl.debug_barrier()
    # each node's parent as a tree index: the position of its (kept: it scores at least as high
    # and comes first) parent
    p = tl.arange(0, NP)
    pv = p < N
    pool_par = tl.load(par_ptr + b * N + p, mask=pv, other=-1)
    par = tl.where(pool_par >= 0, tl.load(at_ptr + b * P + pool_par, mask=pv & (pool_par >= 0), other=0), -1)
    tl.debug_barrier()
    tl.store(par_ptr + b * N + p, par.to(tl.int64), mask=pv)
    # the structure: walk RB nodes at a time up to the root, the parent list in registers
    col = tl.arange(0, NP)
    for r0 in range(0, N, RB):
        row = r0 + tl.arange(0, RB)
        ok = row < N
        a = tl.where(ok, row, -1)
        anc = (col[None, :] == a[:, None]) & ok[:, None]
        depth = tl.zeros([RB], dtype=tl.int32)
        for _ in tl.static_range(MAX_DEPTH):
            up = tl.sum(tl.where(col[None, :] == a[:, None], par[None, :], 0), axis=1)
            a = tl.where(a >= 0, up, -1)
            anc = anc | (col[None, :] == a[:, None])
            depth += (a >= 0).to(tl.int32)
        a = tl.where(ok, row, -1)
        path = tl.full([RB, NP], -1, dtype=tl.int32)
        for s in tl.static_range(MAX_DEPTH + 1):
            hit = (col[None, :] == (depth - s)[:, None]) & (a >= 0)[:, None]
            path = tl.where(hit, a[:, None], path)
            if s < MAX_DEPTH:
                up = tl.sum(tl.where(col[None, :] == a[:, None], par[None, :], 0), axis=1)
                a = tl.where(a >= 0, up, -1)
        out2 = b * N * N + row[:, None] * N + col[None, :]
        ok2 = ok[:, None] & (col < N)[None, :]
        tl.store(depth_ptr + b * N + row, depth.to(tl.int64), mask=ok)
        tl.store(mask_ptr + out2, anc, mask=ok2)
        tl.store(path_ptr + out2, path.to(tl.int64), mask=ok2)


# launched through the compiled launchers once compiled: a fused step's proposal runs eagerly
_GROW = CompiledLaunch(_grow_kernel, pointers=15, runtime=True)
_SELECT = CompiledLaunch(_select_kernel, pointers=11, runtime=True)


def tree_structure_ref(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(depths int64 [B, N], ancestor-or-self mask bool [B, N, N], root-to-node paths int64 [B, N, N],
    -1 past a node's depth) of trees given by parents int64 [B, N] (parents[b, 0] = -1, 0 <=
    parents[b, i] < i): node by node in index order (a parent precedes its children)."""
    bsz, n = parents.shape
    dev = parents.device
    mask = torch.zeros(bsz, n, n, dtype=torch.bool, device=dev)
    depths = torch.zeros(bsz, n, dtype=torch.int64, device=dev)
    paths = torch.full((bsz, n, n), -1, dtype=torch.int64, device=dev)
    rows = torch.arange(bsz, device=dev)
    for i in range(n):
        p = parents[:, i]
        has = p >= 0
        q = p.clamp_min(0)
        mask[:, i] = torch.where(has[:, None], mask[rows, q], False)
        mask[:, i, i] = True
        depths[:, i] = torch.where(has, depths[rows, q] + 1, 0)
        paths[:, i] = torch.where(has[:, None], paths[rows, q], -1)
        paths[rows, i, depths[:, i]] = i
    return depths, mask, paths


def grow_launch(f: int, k: int, m: int, h: int, root: bool, last: bool) -> tuple[dict, int]:
    """_grow_kernel's constexprs and warps for F frontier nodes of k children, a mask of m columns
    and features of h (no [CP, CP] compare: BJ candidates at a time)."""
    return dict(K=k, F=f, KP=pow2(k), CP=pow2(f * k), MP=pow2(m + k), BLOCK_H=min(pow2(h), 256),
                BJ=min(pow2(f * k), 32), ROOT=root, LAST=last), 4 if f * k <= 64 else 8


def select_launch(n: int, p: int, max_depth: int) -> tuple[dict, int]:
    """_select_kernel's constexprs and warps for trees of n nodes from pools of p."""
    np_ = pow2(n)
    # RB: structure rows walked at a time, 8 at NP = 128 (16 spilled under Triton 3.6's ptxas)
    return dict(MAX_DEPTH=min(max_depth, n - 1), NP=np_, PP=pow2(p), RB=min(16 if np_ < 128 else 8, np_)), \
        4 if np_ <= 32 else 8


def _check_pool(pool: Pool, bsz: int) -> int:
    tok, score, par = pool
    if tok.dim() != 2 or tok.shape[0] != bsz or score.shape != tok.shape or par.shape != tok.shape \
            or (tok.dtype, score.dtype, par.dtype) != (torch.int64, torch.float32, torch.int64) \
            or not all(x.is_contiguous() for x in pool):
        raise ValueError(f"pool: must be contiguous int64 / float32 / int64 [B={bsz}, P] tensors, got "
                         f"{[(x.dtype, tuple(x.shape)) for x in pool]}")
    return tok.shape[1]


def grow(pool: Pool, size: int, lp: torch.Tensor, tokens: torch.Tensor, prev: torch.Tensor, *,
         front: Optional[Frontier] = None, roots: Optional[torch.Tensor] = None, last: bool = False,
         backend: str = "auto") -> Optional[Frontier]:
    """One level of EAGLE-2 growth. lp float32 [B, F, k] / tokens int64 [B, F, k]: the draft's k
    best children (descending log-probs, <= 0) after each of the F frontier nodes whose draft
    outputs are prev [B, F, H] (the root: F = 1, front None, roots int64 [B] its tokens, prev the
    root's features). The candidates go to pool columns size .. size + F k (the root to column 0);
    returns the next Frontier, or None when last."""
    if lp.dim() != 3 or tokens.shape != lp.shape or lp.dtype != torch.float32 or tokens.dtype != torch.int64:
        raise ValueError(f"lp, tokens: must be float32 and int64 [B, F, k], got {lp.dtype} {tuple(lp.shape)} and "
                         f"{tokens.dtype} {tuple(tokens.shape)}")
    bsz, f, k = lp.shape
    p = _check_pool(pool, bsz)
    if (front is None) == (roots is None) or (roots is not None and (roots.shape != (bsz,) or roots.dtype != torch.int64
                                                                     or f != 1 or size != 1)):
        raise ValueError("grow: the root level takes roots int64 [B] (F = 1, size = 1) and no front; later levels a "
                         "front")
    if front is not None and (front.ids.shape != (bsz, f) or front.mask.shape[:2] != (bsz, f)):
        raise ValueError(f"front: must hold F={f} nodes for B={bsz}, got {tuple(front.ids.shape)}")
    if prev.dim() != 3 or prev.shape[:2] != (bsz, f):
        raise ValueError(f"prev: must be [B={bsz}, F={f}, H], got {tuple(prev.shape)}")
    if not 0 < size or size + f * k > p:
        raise ValueError(f"size={size}: the level's {f * k} candidates do not fit the pool's {p} columns")
    h = prev.shape[2]
    m = 0 if front is None else front.mask.shape[2]
    if not use_triton(backend, lp):
        return _grow_ref(pool, size, lp, tokens, prev, front, roots, last)
    dev = lp.device
    out = None if last else Frontier(torch.empty(bsz, k, dtype=torch.int64, device=dev),
                                     torch.empty(bsz, k, dtype=torch.float32, device=dev),
                                     torch.empty(bsz, k, dtype=torch.int64, device=dev),
                                     torch.empty(bsz, k, h, dtype=prev.dtype, device=dev),
                                     torch.empty(bsz, k, m + k, dtype=torch.bool, device=dev))
    if bsz:
        root = front is None
        lpc, tc, pc = lp.contiguous(), tokens.contiguous(), prev.contiguous()
        # the root level reads no frontier: the pool's pointers stand in
        fs = pool.scores if root else front.scores
        fid = pool.tokens if root else front.ids
        mcur = torch.empty(0, dtype=torch.bool, device=dev) if root else front.mask.contiguous()
        o = out or Frontier(pool.tokens, pool.scores, pool.tokens, pc, mcur)
        const, warps = grow_launch(f, k, m, h, root, last)
        ints = (p, size, h, m, roots.stride(0) if root else 0)
        _GROW((pc.dtype, warps, *const.values(), *(int_kind(v) for v in ints)), (bsz, 1, 1),
              (roots if root else pool.tokens, fs, fid, lpc, tc, pc, mcur, *pool, *o, *ints), const,
              dict(num_warps=warps))
    return out


def _grow_ref(pool, size, lp, tokens, prev, front, roots, last):
    """torch: the same level with tensor ops."""
    bsz, f, k = lp.shape
    s = lp.masked_fill(lp.isnan(), float("-inf")).reshape(bsz, f * k)
    t = tokens.reshape(bsz, f * k)
    if front is None:
        pool.tokens[:, 0], pool.scores[:, 0], pool.parents[:, 0] = roots, 0.0, -1
        cum, par = s.clone(), torch.zeros_like(t)
    else:
        cum = (front.scores[:, :, None] + s.view(bsz, f, k)).reshape(bsz, f * k)
        par = front.ids[:, :, None].expand(bsz, f, k).reshape(bsz, f * k)
    pool.tokens[:, size:size + f * k], pool.scores[:, size:size + f * k] = t, cum
    pool.parents[:, size:size + f * k] = par
    if last:
        return None
    best = torch.sort(cum, dim=1, descending=True, stable=True).indices[:, :k]
    j = best // k
    h = prev.shape[2]
    feats = prev.gather(1, j[:, :, None].expand(bsz, k, h))
    cur = torch.zeros(bsz, f, 0, dtype=torch.bool, device=lp.device) if front is None else front.mask
    old = cur.gather(1, j[:, :, None].expand(bsz, k, cur.shape[2]))
    eye = torch.eye(k, dtype=torch.bool, device=lp.device).expand(bsz, k, k)
    return Frontier(size + best, cum.gather(1, best), t.gather(1, best), feats, torch.cat([old, eye], dim=2))


def select(pool: Pool, n: int, max_depth: int, *, backend: str = "auto") -> Tree:
    """The trees of the root and the n - 1 best candidates of each sequence's pool, in creation
    order; max_depth: the levels grown (no node is deeper)."""
    bsz = pool.tokens.shape[0]
    p = _check_pool(pool, bsz)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= min(p, MAX_NODES):
        raise ValueError(f"n={n!r} is not allowed; allowed: 1 .. {min(p, MAX_NODES)} (the pool's candidates, at "
                         f"most {MAX_NODES})")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth={max_depth!r} is not allowed; allowed: an integer >= 0")
    if not use_triton(backend, pool.scores):
        return _select_ref(pool, n)
    dev = pool.tokens.device
    out = Tree(*(torch.empty(bsz, n, dtype=torch.int64, device=dev) for _ in range(3)),
               torch.empty(bsz, n, dtype=torch.float32, device=dev),
               torch.empty(bsz, n, dtype=torch.int64, device=dev),
               torch.empty(bsz, n, n, dtype=torch.bool, device=dev),
               torch.empty(bsz, n, n, dtype=torch.int64, device=dev))
    if bsz:
        const, warps = select_launch(n, p, max_depth)
        at = torch.empty(bsz, p, dtype=torch.int32, device=dev)
        _SELECT((warps, *const.values(), int_kind(p), int_kind(n)), (bsz, 1, 1), (*pool, *out, at, p, n), const,
                dict(num_warps=warps))
    return out


def _select_ref(pool: Pool, n: int) -> Tree:
    """torch: two sorts, a scatter of the kept nodes' new indices, then tree_structure_ref."""
    scores = pool.scores.masked_fill(pool.scores.isnan(), float("-inf"))
    keep = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
    keep, ranks = keep.sort(dim=1)  # creation order; each one's place in the score order
    remap = torch.full_like(pool.parents, -1)
    remap.scatter_(1, keep, torch.arange(n, device=keep.device).expand_as(keep))
    par = pool.parents.gather(1, keep)
    tree_par = torch.where(par >= 0, remap.gather(1, par.clamp_min(0)), -1)
    depths, mask, paths = tree_structure_ref(tree_par)
    return Tree(pool.tokens.gather(1, keep), tree_par, ranks, scores.gather(1, keep), depths, mask, paths)
