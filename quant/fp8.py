"""FP8 (E4M3) W8A8: the ``fp8`` and ``fp8-dynamic`` schemes and the algorithm that finds them.

Weights: one scale per output channel (or per tensor), scale = absmax / 448 rounded to the
checkpoint dtype first, values saturated to +-448 (never NaN): what compressed-tensors'
calculate_qparams + _quantize compute (formats/float_quantized.py cites them). The values are
the nearest E4M3 ones (RTN, the default; what llm-compressor's FP8 presets use) or, with
``fp8: {weights: gptq}`` (a recipe's steps: ``[gptq: {...}]`` under an fp8 scheme, as
llm-compressor's GPTQModifier takes an FP8 scheme), GPTQ's on the same E4M3 grid: each
column's rounding error pushed onto the columns not yet rounded through the inverse Hessian
of the layer's inputs (quant/gptq.py), columns visited by decreasing activation energy. The
grid (the scales) is the same either way, so the checkpoint is too: only the E4M3 values move.

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
from ..formats.float_quantized import FloatQuantizedWeight, fp8_scale, to_e4m3
from .algorithm import Algorithm, BlockContext, BlockResult, quantize_in_place, register_algorithm
from .gptq import GPTQOptions, gptq_per_channel_step
from .scheme import QuantScheme, register_scheme
from .sequential import capture_inputs, run_block

if TYPE_CHECKING:
    from .config import QuantizeConfig

FORMAT = "float-quantized"


WEIGHT_ALGORITHMS = ("rtn", "gptq")


@dataclass(frozen=True)
class FP8Options:
    """QuantizeConfig.fp8 (a recipe's ``fp8:`` mapping)."""

    weights: str = "rtn"  # the weight quantizer on the E4M3 grid: "rtn" or "gptq" (the run's GPTQ options)

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_ALGORITHMS:
            raise ValueError(f"fp8.weights={self.weights!r} is not allowed; allowed: {', '.join(WEIGHT_ALGORITHMS)}")


@dataclass(frozen=True)
class FP8Step:
    """What the block step needs from the run: the FP8 options, whether the inputs are static
    (calibrated input scales), and GPTQ's options (used when fp8.weights is gptq)."""

    fp8: FP8Options
    static_input: bool
    gptq: GPTQOptions


def fp8_options(config: "QuantizeConfig") -> FP8Step:
    return FP8Step(config.fp8, config.static_inputs(), GPTQOptions.from_config(config))


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
    scale = fp8_scale(amax, scale_dtype)
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


def fp8_step(ctx: BlockContext, opts: FP8Step) -> BlockResult:
    """Every linear of the block to E4M3 (RTN, or GPTQ on the same grid); with static inputs,
    then each one's input scale."""
    if opts.fp8.weights == "gptq":
        result = gptq_per_channel_step(ctx, opts.gptq)
    else:
        result = quantize_in_place(ctx, lambda _name, w: fp8_quantize_weight(w, ctx.weights, ctx.scale_dtype))
    if opts.static_input:
        amax = input_absmax(ctx)
        for name, qw in result.qweights.items():
            qw.input_scale = fp8_scale(torch.tensor([amax[name]]), ctx.scale_dtype)
    return result


register_algorithm(Algorithm("fp8", fp8_step, options=fp8_options, rtn_baseline=False))

# compressed-tensors' FP8_DYNAMIC preset exactly; FP8 with its static per-tensor inputs but
# per-channel weights (formats/float_quantized.py says why)
_WEIGHTS = QuantArgs(num_bits=8, group_size=None, type="float", strategy="channel")
register_scheme(QuantScheme("fp8", "fp8", _WEIGHTS, QuantArgs(num_bits=8, group_size=None, type="float",
                                                               strategy="tensor"), format=FORMAT))
register_scheme(QuantScheme("fp8-dynamic", "fp8", _WEIGHTS, QuantArgs(num_bits=8, group_size=None, type="float",
                                                                       strategy="token", dynamic=True), format=FORMAT))
