"""Min-max observer: the grid (scale, zero point) a weight's range gives, and fake quantization.

Conventions (compressed-tensors compatible): signed grid [qmin, qmax];
symmetric scale = absmax / ((qmax - qmin) / 2), zero = 0;
asymmetric scale = (max - min) / (qmax - qmin), zero = round(qmin - min / scale);
q = clamp(round(w / scale) + zero, qmin, qmax); w' = (q - zero) * scale (formats/grid.py).
Scales are computed in float32; callers cast to the checkpoint dtype.
"""

from __future__ import annotations

import torch

from ..formats.args import QuantArgs


def _grouped(w: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """[N, K] -> [N, groups, G] view (G = K for per-channel)."""
    n, k = w.shape
    g = args.groups(k)
    return w.reshape(n, g, k // g)


def qparams_from_minmax(
    wmin: torch.Tensor, wmax: torch.Tensor, args: QuantArgs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point from per-group ranges (any matching shapes).

    Returns float32 scale and int8 zero (None when symmetric).
    """
    wmin = torch.clamp(wmin.float(), max=0.0)
    wmax = torch.clamp(wmax.float(), min=0.0)
    qrange = float(args.qmax - args.qmin)
    if args.symmetric:
        scale = torch.maximum(wmin.abs(), wmax) / (qrange / 2)
        zero = None
    else:
        scale = (wmax - wmin) / qrange
    scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(torch.float16).tiny))
    if not args.symmetric:
        zero = torch.clamp(torch.round(args.qmin - wmin / scale), args.qmin, args.qmax).to(torch.int8)
    return scale, zero


def minmax_qparams(
    w: torch.Tensor, args: QuantArgs, clip_ratio: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group qparams of a weight [N, K]: scale [N, groups], zero [N, groups] or None.

    clip_ratio (scalar or [N, groups]) shrinks the observed range before the grid is set.
    """
    wmin, wmax = torch.aminmax(_grouped(w.float(), args), dim=-1)
    if clip_ratio is not None:
        wmin, wmax = wmin * clip_ratio, wmax * clip_ratio
    return qparams_from_minmax(wmin, wmax, args)


def mse_qparams(
    w: torch.Tensor,
    args: QuantArgs,
    col_weight: torch.Tensor | None = None,
    norm: float = 2.0,
    steps: int = 80,
    max_shrink: float = 0.8,
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-group qparams of a weight [N, K] whose range is shrunk, group by group, to the ratio
    of {1, 1 - 1/100, ..., 1 - (steps - 1)/100} (at least 1 - max_shrink) that minimises
    Σ_j c_j |w_j − ŵ_j|^norm over the group's columns j (c: col_weight [K], e.g. the Hessian's
    diagonal; None: all 1) -- the grid search of the GPTQ reference code's `mse` option.

    Ratio 1 (the min-max grid) is always a candidate and wins ties, so the error is never above
    min-max's. Scales are rounded to scale_dtype (the checkpoint's) before codes are chosen, as
    stored. Returns float32 scale [N, groups] and int8 zero [N, groups] (None when symmetric).
    """
    if not norm > 0:
        raise ValueError(f"norm={norm} must be > 0")
    if steps < 1 or not 0.0 <= max_shrink < 1.0:
        raise ValueError(f"steps={steps} must be >= 1 and max_shrink={max_shrink} in [0, 1)")
    wg = _grouped(w.float(), args)  # [N, g, G]
    wmin, wmax = torch.aminmax(wg, dim=-1)
    c = None if col_weight is None else _grouped(col_weight.float().reshape(1, -1), args)  # [1, g, G]
    sdt = scale_dtype or torch.float32
    best_err = best_scale = best_zero = None
    for i in range(steps):
        p = 1.0 - i / 100.0
        if p < 1.0 - max_shrink - 1e-9:
            break
        scale, zero = qparams_from_minmax(wmin * p, wmax * p, args)
        s32 = scale.to(sdt).float().unsqueeze(-1)
        q = torch.div(wg, s32).round_()
        if zero is not None:
            z = zero.unsqueeze(-1).float()
            q.add_(z).clamp_(args.qmin, args.qmax).sub_(z)
        else:
            q.clamp_(args.qmin, args.qmax)
        e = q.mul_(s32).sub_(wg).abs_().pow_(norm)
        if c is not None:
            e.mul_(c)
        err = e.sum(dim=-1)  # [N, g]
        if best_err is None:
            best_err, best_scale, best_zero = err, scale, zero
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        if zero is not None:
            best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def fake_quantize(
    w: torch.Tensor,
    args: QuantArgs,
    clip_ratio: torch.Tensor | float | None = None,
    scale_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quantize-dequantize w [N, K] with min-max qparams; float32 [N, K] (for searches and losses).

    scale_dtype is the dtype the checkpoint stores scales in: the scale is rounded to it before
    the codes are chosen, and (q - zero) * scale is taken in it, so the result equals, bit for
    bit, what rtn_quantize(w, args, clip_ratio, scale_dtype).dequantize(float32) gives (None:
    float32 scales). Works on group views (no repeat_interleave), as searches call it often.
    """
    scale, zero = minmax_qparams(w, args, clip_ratio)
    sdt = scale_dtype or torch.float32
    scale = scale.to(sdt)
    s32 = scale.float().unsqueeze(-1)
    q = torch.div(_grouped(w.float(), args), s32).round_()
    if zero is not None:
        z = zero.unsqueeze(-1).float()
        q.add_(z).clamp_(args.qmin, args.qmax).sub_(z)
    else:
        q.clamp_(args.qmin, args.qmax)
    # codes and zeros are small integers, exact in any float dtype: one rounding, in sdt
    out = q.mul_(s32) if sdt == torch.float32 else (q.to(sdt) * scale.unsqueeze(-1)).float()
    return out.reshape(w.shape)


def token_weights(rows: torch.Tensor, cap: float | None) -> torch.Tensor | None:
    """Per-token weights [T] of inputs rows [T, K] that cap a token of massive activations at
    `cap` typical ones: min(1, cap · median ‖x‖² / ‖x_t‖²) (None when cap is None: all 1).
    See gptq.HessianAccumulator for why; AWQ's searches weight their tokens the same way."""
    if cap is None:
        return None
    sq = rows.float().square().sum(dim=1)
    return (cap * sq.median() / sq.clamp_min(1e-30)).clamp(max=1.0)


def shrink_gram(gram: torch.Tensor, shrink: float) -> torch.Tensor:
    """(1 − shrink) G + shrink diag(G) of a Gram matrix G [..., K, K] (a new tensor): the inputs'
    correlations trusted less, their per-channel energies kept; shrink 1 scores each channel alone."""
    diag = torch.diagonal(gram, dim1=-2, dim2=-1)
    out = gram * (1.0 - shrink)
    torch.diagonal(out, dim1=-2, dim2=-1).copy_(diag)
    return out
