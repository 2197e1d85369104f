"""AWQ's weight clipping search: per quantization group, the range shrink that minimises the
group's contribution to the linear's output error (the auto_clip step of the AWQ paper's code).

Every candidate ratio of a batch of output rows is scored at once. The error of a weight
change d on inputs x is a quadratic form in d, so when a group is no wider than the token
sample the search would use, it is scored through the group's Gram matrix Σ x_g x_gᵀ over all
calibration tokens (G² numbers per group, accumulated as the block runs, no activations kept):
cheaper per candidate than the sample and free of sampling noise. Wider groups (per-channel)
are scored on a strided sample of `clip_tokens` tokens, as the AWQ paper's code does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..formats.args import QuantArgs
from . import observers

if TYPE_CHECKING:
    from .awq import AWQOptions


class ClipStats:
    """What the clip search needs of a linear's inputs x [..., K]: per quantization group, the
    Gram matrix Σ x_g x_gᵀ of all tokens [groups, G, G] when a group is no wider than
    `clip_tokens`; otherwise (per-channel, wide groups) a strided sample of at most
    `clip_tokens` rows [T, K], scored directly (gram=True/False forces one or the other).
    Both score a weight change d by the same mean over tokens of (x_g · d_g)², its cross terms
    between channels scaled by 1 - shrink."""

    def __init__(self, in_features: int, args: QuantArgs, clip_tokens: int, total_tokens: int,
                 gram: bool | None = None, token_cap: float | None = None, shrink: float = 0.0) -> None:
        self.k = in_features
        self.groups = args.groups(in_features)
        self.gsize = in_features // self.groups
        self.use_gram = self.gsize <= clip_tokens if gram is None else gram
        self.clip_tokens = clip_tokens
        self.step = max(1, total_tokens // clip_tokens)
        self.tokens = 0.0  # (weighted) tokens in the Gram matrices
        self.seen = 0  # tokens passed to add()
        self.token_cap = token_cap  # observers.token_weights: each token's weight in the errors
        # the error's cross terms between channels scaled by 1 - shrink (observers.shrink_gram)
        self.shrink = shrink
        self._shrunk = False
        self.gram: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []
        self._sample: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        if self._shrunk:
            raise RuntimeError("ClipStats.add after errors(): the shrunk Gram matrices are final")
        rows = x.detach().reshape(-1, self.k).float()
        wt = observers.token_weights(rows, self.token_cap)
        if self.use_gram:
            xg = rows.reshape(-1, self.groups, self.gsize).transpose(0, 1)  # [g, T, G]
            if self.gram is None:
                self.gram = torch.zeros(self.groups, self.gsize, self.gsize, device=rows.device)
            left = xg if wt is None else xg * wt.view(1, -1, 1)
            self.gram.baddbmm_(left.transpose(1, 2), xg)
            self.tokens += rows.shape[0] if wt is None else float(wt.sum())
        else:
            offset = (-self.seen) % self.step  # continue the stride across batches
            keep = rows[offset :: self.step]
            if wt is not None:  # the sample's rows scaled by sqrt(weight): weighted squared errors
                keep = keep * wt[offset :: self.step].sqrt().unsqueeze(1)
            self.rows.append(keep)
            self._sample = None
        self.seen += rows.shape[0]

    def errors(self, d: torch.Tensor) -> torch.Tensor:
        """Mean squared output error per group of a weight change d [M, K]: [M, groups]."""
        if self.use_gram:
            if self.shrink and not self._shrunk:
                self.gram = observers.shrink_gram(self.gram, self.shrink)
                self._shrunk = True
            dg = d.reshape(-1, self.groups, self.gsize).transpose(0, 1)  # [g, M, G]
            return (torch.bmm(dg, self.gram) * dg).sum(-1).T / max(self.tokens, 1)
        if self._sample is None:
            x = torch.cat(self.rows)[: self.clip_tokens]
            self._sample = x.reshape(-1, self.groups, self.gsize).transpose(0, 1).contiguous()  # [g, T, G]
        xg = self._sample.to(d.device)
        dg = d.reshape(-1, self.groups, self.gsize).transpose(0, 1)  # [g, M, G]
        err = torch.bmm(xg, dg.transpose(1, 2)).pow(2).mean(dim=1).T
        if not self.shrink:
            return err
        energy = xg.square().mean(dim=1)  # [g, G]: the diagonal of the sample's Gram / T
        diag = (dg.square() * energy.unsqueeze(1)).sum(-1).T  # [M, g]
        return (1.0 - self.shrink) * err + self.shrink * diag


def expanded_ratios(args: QuantArgs, clip_grid: int) -> list[float]:
    """Range ratios above 1 for a symmetric grid, in steps of 1 / clip_grid up to and including
    (qmax - qmin) / 2 / qmax, where the min-max scale absmax / ((qmax - qmin) / 2) grows to
    absmax / qmax and a group's +absmax is represented exactly (on qmax); [] for asymmetric grids,
    whose min-max range already maps both ends onto the grid."""
    if not args.symmetric:
        return []
    top = (args.qmax - args.qmin) / 2 / args.qmax
    out = [1.0 + j / clip_grid for j in range(1, clip_grid) if 1.0 + j / clip_grid < top - 1e-9]
    return out + [top]


def search_clip(
    w: torch.Tensor,
    x: torch.Tensor | ClipStats,
    args: QuantArgs,
    opts: AWQOptions,
    scale_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-group range shrink ratio [N, groups] minimising the group-wise output error.

    w [N, K]; x: input rows [T, K] or their ClipStats. Each group's contribution to the output,
    x_g · w_gᵀ, is compared before and after quantization (scales rounded to scale_dtype, as the
    checkpoint stores them) with the range scaled by 1 - i/clip_grid, for i up to
    max_shrink * clip_grid (i = 0: no clipping, so the result is never worse than none), and with
    opts.clip_expand on a symmetric grid also by the ratios above 1 of ``expanded_ratios``.
    """
    n, k = w.shape
    if not isinstance(x, ClipStats):
        stats = ClipStats(k, args, opts.clip_tokens, x.reshape(-1, k).shape[0])
        stats.add(x)
        x = stats
    g = args.groups(k)
    ratios = [1.0 - i / opts.clip_grid for i in range(int(opts.max_shrink * opts.clip_grid) + 1)]
    ratios += expanded_ratios(args, opts.clip_grid) if opts.clip_expand else []
    best_ratio = torch.ones(n, g, device=w.device)
    rows = opts.clip_rows  # every ratio of this many rows is scored at once
    for r0 in range(0, n, rows):
        wr = w[r0 : r0 + rows].float()
        m = wr.shape[0]
        stacked = wr.repeat(len(ratios), 1)  # [R·m, K], ratio-major
        clip = torch.tensor(ratios, device=w.device).repeat_interleave(m).unsqueeze(1)  # [R·m, 1]
        d = observers.fake_quantize(stacked, args, clip_ratio=clip, scale_dtype=scale_dtype) - stacked
        err = x.errors(d).reshape(len(ratios), m, g)
        best = err.argmin(dim=0)  # first minimum: the least clipping among equals
        best_ratio[r0 : r0 + m] = torch.tensor(ratios, device=w.device)[best]
    return best_ratio
