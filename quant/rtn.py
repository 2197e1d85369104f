"""Round-to-nearest: min-max grid per group, no search. The baseline the others must beat."""

from __future__ import annotations

import torch

from ..formats.args import QuantArgs
from ..formats.grid import quantize
from ..formats.qweight import QuantizedWeight
from . import observers
from .algorithm import Algorithm, BlockContext, BlockResult, quantize_in_place, register_algorithm


def rtn_quantize(
    w: torch.Tensor,
    args: QuantArgs,
    clip_ratio: torch.Tensor | float | None = None,
    scale_dtype: torch.dtype | None = None,
) -> QuantizedWeight:
    """Quantize a weight [N, K] to its min-max grid (optionally range-shrunk by clip_ratio).

    The scale is rounded to scale_dtype (default the weight's dtype) before the codes are
    computed, so the codes are the nearest ones on the grid the checkpoint really stores.
    """
    scale, zero = observers.minmax_qparams(w, args, clip_ratio)
    scale = scale.to(scale_dtype or w.dtype)
    q = quantize(w, scale, zero, args)
    return QuantizedWeight(q=q, scale=scale, zero=zero, args=args)


def rtn_step(ctx: BlockContext, _options: None) -> BlockResult:
    """Every linear of the block to its min-max grid; the inputs serve only the error report."""
    return quantize_in_place(ctx, lambda _name, w: rtn_quantize(w, ctx.weights, scale_dtype=ctx.scale_dtype))


register_algorithm(Algorithm("rtn", rtn_step))
