"""The integer grid of a quantized tensor: codes to floats and back.

Conventions (compressed-tensors compatible): signed grid [qmin, qmax], one scale (and, when
asymmetric, one zero point) per group of columns;
q = clamp(round(w / scale) + zero, qmin, qmax); w' = (q - zero) * scale.
"""

from __future__ import annotations

import torch

from .args import QuantArgs


def expand_groups(t: torch.Tensor, in_features: int) -> torch.Tensor:
    """[N, groups] -> [N, K] by repeating each group's value over its columns."""
    return t.repeat_interleave(in_features // t.shape[1], dim=1)


def quantize(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, args: QuantArgs
) -> torch.Tensor:
    """Weight [N, K] -> int8 codes [N, K] in [qmin, qmax]. scale/zero are [N, groups]."""
    k = w.shape[1]
    s = expand_groups(scale.float(), k)
    q = torch.round(w.float() / s)
    if zero is not None:
        q = q + expand_groups(zero.float(), k)
    return torch.clamp(q, args.qmin, args.qmax).to(torch.int8)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """int8 codes [N, K] -> float weight (q - zero) * scale, in dtype (default scale's dtype).

    The product is taken in the scale's own dtype, as compressed-tensors and vLLM do, so a
    checkpoint dequantizes to the same bits everywhere.
    """
    k = q.shape[1]
    s = expand_groups(scale, k)
    qf = q.to(s.dtype)
    if zero is not None:
        qf = qf - expand_groups(zero, k).to(s.dtype)
    out = qf * s
    return out if dtype is None else out.to(dtype)
