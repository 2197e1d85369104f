"""Token trees for speculative decoding: static trees (Medusa) and EAGLE-2 dynamic trees.

A tree of N nodes is its parent list. Node 0 is the root: the sequence's last token, already
sampled, whose KV the verify step computes at position context_len (= num_computed_tokens).
Nodes 1..N-1 are draft tokens, each a child of an earlier node (0 <= parents[i] < i, so index
order is a topological order and a node's siblings are ordered by index). Node i sits at
position context_len + depth(i); in the verify step its KV goes to the cache slot of position
context_len + i (tree order; kernels/tree_attention.py reads it there), and the target's
logits at node i score the token that follows node i.

Attention mask: node i sees node j iff j is i or an ancestor of i (the context before the
root is visible to every node). Retrieval indices: each root-to-leaf path as node indices.

``TokenTree`` is one tree on the host (plain tuples); ``TreeBatch`` is B trees padded to one
node count as tensors, built with tensor ops only (no host sync unless asked to validate),
so an engine can build it on the device. ``StaticTree`` turns Medusa choices into a tree and
fills its tokens from the heads' top-k. EAGLE-2's dynamic trees are grown from the draft's
log-probabilities by kernels/tree_grow.py (a level's bookkeeping in one launch, the selection
and the TreeBatch's structure in one more; torch references beside them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


# --------------------------------------------------------------------------- one tree
@dataclass(frozen=True)
class TokenTree:
    """One tree's shape: parents[0] == -1 (the root), 0 <= parents[i] < i for i >= 1."""

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        p = tuple(self.parents)
        if not p or p[0] != -1:
            raise ValueError(f"parents={p!r} is not allowed; allowed: a non-empty sequence starting with -1 (the root)")
        for i, x in enumerate(p[1:], 1):
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < i:
                raise ValueError(f"parents[{i}]={x!r} is not allowed; allowed: an integer in 0..{i - 1} "
                                 "(an earlier node)")
        object.__setattr__(self, "parents", p)

    @property
    def size(self) -> int:
        return len(self.parents)

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        """Edges from the root to each node (the root: 0)."""
        d = [0] * self.size
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Each node's children in index order."""
        ch: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            ch[self.parents[i]].append(i)
        return tuple(tuple(c) for c in ch)

    @property
    def leaves(self) -> tuple[int, ...]:
        """Nodes without children, ascending (the root alone is a leaf of a one-node tree)."""
        return tuple(i for i, c in enumerate(self.children) if not c)

    def path(self, node: int) -> tuple[int, ...]:
        """Node indices from the root to ``node``, both included."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return tuple(reversed(out))

    def paths(self) -> list[tuple[int, ...]]:
        """The root-to-leaf paths, one per leaf in leaf order."""
        return [self.path(leaf) for leaf in self.leaves]

    def positions(self, context_len: int) -> list[int]:
        """Each node's position: context_len + depth."""
        return [context_len + d for d in self.depths]

    def attention_mask(self, device=None) -> torch.Tensor:
        """bool [N, N]: mask[i, j] iff j is i or an ancestor of i."""
        m = torch.zeros(self.size, self.size, dtype=torch.bool)
        for i in range(self.size):
            m[i, list(self.path(i))] = True
        return m.to(device) if device is not None else m

    def retrieval_indices(self, device=None) -> torch.Tensor:
        """int64 [num_leaves, max_depth + 1]: row r = the path to leaf r, padded with -1."""
        paths = self.paths()
        out = torch.full((len(paths), self.max_depth + 1), -1, dtype=torch.int64)
        for r, p in enumerate(paths):
            out[r, :len(p)] = torch.tensor(p)
        return out.to(device) if device is not None else out


