"""FP8 (E4M3) W8A8: the ``fp8`` and ``fp8-dynamic`` schemes and the algorithm that finds them.

Weights: round to nearest on the E4M3 grid with one scale per output channel (or per tensor),
scale = absmax / 448 rounded to the checkpoint dtype first, values saturated to +-448 (never
NaN): what compressed-tensors' calculate_qparams + _quantize compute (formats/float_quantized.py
cites them). No search: at 3 mantissa bits plus an exponent, the grid is relative, and RTN is
what llm-compressor's FP8 presets use too.

Input activations: ``fp8-dynamic`` quantizes them per token at run time (no calibration);
``fp8`` calibrates one static per-tensor input scale per linear, absmax / 448 over every
calibration token that reaches it (compressed-tensors' "static_minmax" observer), measured
with the block's weights already quantized, as the runtime will see them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..formats.args import QuantArgs
from ..formats.float_quantized import E4M3_MAX, FloatQuantizedWeight, to_e4m3
from .algorithm import Algorithm, BlockContext, BlockResult, quantize_in_place, register_algorithm
from .scheme import QuantScheme, register_scheme
from .sequential import capture_inputs, run_block

if TYPE_CHECKING:
    from .config import QuantizeConfig

FORMAT = "float-quantized"


@dataclass(frozen=True)
class FP8Options:
    static_input: bool = False  # calibrate a static per-tensor input scale per linear


def fp8_options(config: "QuantizeConfig") -> FP8Options:
    acts = config.quant_scheme().input_activations
    return FP8Options(static_input=acts is not None and not acts.dynamic)


def _scale(amax: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """absmax / 448 in scale_dtype; a zero scale (an all-zero row) becomes the dtype's eps,
    as compressed-tensors' calculate_qparams does, so nothing divides by zero."""
    scale = (amax.float() / E4M3_MAX).to(scale_dtype)
    return torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale_dtype).eps), scale)


def fp8_quantize_weight(w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype) -> FloatQuantizedWeight:
    """A weight [N, K] to E4M3 with a scale [N, 1] (strategy "channel") or [1] ("tensor") in
    scale_dtype. The scale is rounded to scale_dtype before the values are computed, so they
    are the nearest ones on the grid the checkpoint stores; rounding may put absmax / scale
    a hair past 448, which saturates."""
    wf = w.detach().float()
    if args.strategy == "channel":
        amax = wf.abs().amax(dim=1, keepdim=True)
    elif args.strategy == "tensor":
        amax = wf.abs().amax().reshape(1)
    else:
        raise ValueError(f"FP8 weights take strategy 'channel' or 'tensor', not {args.strategy!r}")
    scale = _scale(amax, scale_dtype)
    return FloatQuantizedWeight(q=to_e4m3(wf / scale.float()), scale=scale, zero=None, args=args)


def input_absmax(ctx: BlockContext) -> dict[str, float]:
    """Per linear of the block, the largest |x| of any input element over the calibration
    inputs, the block run as it stands (its weights already quantized)."""
    amax = {n: 0.0 for n in ctx.linears}

    def add(name: str, x: torch.Tensor) -> None:
        amax[name] = max(amax[name], float(x.abs().amax()))

    with capture_inputs(ctx.linears, add):
        run_block(ctx.layer, ctx.inputs, keep=False)
    return amax


def fp8_step(ctx: BlockContext, options: FP8Options) -> BlockResult:
    """Every linear of the block to E4M3 (RTN); with static inputs, then each one's input scale."""
    result = quantize_in_place(ctx, lambda _name, w: fp8_quantize_weight(w, ctx.weights, ctx.scale_dtype))
    if options.static_input:
        amax = input_absmax(ctx)
        for name, qw in result.qweights.items():
            qw.input_scale = _scale(torch.tensor([amax[name]]), ctx.scale_dtype)
    return result


register_algorithm(Algorithm("fp8", fp8_step, options=fp8_options, rtn_baseline=False))

# compressed-tensors' FP8_DYNAMIC preset exactly; FP8 with its static per-tensor inputs but
# per-channel weights (formats/float_quantized.py says why)
_WEIGHTS = QuantArgs(num_bits=8, group_size=None, type="float", strategy="channel")
register_scheme(QuantScheme("fp8", "fp8", _WEIGHTS, QuantArgs(num_bits=8, group_size=None, type="float",
                                                               strategy="tensor"), format=FORMAT))
register_scheme(QuantScheme("fp8-dynamic", "fp8", _WEIGHTS, QuantArgs(num_bits=8, group_size=None, type="float",
                                                                       strategy="token", dynamic=True), format=FORMAT))
