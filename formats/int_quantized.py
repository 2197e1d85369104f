"""compressed-tensors ``int-quantized``: int8 weights with int8 input activations (W8A8-INT8).

Each quantized linear X has X.weight (torch.int8 [N, K]: the codes themselves, unpacked),
X.weight_scale ([N, 1] per output channel, the checkpoint dtype) and, when its input
activations are static, X.input_scale ([1], the checkpoint dtype); dynamic activations store
nothing (their scale is taken per token at run time). w = weight * weight_scale, in the
scale's dtype. No zero points are stored: the weights and static inputs are symmetric; dynamic
per-token inputs may be asymmetric (``w8a8-int8-asym``: their zero points are taken at run time).

Matched against compressed-tensors 0.20.1 (the package installed in .venv):
- compressors/naive_quantized/base.py: IntQuantizationCompressor (registered as
  "int-quantized"; it compresses schemes whose weights are type int *and* that have input
  activations) stores ``weight`` as ``quantize(weight, scale, zero, args,
  dtype=args.pytorch_dtype())`` = int8 beside ``weight_scale``; ``_remove_symmetric_zp``
  drops ``weight_zero_point`` and ``input_zero_point`` of symmetric arguments.
- quantization/utils/helpers.py ``calculate_qparams``: symmetric scale = absmax / (range / 2)
  with range = 127 - (-128) = 255, i.e. absmax / 127.5 (quant/observers.py computes the same);
  a zero scale becomes the dtype's eps.
- quantization/quant_args.py ``round_to_quantized_type_args``: codes are
  round(clamp(x / scale, -128, 127)); ``_dequantize``: x_q.to(scale.dtype) * scale.
- quantization/quant_scheme.py preset INT8_W8A8 ("W8A8", "INT8"): weights {8, int, channel,
  symmetric, static} + input_activations {8, int, token, symmetric, dynamic}: optllm's
  ``w8a8-int8``. ``w8a8-int8-static`` keeps those weights with static per-tensor symmetric
  inputs (one calibrated ``input_scale`` per linear), which vLLM also runs (vllm_compat.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .args import QuantArgs
from .codec import StaticInputScaleCodec, register_codec
from .qweight import QuantizedWeight
from .vllm_compat import vllm_int8_incompatibility

INT8_MIN, INT8_MAX = -128, 127
INT8_HALF_RANGE = 127.5  # (127 - (-128)) / 2: compressed-tensors' symmetric int8 scale = absmax / 127.5


def int8_scale(amax: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """absmax / 127.5 in scale_dtype; a zero scale becomes the dtype's eps, as compressed-tensors'
    calculate_qparams does, so nothing divides by zero."""
    scale = (amax.float() / INT8_HALF_RANGE).to(scale_dtype)
    return torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale_dtype).eps), scale)


def quantize_static_int8(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] to int8 codes with a static per-tensor input_scale ([1] or scalar):
    round(x / scale) (ties to even) clamped to [-128, 127], in float32, as compressed-tensors
    quantizes static inputs and vLLM's static int8 quantizer does."""
    s = input_scale.float().reshape(())
    return torch.round(x.float() / s).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)


@dataclass
class IntQuantizedWeight(QuantizedWeight):
    """q: int8 [N, K]; scale [N, 1] (per channel, checkpoint dtype); zero None; input_scale:
    [1] static per-tensor input scale (checkpoint dtype), None when the inputs are dynamic."""

    input_scale: torch.Tensor | None = None

    def cpu(self) -> "IntQuantizedWeight":
        return IntQuantizedWeight(q=self.q.cpu(), scale=self.scale.cpu(), zero=None, args=self.args,
                                  input_scale=None if self.input_scale is None else self.input_scale.cpu())


def _check_int8(role: str, args: QuantArgs, zero_points: bool = False) -> None:
    if args.type != "int" or args.num_bits != 8:
        raise ValueError(f"{role} {args.type} {args.num_bits}-bit is not supported here; allowed: int 8-bit")
    if not args.symmetric and not zero_points:
        raise ValueError(f"{role}: asymmetric int8 is not supported here; allowed: symmetric (no zero points)")


class IntQuantizedCodec(StaticInputScaleCodec):
    name = "int-quantized"
    # weight_scale first: it marks a quantized linear (every linear, quantized or not, has a .weight)
    tensor_names = ("weight_scale", "weight", "input_scale")

    def check(self, weights: QuantArgs, input_activations: QuantArgs | None = None) -> None:
        _check_int8("weight type", weights)
        if weights.strategy != "channel":
            size = f" (group_size {weights.group_size})" if weights.group_size else ""
            raise ValueError(f"int8 W8A8 weight strategy {weights.strategy!r}{size} is not supported; allowed: "
                             "'channel' (one scale per output channel)")
        if weights.dynamic:
            raise ValueError("int-quantized weights are static (dynamic: false)")
        # actorder ("static" / compressed-tensors "weight") only records the order GPTQ visited the
        # columns in: with one scale per output channel the stored codes and scales are the same
        # kind either way (llm-compressor's W8A8 GPTQ preset writes it; vLLM loads such files)
        if input_activations is None:
            raise ValueError("int-quantized is W8A8: input_activations must be given (int8 weight-only is "
                             "pack-quantized: w8a16-*)")
        acts = (input_activations.strategy, input_activations.dynamic)
        # dynamic inputs may have zero points (taken per token at run time: nothing stored)
        _check_int8("input activation type", input_activations, zero_points=acts == ("token", True))
        if acts not in (("token", True), ("tensor", False)):
            raise ValueError(f"int8 input activations with strategy {acts[0]!r} and dynamic {acts[1]} are not "
                             "supported; allowed: 'token' dynamic or 'tensor' static")

    def encode_weight(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        if qw.q.dtype != torch.int8 or qw.zero is not None:
            raise ValueError(f"int-quantized weights are symmetric torch.int8 codes, not {qw.q.dtype}"
                             f"{' with zero points' if qw.zero is not None else ''}")
        return {"weight": qw.q.contiguous(), "weight_scale": qw.scale.reshape(-1, 1).contiguous()}

    def decode_weight(self, parts: dict[str, torch.Tensor], weights: QuantArgs) -> IntQuantizedWeight:
        q, scale = parts["weight"], parts["weight_scale"]
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"weight is {q.dtype} {tuple(q.shape)}; int-quantized needs torch.int8 [N, K]")
        if tuple(scale.shape) != (q.shape[0], 1) or not scale.is_floating_point():
            raise ValueError(f"weight_scale {scale.dtype} {tuple(scale.shape)} does not match a channel scale "
                             f"{(q.shape[0], 1)} of weight {tuple(q.shape)}")
        return IntQuantizedWeight(q=q, scale=scale, zero=None, args=weights)

    def vllm_incompatibility(self, weights: QuantArgs, input_activations: QuantArgs | None = None) -> str | None:
        return vllm_int8_incompatibility(weights, input_activations)


register_codec(IntQuantizedCodec())