# --------------------------------------------------------------------------- a batch of trees
@dataclass(frozen=True)
class TreeBatch:
    """B trees padded to N nodes (N = the largest). Padding nodes (index >= sizes[b]) have
    parent -1, depth 0, token 0, no mask entries, and are neither leaves nor children.

    tokens int64 [B, N] (node 0: the root token); parents int64 [B, N]; sizes int64 [B];
    depths int64 [B, N]; mask bool [B, N, N] (node i sees node j); paths int64 [B, N, N]:
    paths[b, i, d] = the node at depth d on the root-to-i path, -1 past depth(i);
    leaves bool [B, N]; first_child / next_sibling int64 [B, N] (-1: none), siblings in
    index order.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    sizes: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    paths: torch.Tensor

    # child_of, earlier_siblings, leaves, first_child, next_sibling: computed when first read
    # (greedy acceptance reads none of them, and inside a speculative step's CUDA graph every
    # tensor op is a kernel launch)
    @functools.cached_property
    def child_of(self) -> torch.Tensor:
        """bool [B, N, N]: [b, j, i] = node i is node j's child."""
        idx = const_arange(self.num_nodes, self.parents.device)
        return (self.parents[:, None, :] == idx[None, :, None]) & self.valid[:, None, :]

    @functools.cached_property
    def earlier_siblings(self) -> torch.Tensor:
        """bool [B, N, N]: [b, i, j] = node j is a sibling of node i with a lower index (padding
        nodes and the root have parent -1: no siblings)."""
        idx = const_arange(self.num_nodes, self.parents.device)
        p = self.parents
        return (p[:, :, None] == p[:, None, :]) & (p[:, :, None] >= 0) & (idx[None, None, :] < idx[None, :, None])

    @functools.cached_property
    def leaves(self) -> torch.Tensor:
        return self.valid & ~self.child_of.any(dim=-1)

    @functools.cached_property
    def first_child(self) -> torch.Tensor:
        return self._lowest(self.child_of)

    @functools.cached_property
    def next_sibling(self) -> torch.Tensor:
        return self._lowest(self.earlier_siblings.transpose(1, 2))  # [b, i, j]: j a later sibling of i

    def _lowest(self, rel: torch.Tensor) -> torch.Tensor:
        """int64 [B, N]: per node i the lowest j with rel[b, i, j], else -1."""
        n = self.num_nodes
        low = torch.where(rel, const_arange(n, rel.device)[None, None, :], n).amin(dim=-1)
        return torch.where(low < n, low, -1)

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        """N, the padded node count."""
        return self.tokens.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """bool [B, N]: real nodes."""
        return const_arange(self.num_nodes, self.sizes.device)[None, :] < self.sizes[:, None]

    def positions(self, context_lens: torch.Tensor) -> torch.Tensor:
        """int64 [B, N]: context_lens[b] + depth (padding nodes: context_lens[b])."""
        return context_lens.to(self.depths.device, torch.int64)[:, None] + self.depths

    def retrieval_indices(self, b: int) -> torch.Tensor:
        """Tree b's root-to-leaf paths, int64 [num_leaves, max_depth + 1] padded with -1 (host sync)."""
        rows = self.paths[b][self.leaves[b]]
        width = int(self.depths[b].max()) + 1
        return rows[:, :width]

    @staticmethod
    def build(tokens: torch.Tensor, parents: torch.Tensor, sizes: Optional[torch.Tensor] = None, *,
              validate: bool = True, max_depth: Optional[int] = None) -> TreeBatch:
        """A TreeBatch from tokens / parents int64 [B, N] (entries past sizes[b] are ignored;
        sizes None: all N). Tensor ops only; validate=True checks the parents (one host sync):
        parents[b, 0] == -1 and 0 <= parents[b, i] < i for 1 <= i < sizes[b]. max_depth: a bound
        the caller guarantees on every node's depth (fewer squarings of the ancestor relation)."""
        if tokens.dim() != 2 or parents.shape != tokens.shape:
            raise ValueError(f"tokens, parents: must be two [B, N] tensors, got {tuple(tokens.shape)} and "
                             f"{tuple(parents.shape)}")
        bsz, n = tokens.shape
        dev = tokens.device
        if n == 0:
            raise ValueError("tokens: a tree has at least its root (N >= 1)")
        if sizes is None:
            sizes = const_full((bsz,), n, torch.int64, dev)
        sizes = sizes.to(dev, torch.int64)
        if sizes.shape != (bsz,):
            raise ValueError(f"sizes: must have shape ({bsz},), got {tuple(sizes.shape)}")
        idx = const_arange(n, dev)
        valid = idx[None, :] < sizes[:, None]
        parents = torch.where(valid, parents.to(torch.int64), -1)
        parents[:, 0] = -1
        if validate:
            bad_size = bool(((sizes < 1) | (sizes > n)).any())
            bad_parent = bool((valid[:, 1:] & ((parents[:, 1:] < 0) | (parents[:, 1:] >= idx[None, 1:]))).any())
            if bad_size or bad_parent:
                raise ValueError("sizes, parents: allowed: 1 <= sizes[b] <= N and 0 <= parents[b, i] < i "
                                 "for 1 <= i < sizes[b]")
        tokens = torch.where(valid, tokens.to(torch.int64), 0)
        # ancestor-or-self: the reflexive-transitive closure of "j is i's parent" by squaring
        # (ceil(log2 N) boolean products; 0/1 sums <= N are exact in float32 and TF32)
        eye = const_eye(n, dev)
        reach = (eye[None] & valid[:, :, None]) | ((idx[None, None, :] == parents[:, :, None])
                                                   & (parents[:, :, None] >= 0))
        span, reach_depth = 1, n - 1 if max_depth is None else min(n - 1, max_depth)
        while span < reach_depth:
            r = reach.float()
            reach = torch.bmm(r, r) > 0
            span *= 2
        mask = reach
        depths = mask.sum(dim=-1) - valid.long()
        # paths[b, i, depth(j)] = j for every j on i's path; the rest -1 (dumped into column N)
        col = torch.where(mask, depths[:, None, :], n)
        vals = torch.where(mask, idx[None, None, :], -1)
        paths = torch.full((bsz, n, n + 1), -1, dtype=torch.int64, device=dev)
        paths.scatter_(2, col, vals)
        paths = paths[:, :, :n]
        return TreeBatch(tokens, parents, sizes, depths, mask, paths)

    @staticmethod
    def from_trees(trees: Sequence[TokenTree], tokens: Sequence[Sequence[int]], device=None) -> TreeBatch:
        """B host trees (sizes may differ) with their node tokens (tokens[b] has trees[b].size
        entries, the root's first), padded to the largest."""
        if not trees or len(tokens) != len(trees):
            raise ValueError(f"trees, tokens: need one token list per tree and at least one tree, got "
                             f"{len(trees)} trees and {len(tokens)} token lists")
        n = max(t.size for t in trees)
        tok = torch.zeros(len(trees), n, dtype=torch.int64)
        par = torch.full((len(trees), n), -1, dtype=torch.int64)
        for b, (t, ids) in enumerate(zip(trees, tokens)):
            ids = list(ids) if not isinstance(ids, torch.Tensor) else ids.tolist()
            if len(ids) != t.size:
                raise ValueError(f"tokens[{b}]: {len(ids)} tokens for a tree of {t.size} nodes")
            tok[b, :t.size] = torch.tensor(ids, dtype=torch.int64)
            par[b, :t.size] = torch.tensor(t.parents, dtype=torch.int64)
        sizes = torch.tensor([t.size for t in trees], dtype=torch.int64)
        if device is not None:
            tok, par, sizes = tok.to(device), par.to(device), sizes.to(device)
        return TreeBatch.build(tok, par, sizes, validate=False)


