"""Acceptance of a verified token tree: which draft tokens the target keeps, plus one token of
its own, for B sequences at once.

The verify step gives the target's logits at every node (row i scores the token after node
i; tree.py describes the layout). Both rules return the accepted path (root first), the
accepted draft tokens and one final token, so every step emits num_accepted + 1 tokens.

Greedy: the longest root-to-leaf path whose every draft token equals the target's argmax at
its parent; the final (bonus) token is the argmax at the path's last node. Ties between
equally long paths go to the lowest-index node.

Lossless (rejection sampling over the tree, SpecInfer / EAGLE style): from the root, try the
node's children in index order; accept child x with probability min(1, p(x) / q(x)) and move
down to it (p <- the target's distribution there); on rejection p <- norm(max(p - q, 0)) and
try the next sibling; when no child is left, the final token is drawn from p. Two draft
models are allowed:
  * draft_probs given: node i's children were drawn from draft_probs[i] without replacement,
    in index order. q for the k-th child is draft_probs[i] with the k - 1 earlier siblings
    removed and renormalised (recursive rejection sampling: the draw of child k is
    conditioned on the earlier ones, so its proposal is that conditional distribution).
  * draft_probs None: the children are any candidates fixed before the target's coins (top-k
    drafts as in Medusa / EAGLE-2, or samples whose q is unknown): q is the point mass on the
    candidate, so x is accepted with probability p(x) and a rejection removes x from p.
Either way each emitted token has exactly the target's distribution given the tokens before
it. Target probabilities come from ``target_probs``: temperature, min_p, top_k, top_p as
runtime/sampler.py applies them (greedy rows: the point mass on the argmax, which makes the
rejection rule the greedy rule). Penalties depend on the tokens along each path and are not
applied here (``target_probs`` refuses them); min_tokens bans must already be in the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..sampler import _kth_largest
from ..sampling_params import GREEDY_EPS, SamplingParams
from .tree import TreeBatch, const_arange


@dataclass(frozen=True)
class AcceptResult:
    """accepted int64 [B, N]: the accepted path's node indices, root first, -1 after it;
    num_accepted int64 [B]: draft tokens accepted (the path's length - 1); tokens int64
    [B, N]: the accepted draft tokens, then the final token, then -1."""

    accepted: torch.Tensor
    num_accepted: torch.Tensor
    tokens: torch.Tensor
    # the three (and the menu's per-size acceptance, where the step computed it) as the host reads
    # them back: int64 [B, 1 + 2N (+ S)], kernels/spec_accept.py's layout (None: not made yet)
    packed: torch.Tensor | None = None

    @property
    def num_tokens(self) -> torch.Tensor:
        """int64 [B]: tokens the step emits (num_accepted + 1)."""
        return self.num_accepted + 1


def _result(tree: TreeBatch, accepted: torch.Tensor, num: torch.Tensor, final: torch.Tensor) -> AcceptResult:
    """Tokens from the accepted path (root first, -1 padded), its draft count and the final token."""
    n = tree.num_nodes
    path_tok = tree.tokens.gather(1, accepted.clamp_min(0))
    tokens = torch.cat([path_tok[:, 1:], torch.zeros_like(path_tok[:, :1])], dim=1)
    col = const_arange(n, tokens.device)[None, :]
    tokens = torch.where(col == num[:, None], final[:, None], tokens)
    tokens = torch.where(col > num[:, None], -1, tokens)
    return AcceptResult(accepted, num, tokens)


def greedy_accept(tree: TreeBatch, target_ids: torch.Tensor) -> AcceptResult:
    """Greedy verification. target_ids int64 [B, N]: the target's greedy token at each node
    (logits.argmax(-1), as the sampler takes it: ties to the lowest id)."""
    if target_ids.shape != tree.tokens.shape:
        raise ValueError(f"target_ids: must be [B, N] = {tuple(tree.tokens.shape)}, got {tuple(target_ids.shape)}")
    target_ids = target_ids.to(tree.tokens.device, torch.int64)
    valid = tree.valid
    matched = tree.tokens == target_ids.gather(1, tree.parents.clamp_min(0))
    matched[:, 0] = True
    matched &= valid
    ok = valid & ~(tree.mask & ~matched[:, None, :]).any(dim=-1)  # every node on the path matched
    best = torch.where(ok, tree.depths, -1).argmax(dim=1)  # the deepest; ties: the lowest index
    rows = const_arange(tree.batch_size, best.device)
    accepted = tree.paths[rows, best]
    return _result(tree, accepted, tree.depths[rows, best], target_ids[rows, best])


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) per row; rows whose residual has no mass (only by rounding) keep p."""
    r = (p - q).clamp_min_(0.0)
    s = r.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, r / torch.where(s > 0, s, 1.0), p)


