"""NVFP4: the ``nvfp4`` (W4A4) and ``nvfp4a16`` (W4A16) schemes and the algorithm that finds them.

Weights: round to nearest (ties to even) on the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} in groups
of 16 along K; a group's scale is global * group_amax / 6 rounded to E4M3, the global scale
448 * 6 / the weight's absmax: compressed-tensors' generate_gparam + calculate_qparams + its
FP4 packer, bit for bit (kernels/nvfp4_format.py quantize_nvfp4; formats/nvfp4_quantized.py
cites them). Linears that share an input (q/k/v, gate/up: the architecture's balance groups),
which vLLM and our runtime fuse into one GEMM, share one global scale, their common absmax's:
vLLM keeps one global scale per fused layer (it takes the max of the shards' otherwise), and
llm-compressor fuses them the same way. No search: as with FP8, llm-compressor's NVFP4 presets
round to nearest.

Input activations (``nvfp4``): E4M3 scales per 16 values at run time (compressed-tensors'
dynamic "local") under one calibrated global scale per linear, 448 * 6 / the largest |x| over
every calibration token reaching it (the "static_minmax" observer), measured with the block's
weights already quantized, as the runtime will see them. ``nvfp4a16`` leaves them in floating
point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..formats.args import LOCAL, QuantArgs
from ..formats.nvfp4_quantized import NVFP4QuantizedWeight
from ..kernels.nvfp4_format import GROUP, nvfp4_global_scale, quantize_nvfp4
from .algorithm import Algorithm, BlockContext, BlockResult, quantize_in_place, register_algorithm
from .fp8 import input_absmax
from .scheme import QuantScheme, register_scheme

if TYPE_CHECKING:
    from .config import QuantizeConfig

NAME = "nvfp4"
FORMAT = "nvfp4-pack-quantized"


@dataclass(frozen=True)
class NVFP4Options:
    calibrate_input: bool = False  # W4A4: calibrate each linear's input global scale


def nvfp4_options(config: "QuantizeConfig") -> NVFP4Options:
    return NVFP4Options(calibrate_input=config.quant_scheme().input_activations is not None)


def nvfp4_quantize_weight(w: torch.Tensor, args: QuantArgs,
                          global_scale: torch.Tensor | None = None) -> NVFP4QuantizedWeight:
    """A weight [N, K] (K % 16 == 0) to NVFP4: packed codes uint8 [N, K/2], E4M3 scales
    [N, K/16] and a float32 global scale [1], the weight's own (448 * 6 / absmax) or the given one."""
    packed, scales, g = quantize_nvfp4(w.detach().float(), global_scale)
    return NVFP4QuantizedWeight(q=packed, scale=scales, zero=None, args=args, global_scale=g)


def fused_groups(ctx: BlockContext) -> list[tuple[str, ...]]:
    """The block's linears (to quantize) grouped by shared input: each smoothing pair's balance
    linears (q/k/v, gate/up), then every other linear alone."""
    groups: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for pair in ctx.mapping.smooth:
        members = tuple(n for n in pair.balance if n in ctx.linears and n not in seen)
        if len(members) > 1:
            groups.append(members)
            seen.update(members)
    return groups + [(n,) for n in ctx.linears if n not in seen]


def shared_global_scales(ctx: BlockContext) -> dict[str, torch.Tensor]:
    """Per linear, the float32 [1] global scale of its fused group: 448 * 6 / the group's absmax."""
    out = {}
    for group in fused_groups(ctx):
        amax = torch.stack([ctx.linears[n].weight.detach().abs().amax().float().cpu() for n in group]).amax()
        out.update({n: nvfp4_global_scale(amax) for n in group})
    return out


def nvfp4_step(ctx: BlockContext, options: NVFP4Options) -> BlockResult:
    """Every linear of the block to NVFP4 (RTN, global scales shared within fused groups);
    W4A4: then each one's input global scale."""
    shared = shared_global_scales(ctx)
    result = quantize_in_place(ctx, lambda name, w: nvfp4_quantize_weight(w, ctx.weights, shared[name]))
    if options.calibrate_input:
        amax = input_absmax(ctx)
        for name, qw in result.qweights.items():
            qw.input_global_scale = nvfp4_global_scale(torch.tensor(amax[name]))
    return result


register_algorithm(Algorithm(NAME, nvfp4_step, options=nvfp4_options, rtn_baseline=False))

# compressed-tensors' presets NVFP4 and NVFP4A16, field for field (formats/nvfp4_quantized.py)
_WEIGHTS = QuantArgs(num_bits=4, group_size=GROUP, type="float", strategy="tensor_group")
register_scheme(QuantScheme("nvfp4", NAME, _WEIGHTS, QuantArgs(num_bits=4, group_size=GROUP, type="float",
                                                               strategy="tensor_group", dynamic=LOCAL), format=FORMAT))
register_scheme(QuantScheme("nvfp4a16", NAME, _WEIGHTS, None, format=FORMAT))