# --------------------------------------------------------------------------- Medusa
@dataclass(frozen=True)
class StaticTree:
    """A static tree from Medusa-style choices: each choice is a path of top-k ranks, element d
    being the rank among head d's top-k (head d drafts depth d + 1). Nodes are the root plus
    one per choice, sorted by (length, path) as Medusa orders them; every prefix of a choice
    must be a choice too (its parent).

    tree: the shape; choices: per node its path (the root: ())."""

    tree: TokenTree
    choices: tuple[tuple[int, ...], ...]

    @staticmethod
    def from_choices(choices: Sequence[Sequence[int]]) -> StaticTree:
        paths = []
        for c in choices:
            c = tuple(c)
            if not c or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in c):
                raise ValueError(f"choices: {c!r} is not allowed; allowed: a non-empty path of top-k ranks >= 0")
            paths.append(c)
        if len(set(paths)) != len(paths):
            raise ValueError("choices: a path appears twice; allowed: distinct paths")
        ordered = [()] + sorted(paths, key=lambda c: (len(c), c))
        index = {c: i for i, c in enumerate(ordered)}
        parents = [-1]
        for c in ordered[1:]:
            if c[:-1] not in index:
                raise ValueError(f"choices: {c!r} has no parent {c[:-1]!r}; allowed: every prefix of a path is a path")
            parents.append(index[c[:-1]])
        return StaticTree(TokenTree(tuple(parents)), tuple(ordered))

    @property
    def num_heads(self) -> int:
        """Heads the tree reads: its depth."""
        return self.tree.max_depth

    @property
    def top_k(self) -> int:
        """Top-k entries the tree reads per head: 1 + the largest rank."""
        return 1 + max((r for c in self.choices for r in c), default=-1)

    def tokens(self, root_tokens: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """int64 [B, N] node tokens: the root's from root_tokens [B], node i at depth d >= 1
        from topk_ids [B, heads, K][:, d - 1, its last rank] (heads >= num_heads, K >= top_k)."""
        if topk_ids.dim() != 3 or topk_ids.shape[0] != root_tokens.shape[0] \
                or topk_ids.shape[1] < self.num_heads or topk_ids.shape[2] < self.top_k:
            raise ValueError(f"topk_ids: must be [B={root_tokens.shape[0]}, heads >= {self.num_heads}, "
                             f"K >= {self.top_k}], got {tuple(topk_ids.shape)}")
        k = topk_ids.shape[2]
        flat = _const(tuple((len(c) - 1) * k + c[-1] for c in self.choices[1:]), topk_ids.device)
        drafts = topk_ids.reshape(topk_ids.shape[0], -1).index_select(1, flat)
        return torch.cat([root_tokens.to(topk_ids.device, torch.int64)[:, None], drafts.long()], dim=1)

    def batch(self, root_tokens: torch.Tensor, topk_ids: torch.Tensor) -> TreeBatch:
        """The TreeBatch of B copies of this tree with tokens as ``tokens`` gives them; the shape's
        tensors are built once per device and shared, expanded over B (never write into them)."""
        tok = self.tokens(root_tokens, topk_ids)
        one = _static_structure(self.tree.parents, tok.device)
        bsz = tok.shape[0]
        par, depths, mask, paths = (t.expand(bsz, *t.shape[1:]) for t in (one.parents, one.depths, one.mask,
                                                                          one.paths))
        return TreeBatch(tok, par, const_full((bsz,), self.tree.size, torch.int64, tok.device), depths, mask, paths)


@functools.lru_cache(maxsize=64)
def _static_structure(parents: tuple, device: torch.device) -> TreeBatch:
    """One static tree's TreeBatch (tokens unused), made once per device: a Medusa step rebuilt
    it every step, some 25 kernels inside its CUDA graph."""
    par = torch.tensor([parents], dtype=torch.int64, device=device)
    return TreeBatch.build(torch.zeros_like(par), par, validate=False)


@functools.lru_cache(maxsize=512)
def _const(values: tuple, device: torch.device) -> torch.Tensor:
    """An int64 tensor of fixed values, made once per device (no host copy inside a graph capture)."""
    return torch.tensor(values, dtype=torch.int64, device=device)


# Constants of a speculative step, made once per (shape, device) and shared: inside a CUDA graph
# every torch.arange / eye / full is a kernel launch, and a step's cost is its launches' count
# (the warm-up run before each capture makes them outside it). Shared: never write into them.
@functools.lru_cache(maxsize=1024)
def const_arange(n: int, device: torch.device, dtype: torch.dtype = torch.int64, start: int = 0,
                 step: int = 1) -> torch.Tensor:
    """start, start + step, ... (n values)."""
    return torch.arange(n, device=device, dtype=dtype) * step + start


@functools.lru_cache(maxsize=256)
def const_full(shape: tuple, value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype, device=device)


@functools.lru_cache(maxsize=64)
def const_eye(n: int, device: torch.device) -> torch.Tensor:
    return torch.eye(n, dtype=torch.bool, device=device)
