"""SmoothQuant (Xiao et al., 2023) and the W8A8-INT8 schemes ``w8a8-int8`` / ``w8a8-int8-static`` /
``w8a8-int8-asym``.

Activations of LLMs have a few input channels with outliers 10-100x the others, so quantizing
them to int8 per token wastes the grid on those channels; weights are flat. SmoothQuant moves
the difficulty from activations to weights with a per-input-channel factor s: the linears
sharing an input X compute (X / s)(s W), the same function. The paper's factor (Section 4):

    s_j = max|X_j|^α / max|W_j|^(1-α)

max|X_j| over every calibration token reaching the group (this block's inputs as calibrated,
earlier blocks already quantized), max|W_j| over the output rows of every linear of the group,
α the migration strength (0.5 by default, the paper's value for most models). X / s is folded
into the preceding RMSNorm's weight (q/k/v <- input_layernorm, gate/up <- post_attention_layernorm:
the pairs the paper smooths and llm-compressor's default Llama mappings name), and optionally
into up_proj's output rows for down_proj (``fold_down_proj``; llm-compressor's SmoothQuant
leaves it out, its AWQ mappings have it), and into v_proj's output rows for o_proj
(``fold_o_proj``; under grouped-query attention one factor per v_proj channel, from the maxima
over the o_proj inputs it feeds, awq.gqa_channel_index; peers skip this pair under GQA). The
pairs are the architecture's (hub/architectures.py BlockMapping.smoothquant / smoothquant_linear
/ smoothquant_value). A factor of a channel with no activation or no weight is 1; factors are
clamped to >= 1e-5 (llm-compressor's floor).

With ``alpha: search`` each block picks α from {0, 1/n, ..., 1} (n = alpha_grid) or no
smoothing at all, whichever gives the lowest quantized block output error on the calibration
inputs: sqrt of the mean over tokens of ‖out_t − ref_t‖² / ‖ref_t‖², the block run with RTN
int8 weights and its inputs quantized as the runtime quantizes them.

Then the weights: int8, symmetric, per output channel (scale = absmax / 127.5, codes in
[-128, 127]: compressed-tensors' grid), by RTN or, when asked (``weights: gptq``), by the GPTQ
step of quant/gptq.py on the smoothed block (gptq_per_channel_step: columns in act-order).
Input activations: ``w8a8-int8`` quantizes them per token at run time (symmetric, absmax / 127);
``w8a8-int8-asym`` per token with a zero point (over [min(min, 0), max(max, 0)]: kernels/w8a8_int8.py);
``w8a8-int8-static`` calibrates one per-tensor input scale per linear, absmax / 127.5 over every
calibration token reaching it with the block's weights quantized.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..formats.args import QuantArgs
from ..formats.int_quantized import IntQuantizedWeight, int8_scale, quantize_static_int8
from ..hub.architectures import BlockMapping, SmoothMapping
from ..kernels.w8a8_int8 import quantize_per_token_int8_azp_ref, quantize_per_token_int8_ref
from . import observers
from .algorithm import Algorithm, BlockContext, BlockResult, quantize_in_place, register_algorithm
from .awq import apply_scales, channel_reduce, gqa_channel_index, out_features
from .fp8 import input_absmax
from .gptq import GPTQOptions, gptq_per_channel_step
from .rtn import rtn_quantize
from .scheme import QuantScheme, register_scheme
from .sequential import BlockInputs, capture_inputs, run_block

if TYPE_CHECKING:
    from .config import QuantizeConfig

NAME = "smoothquant"
FORMAT = "int-quantized"
WEIGHT_ALGORITHMS = ("rtn", "gptq")
MIN_SCALE = 1e-5  # smoothing factors are clamped to at least this (llm-compressor's MINIMUM_SMOOTHING_SCALE)
SEARCH = "search"


@dataclass(frozen=True)
class SmoothQuantOptions:
    """QuantizeConfig.smoothquant (a recipe's ``smoothquant:`` mapping)."""

    smooth: bool = True  # False: no smoothing (plain W8A8 RTN/GPTQ, to compare with)
    alpha: float | str = 0.5  # migration strength in [0, 1], or "search": per block, on a grid
    alpha_grid: int = 10  # search: α in {0, 1/alpha_grid, ..., 1}, and no smoothing
    fold_down_proj: bool = False  # also smooth down_proj's input into up_proj's output rows
    fold_o_proj: bool = False  # also smooth o_proj's input into v_proj's output rows (GQA: shared factors)
    weights: str = "rtn"  # the weight quantizer: "rtn" or "gptq" (the run's GPTQ options)

    def __post_init__(self) -> None:
        if any(v not in (True, False) for v in (self.smooth, self.fold_down_proj, self.fold_o_proj)):
            raise ValueError("smoothquant.smooth, smoothquant.fold_down_proj and smoothquant.fold_o_proj must be "
                             "true or false")
        a = self.alpha
        if isinstance(a, str):
            if a.strip().lower() != SEARCH:
                raise ValueError(f"smoothquant.alpha={a!r} is not allowed; allowed: a number in [0, 1] or {SEARCH!r}")
            object.__setattr__(self, "alpha", SEARCH)
        elif isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise ValueError(f"smoothquant.alpha={a!r} is not allowed; allowed: a number in [0, 1] or {SEARCH!r}")
        if isinstance(self.alpha_grid, bool) or not isinstance(self.alpha_grid, int) or self.alpha_grid < 1:
            raise ValueError(f"smoothquant.alpha_grid={self.alpha_grid!r} must be an integer >= 1")
        if self.weights not in WEIGHT_ALGORITHMS:
            raise ValueError(f"smoothquant.weights={self.weights!r} is not allowed; "
                             f"allowed: {', '.join(WEIGHT_ALGORITHMS)}")

    @property
    def search(self) -> bool:
        return self.alpha == SEARCH


@dataclass(frozen=True)
class SmoothQuantStep:
    """What the block step needs from the run: the smoothing options, whether the inputs are
    static (calibrated input scales), and GPTQ's options (used when smoothing.weights is gptq)."""

    smoothing: SmoothQuantOptions
    static_input: bool
    gptq: GPTQOptions
    asym_input: bool = False  # dynamic per-token inputs with zero points (w8a8-int8-asym)


def smoothquant_options(config: "QuantizeConfig") -> SmoothQuantStep:
    acts = config.quant_scheme().input_activations
    return SmoothQuantStep(config.smoothquant, config.static_inputs(), GPTQOptions.from_config(config),
                           asym_input=acts is not None and not acts.symmetric)


# --------------------------------------------------------------------------- statistics
def block_mappings(mapping: BlockMapping, fold_down_proj: bool, quantized: Sequence[str],
                   fold_o_proj: bool = False) -> list[SmoothMapping]:
    """The block's SmoothQuant pairs that have at least one quantized balance linear (a pair
    whose linears are all ignored stays as it is)."""
    pairs = (list(mapping.smoothquant) + (list(mapping.smoothquant_linear) if fold_down_proj else [])
             + (list(mapping.smoothquant_value) if fold_o_proj else []))
    return [m for m in pairs if any(b in quantized for b in m.balance)]


def channel_absmax(layer: nn.Module, inputs: BlockInputs, mappings: Sequence[SmoothMapping]) -> dict[str, torch.Tensor]:
    """Per pair (keyed by its smooth layer), max |X_j| [K] float32 over every calibration token
    of the input its balance linears share, the block run on its inputs as it stands."""
    amax: dict[str, torch.Tensor] = {}

    def add(name: str, x: torch.Tensor) -> None:
        m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        amax[name] = m if name not in amax else torch.maximum(amax[name], m)

    with capture_inputs({m.smooth: layer.get_submodule(m.balance[0]) for m in mappings}, add):
        run_block(layer, inputs, keep=False)
    return amax


def weight_absmax(layer: nn.Module, mapping: SmoothMapping) -> torch.Tensor:
    """max |W_j| [K] float32 over the output rows of every balance linear of the pair."""
    ws = [layer.get_submodule(b).weight.detach().abs().amax(dim=0).float() for b in mapping.balance]
    return torch.stack(ws).amax(dim=0)


def smoothing_factors(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^α / max|W_j|^(1-α) [K] float32; 1 where a channel has no activation or no
    weight (nothing to migrate), then clamped to >= MIN_SCALE."""
    x, w = x_absmax.float(), w_absmax.float()
    s = x.pow(alpha) / w.pow(1.0 - alpha)
    s = torch.where((x > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s))
    return s.clamp_min(MIN_SCALE)


def smooth_block(layer: nn.Module, inputs: BlockInputs, mappings: Sequence[SmoothMapping], alpha: float,
                 x_absmax: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Compute each pair's factors (activation maxima from x_absmax, else measured on inputs) and
    fold them: the smooth layer's output ÷ s, the balance linears' input columns × s. The float
    block computes the same function afterwards. Returns the factors by smooth layer."""
    amax = channel_absmax(layer, inputs, mappings) if x_absmax is None else x_absmax
    scales = {}
    for m in mappings:
        width = layer.get_submodule(m.balance[0]).in_features
        out = out_features(layer.get_submodule(m.smooth))
        index = gqa_channel_index(layer, m, width, out)
        if index is None:
            continue  # the smooth layer's outputs do not map onto the balance inputs: left as it is
        x, w = amax[m.smooth], weight_absmax(layer, m)
        if index.numel() == out:
            s = smoothing_factors(x, w, alpha)
            apply_scales(layer, m, s)
        else:  # one factor per smooth channel, from the maxima over the balance channels it feeds
            index = index.to(x.device)
            t = smoothing_factors(channel_reduce(x, index, out, "amax"),
                                  channel_reduce(w.to(x.device), index, out, "amax"), alpha)
            s = t[index]
            apply_scales(layer, m, s, t)
        scales[m.smooth] = s
    return scales


# --------------------------------------------------------------------------- activations
def fake_quantize_input(x: torch.Tensor, input_scale: torch.Tensor | None, asym: bool = False) -> torch.Tensor:
    """x quantized to int8 and back, as the runtime's W8A8 linear sees it: per token
    (kernels.w8a8_int8's quantizer; asym: with a zero point) when input_scale is None, else with
    that static scale."""
    flat = x.reshape(-1, x.shape[-1])
    if asym:
        xq, xs, azp = quantize_per_token_int8_azp_ref(flat)
        out = (xq.float() - azp) * xs
    elif input_scale is None:
        xq, xs = quantize_per_token_int8_ref(flat)
        out = xq.float() * xs
    else:
        out = quantize_static_int8(flat, input_scale).float() * input_scale.float().reshape(())
    return out.to(x.dtype).reshape(x.shape)


@contextmanager
def quantized_inputs(linears: dict[str, nn.Linear], input_scales: dict[str, torch.Tensor] | None,
                     asym: bool = False) -> Iterator[None]:
    """While open, each linear's input is fake-quantized (fake_quantize_input; input_scales:
    static scales by linear name, None: per token; asym: per token with zero points)."""

    def make(name):
        def hook(_m, args):
            scale = None if input_scales is None else input_scales[name]
            return (fake_quantize_input(args[0], scale, asym),) + tuple(args[1:])

        return hook

    handles = [lin.register_forward_pre_hook(make(n)) for n, lin in linears.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def static_input_scales(ctx: BlockContext) -> dict[str, torch.Tensor]:
    """Per linear, its static input scale [1] (checkpoint dtype): absmax / 127.5 over every
    calibration token reaching it, the block run as it stands."""
    return {n: int8_scale(torch.tensor([a]), ctx.scale_dtype) for n, a in input_absmax(ctx).items()}


# --------------------------------------------------------------------------- α search
def token_error(outs: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """sqrt(mean over tokens of ‖out_t − ref_t‖² / ‖ref_t‖²): every token counts once, so the
    few tokens of massive activations do not decide it alone."""
    total, count = 0.0, 0
    for o, r in zip(outs, ref):
        r = r.float().reshape(-1, r.shape[-1])
        num = (o.float().reshape(r.shape) - r).pow(2).sum(1)
        total += float((num / r.pow(2).sum(1).clamp_min(1e-30)).sum())
        count += r.shape[0]
    return (total / count) ** 0.5 if count else 0.0


def quantized_block_error(ctx: BlockContext, static_input: bool, ref: list[torch.Tensor],
                          asym_input: bool = False) -> float:
    """The block's output error against ref with every quantized linear's weight RTN int8 and its
    inputs quantized (static scales measured first); the weights are changed in place."""
    with torch.no_grad():
        for lin in ctx.linears.values():
            lin.weight.copy_(observers.fake_quantize(lin.weight, ctx.weights, scale_dtype=ctx.scale_dtype)
                             .to(lin.weight.dtype))
    scales = static_input_scales(ctx) if static_input else None
    with quantized_inputs(ctx.linears, scales, asym_input):
        return token_error(run_block(ctx.layer, ctx.inputs), ref)


def search_alpha(ctx: BlockContext, mappings: Sequence[SmoothMapping], x_absmax: dict[str, torch.Tensor],
                 opts: SmoothQuantOptions, static_input: bool,
                 asym_input: bool = False) -> tuple[float | None, dict[str, float]]:
    """The α of {None (no smoothing), 0, 1/n, ..., 1} with the lowest quantized block error
    (ties keep the earlier); the block is left as it was. Returns (α, error per candidate)."""
    ref = run_block(ctx.layer, ctx.inputs)
    original = {k: v.detach().clone() for k, v in ctx.layer.state_dict().items()}
    errors: dict[str, float] = {}
    best: tuple[float, float | None] | None = None
    try:
        for alpha in [None] + [i / opts.alpha_grid for i in range(opts.alpha_grid + 1)]:
            if alpha is not None:
                smooth_block(ctx.layer, ctx.inputs, mappings, alpha, x_absmax)
            err = quantized_block_error(ctx, static_input, ref, asym_input)
            errors["none" if alpha is None else f"{alpha:g}"] = err
            if err == err and (best is None or err < best[0]):
                best = (err, alpha)
            ctx.layer.load_state_dict(original)
    finally:
        ctx.layer.load_state_dict(original)
    return (None if best is None else best[1]), errors


# --------------------------------------------------------------------------- the step
def int8_rtn(w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype) -> IntQuantizedWeight:
    """A weight [N, K] to int8 per output channel: scale [N, 1] = absmax / 127.5 in scale_dtype,
    codes round(w / scale) in [-128, 127] (compressed-tensors' symmetric int8 grid)."""
    qw = rtn_quantize(w, args, scale_dtype=scale_dtype)
    return IntQuantizedWeight(q=qw.q, scale=qw.scale, zero=None, args=args)


def smoothquant_step(ctx: BlockContext, opts: SmoothQuantStep) -> BlockResult:
    """Smooth the block (unless turned off), quantize its linears to int8 per channel (RTN or
    GPTQ), then, for static inputs, calibrate each linear's input scale."""
    sq = opts.smoothing
    stats: dict = {}
    if sq.smooth:
        mappings = block_mappings(ctx.mapping, sq.fold_down_proj, list(ctx.linears), sq.fold_o_proj)
        if mappings:
            amax = channel_absmax(ctx.layer, ctx.inputs, mappings)
            alpha: float | None = float(sq.alpha) if not sq.search else None
            if sq.search:
                alpha, errors = search_alpha(ctx, mappings, amax, sq, opts.static_input, opts.asym_input)
                stats["search_errors"] = errors
            stats["alpha"] = alpha
            if alpha is not None:
                scales = smooth_block(ctx.layer, ctx.inputs, mappings, alpha, amax)
                # how far each input's channel range was flattened: max|X_j| / min|X_j| before and after
                stats["smoothed"] = {name: _spread(amax[name], s) for name, s in scales.items()}
    if sq.weights == "gptq":
        result = gptq_per_channel_step(ctx, opts.gptq)
        result.qweights = {n: IntQuantizedWeight(q=qw.q, scale=qw.scale, zero=None, args=qw.args)
                           for n, qw in result.qweights.items()}
    else:
        result = quantize_in_place(ctx, lambda _name, w: int8_rtn(w, ctx.weights, ctx.scale_dtype))
    if opts.static_input:
        for name, scale in static_input_scales(ctx).items():
            result.qweights[name].input_scale = scale
    if stats:
        result.stats["smoothquant"] = stats
    return result


def _spread(amax: torch.Tensor, s: torch.Tensor) -> dict[str, float]:
    live = amax > 0
    if not live.any():
        return {"before": 1.0, "after": 1.0}
    before, after = amax[live], (amax / s.to(amax.device))[live]
    return {"before": float(before.max() / before.min().clamp_min(1e-30)),
            "after": float(after.max() / after.min().clamp_min(1e-30))}


register_algorithm(Algorithm(NAME, smoothquant_step, options=smoothquant_options, rtn_baseline=False))

# compressed-tensors' INT8_W8A8 ("W8A8") preset exactly; the same weights with static
# per-tensor input scales
_WEIGHTS = QuantArgs(num_bits=8, group_size=None, strategy="channel")
register_scheme(QuantScheme("w8a8-int8", NAME, _WEIGHTS, QuantArgs(num_bits=8, group_size=None, strategy="token",
                                                                   dynamic=True), format=FORMAT))
register_scheme(QuantScheme("w8a8-int8-static", NAME, _WEIGHTS, QuantArgs(num_bits=8, group_size=None,
                                                                          strategy="tensor"), format=FORMAT))
# the same weights with asymmetric dynamic per-token inputs (a zero point per token, which vLLM's
# INT8 path also takes): the symmetric preset's activations cost SmolLM2 1.1-1.4% perplexity,
# these 0.6-0.9% (docs/BENCHMARKS.md)
register_scheme(QuantScheme("w8a8-int8-asym", NAME, _WEIGHTS, QuantArgs(num_bits=8, group_size=None, strategy="token",
                                                                        dynamic=True, symmetric=False), format=FORMAT))
