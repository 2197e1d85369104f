"""Algorithms: how a scheme's weights are found, one decoder block at a time.

An algorithm registers a block step: given a decoder block on the compute device and the
inputs the calibration captured for it, the step quantizes the block's linears in place (their
weights become the dequantized values, so the next block sees this block's error) and returns
the quantized weights and each linear's output error. The pipeline (pipeline.py) owns
everything around it: loading, capturing, moving blocks, the held-out comparison, writing.

A step computes only the statistics it needs: GPTQ accumulates a K x K Hessian per linear,
AWQ the activation statistics of its searches; a step whose weights do not depend on the
inputs (RTN, AWQ once its scales are folded) uses quantize_in_place, which measures the
output errors in one pass over the block with no K x K matrix.

Each algorithm has its own options dataclass, built from the run's QuantizeConfig by its
`options` function. A new algorithm is one module that calls register_algorithm (and is
named in ALGORITHMS' built-ins, so a lookup imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..formats.args import QuantArgs
from ..formats.qweight import QuantizedWeight
from ..hub.architectures import BlockMapping
from ..registry import Registry
from .sequential import BlockInputs, capture_inputs, run_block

if TYPE_CHECKING:
    from .config import QuantizeConfig


@dataclass
class BlockContext:
    """One decoder block as its step sees it. Linear names are relative to the block."""

    layer: nn.Module  # on the compute device
    index: int
    linears: dict[str, nn.Linear]  # the linears to quantize (ignored ones are left out)
    mapping: BlockMapping  # the architecture's block structure (smoothing pairs, sequential order)
    inputs: BlockInputs  # the block's inputs on every calibration batch (earlier blocks quantized)
    weights: QuantArgs
    scale_dtype: torch.dtype  # the checkpoint's scale dtype: grids are rounded to it


@dataclass
class BlockResult:
    qweights: dict[str, QuantizedWeight]  # on the CPU
    # per linear, its relative output error on the calibration inputs (the report's layers)
    errors: list[tuple[str, float]]
    stats: dict[str, Any] = field(default_factory=dict)  # more fields of the block's report entry


BlockStep = Callable[[BlockContext, Any], BlockResult]


def _no_options(config: "QuantizeConfig") -> None:
    return None


@dataclass(frozen=True)
class Algorithm:
    """name: what schemes name; step(context, options) -> BlockResult; options(config): this
    algorithm's options dataclass from the run's config (validated on construction: the
    config builds every algorithm's, so a bad value is refused whatever the scheme);
    actorders: the QuantArgs.actorder values the step honours, the first being the one
    actorder "auto" picks; rtn_baseline: whether the pipeline compares the step's blocks with
    RTN's on the held-out windows (False for a step that is itself round-to-nearest, e.g. on
    the FP8 grid, which the integer RTN cannot quantize to); folds_scales: whether the step
    changes a linear before the ones it quantizes (AWQ folds a scale into v_proj for o_proj),
    so that a block whose linears differ in their arguments runs its later linears first
    (pipeline.block_step)."""

    name: str
    step: BlockStep
    options: Callable[["QuantizeConfig"], Any] = _no_options
    actorders: tuple[str | None, ...] = (None,)
    rtn_baseline: bool = True
    folds_scales: bool = False


ALGORITHMS: Registry[Algorithm] = Registry(
    "algorithm", builtins=("optllm.quant.rtn", "optllm.quant.awq", "optllm.quant.gptq", "optllm.quant.fp8",
                           "optllm.quant.smoothquant", "optllm.quant.nvfp4"))


def register_algorithm(algorithm: Algorithm, replace: bool = False) -> Algorithm:
    return ALGORITHMS.register(algorithm.name, algorithm, replace=replace)


def get_algorithm(name: str) -> Algorithm:
    return ALGORITHMS.get(name)


def install(linear: nn.Linear, qw: QuantizedWeight) -> QuantizedWeight:
    """Set the linear's weight to qw's dequantized values; returns qw on the CPU (for the checkpoint)."""
    with torch.no_grad():
        linear.weight.copy_(qw.dequantize(torch.float32).to(linear.weight.device, linear.weight.dtype))
    return qw.cpu()


def quantize_in_place(ctx: BlockContext, quantize: Callable[[str, torch.Tensor], QuantizedWeight]) -> BlockResult:
    """Quantize every linear of the block with quantize(name, weight [N, K]), which must not
    depend on the block's inputs; measure each one's output error on the block as it stands
    (output_errors), then install the quantized weights."""
    qws = {name: quantize(name, lin.weight.detach()) for name, lin in ctx.linears.items()}
    errors = output_errors(ctx.layer, ctx.inputs, {n: (lin, qws[n]) for n, lin in ctx.linears.items()})
    result = BlockResult({}, [])
    for name, lin in ctx.linears.items():
        result.qweights[name] = install(lin, qws[name])
        result.errors.append((name, errors[name]))
    return result


def output_errors(layer: nn.Module, inputs: BlockInputs,
                  quantized: dict[str, tuple[nn.Linear, QuantizedWeight]]) -> dict[str, float]:
    """Per linear, sqrt(Σ ‖x (Ŵ − W)ᵀ‖² / Σ ‖x Wᵀ‖²) over every token x reaching it when the
    block runs on its inputs: the relative error of its output. Equal to gptq.relative_error
    with the (unweighted) Hessian of the same inputs, without forming a K x K matrix: two
    products of each input with [N, K] matrices instead."""
    device = next(layer.parameters()).device
    num = {n: torch.zeros((), dtype=torch.float64, device=device) for n in quantized}
    den = {n: torch.zeros((), dtype=torch.float64, device=device) for n in quantized}

    def add(name: str, x: torch.Tensor) -> None:
        lin, qw = quantized[name]
        w = lin.weight.detach().float()
        rows = x.reshape(-1, w.shape[1]).float()
        d = qw.dequantize(torch.float32).to(w.device) - w  # transient: one linear's [N, K] at a time
        num[name] += (rows @ d.T).square().sum().double()
        den[name] += (rows @ w.T).square().sum().double()

    with capture_inputs({n: lin for n, (lin, _qw) in quantized.items()}, add):
        run_block(layer, inputs, keep=False)
    return {n: float((num[n] / den[n].clamp_min(1e-30)).sqrt()) for n in quantized}