def _without(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q with token x [B] removed and renormalised (the next draw without replacement)."""
    q = q.scatter(1, x[:, None], 0.0)
    s = q.sum(dim=-1, keepdim=True)
    return torch.where(s > 0, q / torch.where(s > 0, s, 1.0), q)


def rejection_accept(tree: TreeBatch, target_probs: torch.Tensor, draft_probs: Optional[torch.Tensor] = None, *,
                     generator: Optional[torch.Generator] = None) -> AcceptResult:
    """Lossless verification by rejection sampling over the tree (see the module docstring).

    target_probs float [B, N, V]: the target's distribution after each node (``target_probs``);
    draft_probs float [B, N, V] or None; generator: the source of every random draw (on the
    tensors' device), so equal generator states give equal results. Work: N - 1 vectorised
    steps over the batch (a node is tried at most once).
    """
    bsz, n = tree.tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (bsz, n):
        raise ValueError(f"target_probs: must be [B, N, V] with B, N = {bsz}, {n}, got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs: must match target_probs {tuple(target_probs.shape)}, got "
                         f"{tuple(draft_probs.shape)}")
    dev = target_probs.device
    rows = torch.arange(bsz, device=dev)
    tokens = tree.tokens.to(dev)
    coins = torch.rand(bsz, n, generator=generator, device=dev, dtype=torch.float64)
    if draft_probs is None:
        return _point_mass_accept(tree, tokens, target_probs, coins, generator)
    first_child, next_sibling = tree.first_child.to(dev), tree.next_sibling.to(dev)
    p = target_probs[:, 0].float()
    q = draft_probs[:, 0].float() if draft_probs is not None else None
    child = first_child[:, 0]
    depth = torch.zeros(bsz, dtype=torch.int64, device=dev)
    accepted = torch.full((bsz, n), -1, dtype=torch.int64, device=dev)
    accepted[:, 0] = 0
    for _ in range(n - 1):
        active = child >= 0
        c = child.clamp_min(0)
        x = tokens[rows, c]
        px = p[rows, x].double()
        if q is None:
            ratio = px
        else:
            qx = q[rows, x].double()
            ratio = torch.where(qx > 0, px / torch.where(qx > 0, qx, 1.0), torch.where(px > 0, math.inf, 0.0))
        acc = active & (coins[rows, c] < ratio)
        rej = active & ~acc
        # rejected: the residual, and the next sibling (drawn without x)
        q_x = torch.nn.functional.one_hot(x, p.shape[1]).to(p.dtype) if q is None else q
        p = torch.where(rej[:, None], _residual(p, q_x), p)
        if q is not None:
            q = torch.where(rej[:, None], _without(q, x), q)
        nxt = torch.where(rej, next_sibling[rows, c], child)
        # accepted: down to x's children, under the target's (and draft's) distribution at x
        depth = depth + acc.long()
        accepted[rows, depth] = torch.where(acc, c, accepted[rows, depth])
        p = torch.where(acc[:, None], target_probs[rows, c].float(), p)
        if q is not None:
            q = torch.where(acc[:, None], draft_probs[rows, c].float(), q)
        child = torch.where(acc, first_child[rows, c], torch.where(active, nxt, -1))
    return _result(tree, accepted, depth, draw(p, generator))


def _point_mass_accept(tree: TreeBatch, tokens: torch.Tensor, target_probs: torch.Tensor, coins: torch.Tensor,
                       generator: Optional[torch.Generator]) -> AcceptResult:
    """rejection_accept without draft probabilities, in closed form over the whole tree at once
    (a fixed number of tensor ops, no loop over nodes: the sampling step runs eagerly, where
    every op is a launch). With q the point mass on each candidate, a node's children are tried
    in index order and child i (token x_i, distinct from its earlier siblings') is accepted with
    probability p(x_i) / (1 - sum_{j < i} p(x_j)) once the earlier ones were rejected: the
    sequential rule's p after those rejections, renormalised; a repeated token has p 0 there.
    Each node draws its own coin, as the sequential walk does, so a node's fate is fixed before
    the walk: the accepted path is the longest root path whose every node is its parent's first
    accepted child, and the final token is drawn from its last node's p with every child's token
    removed (the residual of rejecting them all; a leaf keeps p)."""
    bsz, n = tokens.shape
    dev = tokens.device
    idx, rows = const_arange(n, dev), const_arange(bsz, dev)
    parents, valid = tree.parents.to(dev), tree.valid.to(dev)
    # p at the parent for each node's token (the root: unused)
    px = target_probs[rows[:, None], parents.clamp_min(0), tokens].double()
    # a token an earlier sibling had is a repeat
    sib = tree.earlier_siblings.to(dev)
    repeat = (sib & (tokens[:, :, None] == tokens[:, None, :])).any(dim=-1)
    before = (sib & ~repeat[:, None, :]).double() @ px[:, :, None]
    rest = 1.0 - before[:, :, 0]
    ratio = torch.where(repeat | (rest <= 0), 0.0, px / torch.where(rest > 0, rest, 1.0))
    accepted_node = valid & (parents >= 0) & (coins < ratio)
    # each node's first accepted child, then the nodes every ancestor of which is that child
    child_of = tree.child_of.to(dev)  # [b, u, c]: c is u's child
    first = torch.where(child_of & accepted_node[:, None, :], idx[None, None, :], n).amin(dim=-1)
    chosen = first.gather(1, parents.clamp_min(0)) == idx[None, :]
    chosen[:, 0] = True
    on_path = valid & ~(tree.mask.to(dev) & ~chosen[:, None, :]).any(dim=-1)
    depths = tree.depths.to(dev)
    best = torch.where(on_path, depths, -1).argmax(dim=1)  # the path is a chain: one node per depth
    accepted = tree.paths.to(dev)[rows, best]
    # the last node's children all rejected (or none): the residual without their tokens
    v = target_probs.shape[2]
    kids = child_of[rows, best]  # [B, N]
    hot = torch.zeros(bsz, v + 1, dtype=target_probs.dtype, device=dev)
    hot.scatter_(1, torch.where(kids, tokens, v), 1.0)
    p = _residual(target_probs[rows, best].float(), hot[:, :v].float())
    return _result(tree, accepted, depths[rows, best], draw(p, generator))


def draw(p: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """int64 [B]: one token per row of probabilities p [B, V] (rows need not be normalised), by
    the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. picks i with probability
    p_i / sum(p) (E_i / p_i ~ Exp(p_i), and the least of independent exponentials is i with
    probability its rate's share). Unlike torch.multinomial it is a fixed pair of kernels with
    no host sync, so it can run inside a CUDA graph (from the default generator there)."""
    e = torch.empty_like(p, dtype=torch.float32).exponential_(generator=generator)
    return (p.float() / e.clamp_min_(1e-30)).argmax(dim=-1)


def sampling_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """float32 [B, N, V]: the logits [B, N, V] at the tree nodes of B sequences as the sampler
    races them for params[b]: divided by the temperature, then min_p, top_k and top_p masked
    to -inf by value (ties with the cut-off stay), stage for stage as runtime/sampler.py.
    Greedy rows (temperature < GREEDY_EPS) pass unchanged. Penalties are refused (ValueError):
    they depend on each path's tokens."""
    if logits.dim() != 3 or logits.shape[0] != len(params) or not logits.is_floating_point():
        raise ValueError(f"logits: must be a float [B={len(params)}, N, V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    bsz, n, v = logits.shape
    for b, p in enumerate(params):
        if p.uses_penalties:
            raise ValueError(f"params[{b}]: penalties are not allowed under speculation (they depend on "
                             "the path's tokens); allowed: repetition_penalty 1, presence and frequency 0")
    dev = logits.device
    greedy = [p.temperature < GREEDY_EPS for p in params]
    temp = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
    log_min_p = [-math.inf if g or p.min_p <= 0 else math.log(p.min_p) for g, p in zip(greedy, params)]
    top_p = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
    top_k = [0 if g or p.top_k >= v else p.top_k for g, p in zip(greedy, params)]

    def per_row(vals) -> torch.Tensor:
        return torch.tensor(vals, dtype=torch.float32, device=dev).repeat_interleave(n)

    x = logits.reshape(bsz * n, v).float().clone()
    if any(t != 1.0 for t in temp):
        x.div_(per_row(temp)[:, None])
    if any(m > -math.inf for m in log_min_p):  # p < min_p * p_max  <=>  logit < max logit + log(min_p)
        x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + per_row(log_min_p)[:, None], -math.inf)
    if any(t < 1.0 for t in top_p):  # one sort serves top_k and top_p
        k = per_row(top_k)
        sx = x.sort(dim=-1, descending=True).values
        kth = _kth_largest(sx, k) if any(top_k) else None
        if kth is not None:
            sx.masked_fill_(sx < kth, -math.inf)
        probs = sx.softmax(dim=-1)
        before = probs.cumsum(dim=-1).sub_(probs)  # mass of the more likely tokens
        tp = per_row(top_p)
        n_keep = (before < torch.where(tp < 1.0, tp, math.inf)[:, None]).sum(dim=-1, keepdim=True)
        last = sx.gather(1, n_keep - 1)
        x.masked_fill_(x < (last if kth is None else torch.maximum(last, kth)), -math.inf)
    elif any(top_k):
        kth = _kth_largest(torch.topk(x, max(top_k), dim=-1).values, per_row(top_k))
        x.masked_fill_(x < kth, -math.inf)
    return x.view(bsz, n, v)


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """float32 probabilities [B, N, V] the sampler would draw from: softmax of
    ``sampling_logits``; greedy rows give the point mass on the argmax (ties: lowest id)."""
    x = sampling_logits(logits, params)
    probs = x.softmax(dim=-1)
    greedy = [p.temperature < GREEDY_EPS for p in params]
    if any(greedy):
        probs = _greedy_rows(torch.tensor(greedy, device=logits.device)[:, None, None], logits, probs)
    return probs


def _greedy_rows(greedy: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """probs [B, N, V] with the rows where greedy (bool, broadcastable) holds replaced by the point
    mass on the argmax of logits (ties: lowest id), as the sampler takes it."""
    # (scattered into float zeros: one_hot wrote an int64 [B, N, V] and a float copy of it, 12 bytes
    # an entry where this writes 4, one kernel less in every sampled speculative step's graph)
    hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy, hot, probs)


def accepted_per_size(accepted: torch.Tensor, ranks: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """int64 [B, S]: the draft tokens a tree of the first m ranks would have accepted, for each m
    in sizes (int64 [S]), from one verify of the whole tree. accepted int64 [B, N]: the accepted
    path (``AcceptResult.accepted``); ranks int64 [B, N]: each node's rank (the root 0), such
    that the nodes of rank < m form a tree (every parent ranked before its children). Under
    greedy acceptance this is exact -- at most one child of a node matches the target's argmax,
    so the smaller tree accepts the same path cut at its first node of rank >= m; under
    rejection sampling it is an estimate. Tensor ops with no host value (a speculative step's
    CUDA graph computes it, and its read-back carries [B, S] numbers; on the host, numpy's
    per-call cost made it ~20 µs of every step at batch 1 on the CPU machine): the path's
    running maximum rank, counted below each m, off-path entries ranked past every m."""
    path = accepted[:, 1:]
    r = ranks.gather(1, path.clamp_min(0)).masked_fill(path < 0, torch.iinfo(torch.int64).max)
    return (r.cummax(dim=1).values.unsqueeze(-1) < sizes).sum(dim=1)
