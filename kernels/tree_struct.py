"""The structure of B token trees from their parent lists, in one kernel launch: each node's
depth, the ancestor-or-self mask the verify attention reads, and the root-to-node paths
acceptance walks.

    parents int64 [B, N]: parents[b, 0] = -1 (the root), 0 <= parents[b, i] < i
    depths  int64 [B, N]: edges from the root
    mask    bool  [B, N, N]: mask[b, i, j] iff j is i or an ancestor of i
    paths   int64 [B, N, N]: paths[b, i, d] = the node at depth d on the root-to-i path, -1 past depth(i)

What runtime/spec/tree.py's TreeBatch.build computes with tensor ops (a boolean matrix squared
ceil(log2 depth) times, then a scatter: about 25 kernels inside a speculative step's CUDA graph,
each a launch). Here one program per tree walks every node up to the root at once, max_depth
steps of a gather from the parent list.

The runtime's EAGLE-2 proposal builds its trees with it on the Triton backend (runtime/spec_runner.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import pow2, use_triton

MAX_NODES = 1024


@triton.jit
def _tree_struct_kernel(par_ptr, depth_ptr, mask_ptr, path_ptr, N, MAX_DEPTH: tl.constexpr, NP: tl.constexpr):
    """grid (B,): tree b's depths [N], mask [N, N] and paths [N, N]."""
    b = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, NP)
    col = tl.arange(0, NP)
    valid = node < N
    base = par_ptr + b * N
    # walk up: a = i, parent(i), ... (-1 past the root); every node met is an ancestor-or-self
    a = tl.where(valid, node, -1).to(tl.int64)
    anc = (col[None, :] == a[:, None]) & valid[:, None]
    depth = tl.zeros([NP], dtype=tl.int64)
    for _ in tl.static_range(MAX_DEPTH):
        a = tl.load(base + a, mask=a >= 0, other=-1)
        anc = anc | (col[None, :] == a[:, None])
        depth += (a >= 0).to(tl.int64)
    # walk again: the node s steps above i sits at depth(i) - s on i's path
    a = tl.where(valid, node, -1).to(tl.int64)
    path = tl.full([NP, NP], -1, dtype=tl.int64)
    for s in tl.static_range(MAX_DEPTH + 1):
        at = (col[None, :] == (depth - s)[:, None]) & (a >= 0)[:, None]
        path = tl.where(at, a[:, None], path)
        if s < MAX_DEPTH:
            a = tl.load(base + a, mask=a >= 0, other=-1)
    out2 = b * N * N + node[:, None] * N + col[None, :]
    ok2 = valid[:, None] & (col < N)[None, :]
    tl.store(depth_ptr + b * N + node, depth, mask=valid)
    tl.store(mask_ptr + out2, anc, mask=ok2)
    tl.store(path_ptr + out2, path, mask=ok2)


def tree_struct_ref(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch: node by node in index order (a parent precedes its children)."""
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


def tree_struct(parents: torch.Tensor, max_depth: int, backend: str = "auto"):
    """(depths int64 [B, N], mask bool [B, N, N], paths int64 [B, N, N]) of trees given by parents
    int64 [B, N] (every node real: parents[b, 0] = -1, 0 <= parents[b, i] < i, not checked: no host
    sync), whose nodes are all at most max_depth deep (the caller's bound: deeper nodes come out
    wrong). backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch"."""
    if parents.dim() != 2 or parents.dtype != torch.int64 or not 0 < parents.shape[1] <= MAX_NODES:
        raise ValueError(f"parents: must be int64 [B, N] with 0 < N <= {MAX_NODES}, got {parents.dtype} "
                         f"{tuple(parents.shape)}")
    n = parents.shape[1]
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth={max_depth!r} is not allowed; allowed: an integer >= 0")
    if not use_triton(backend, parents):
        return tree_struct_ref(parents)
    bsz = parents.shape[0]
    par = parents.contiguous()
    dev = par.device
    depths = torch.empty(bsz, n, dtype=torch.int64, device=dev)
    mask = torch.empty(bsz, n, n, dtype=torch.bool, device=dev)
    paths = torch.empty(bsz, n, n, dtype=torch.int64, device=dev)
    if bsz:
        np_ = pow2(n)
        _tree_struct_kernel[(bsz,)](par, depths, mask, paths, n, MAX_DEPTH=min(max_depth, n - 1), NP=np_,
                                    num_warps=1 if np_ <= 16 else 4 if np_ <= 64 else 8)
    return depths, mask, paths
