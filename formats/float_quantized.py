"""compressed-tensors ``float-quantized``: FP8 (E4M3) weights with FP8 input activations (W8A8).

Each quantized linear X has X.weight (torch.float8_e4m3fn [N, K]: the E4M3 values
themselves, unpacked), X.weight_scale (the checkpoint dtype; [N, 1] per output channel,
[1] per tensor) and, when its input activations are static, X.input_scale ([1], the
checkpoint dtype); dynamic activations store nothing (their scale is taken per token at run
time). w = weight * weight_scale, in the scale's dtype.

Matched against compressed-tensors 0.20.1 (the package installed in .venv):
- compressors/naive_quantized/base.py: FloatQuantizationCompressor (registered as
  "float-quantized"; it compresses schemes whose weights are type float *and* that have
  input activations) stores ``weight`` cast to ``weights.pytorch_dtype()`` (float8_e4m3fn for
  8-bit floats) beside ``weight_scale``, no zero point for symmetric weights.
- quantization/lifecycle/forward_helpers.py ``_quantize``: x / scale, clamped to the type's
  range and cast (quant_args.py ``round_to_quantized_type_args``: clamp to
  [finfo.min, finfo.max] = [-448, 448], then ``.to(torch.float8_e4m3fn)``: saturating, never
  NaN); ``_dequantize``: x_q.to(scale.dtype) * scale.
- quantization/utils/helpers.py ``calculate_qparams``: symmetric scale = absmax / (range / 2)
  = absmax / 448; a zero scale is replaced by the scale dtype's eps.
- quantization/lifecycle/initialize.py: scales are [N, 1] for "channel", [1] for "tensor",
  in the observed (model) dtype; static input activations get ``input_scale`` the same way.
- quantization/quant_scheme.py presets: FP8_DYNAMIC = weights {8, float, channel,
  symmetric, static} + input_activations {8, float, token, symmetric, dynamic}; FP8 =
  weights {8, float, *tensor*} + input_activations {8, float, tensor, static, observer
  "static_minmax"}. optllm's ``fp8`` keeps per-channel weights (as FP8_DYNAMIC: one
  scale per row costs nothing at run time and is more accurate) with the FP8 preset's static
  per-tensor inputs; vLLM takes either weight strategy (vllm_compat.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .args import QuantArgs
from .codec import StaticInputScaleCodec, register_codec
from .qweight import QuantizedWeight
from .vllm_compat import vllm_fp8_incompatibility

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite E4M3 (fn) value; the fn variant has no infinities


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) saturated to [-448, 448], then rounded to the nearest E4M3 value
    (ties to even, subnormals down to 2^-9): float8_e4m3fn. Without the clamp the cast
    would turn anything past 464 into NaN."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def fp8_scale(amax: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """absmax / 448 in scale_dtype; a zero scale (an all-zero row) becomes the dtype's eps,
    as compressed-tensors' calculate_qparams does, so nothing divides by zero."""
    scale = (amax.float() / E4M3_MAX).to(scale_dtype)
    return torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale_dtype).eps), scale)


@dataclass
class FloatQuantizedWeight(QuantizedWeight):
    """q: float8_e4m3fn [N, K]; scale [N, 1] (per channel) or [1] (per tensor), checkpoint
    dtype; zero None; input_scale: [1] static per-tensor input scale (checkpoint dtype), None
    when the input activations are dynamic."""

    input_scale: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self.q.to(self.scale.dtype) * self.scale.reshape(-1, 1)  # in the scale's dtype, as compressed-tensors
        return out if dtype is None else out.to(dtype)

    def cpu(self) -> "FloatQuantizedWeight":
        return FloatQuantizedWeight(q=self.q.cpu(), scale=self.scale.cpu(), zero=None, args=self.args,
                                    input_scale=None if self.input_scale is None else self.input_scale.cpu())


def _check_fp8(role: str, args: QuantArgs) -> None:
    if args.type != "float" or args.num_bits != 8:
        raise ValueError(f"{role} {args.type} {args.num_bits}-bit is not supported here; allowed: float 8-bit (E4M3)")


class FloatQuantizedCodec(StaticInputScaleCodec):
    name = "float-quantized"
    # weight_scale first: it marks a quantized linear (every linear, quantized or not, has a .weight)
    tensor_names = ("weight_scale", "weight", "input_scale")

    def check(self, weights: QuantArgs, input_activations: QuantArgs | None = None) -> None:
        _check_fp8("weight type", weights)
        if weights.strategy not in ("channel", "tensor"):
            size = f" (group_size {weights.group_size})" if weights.group_size else ""
            raise ValueError(f"FP8 weight strategy {weights.strategy!r}{size} is not supported; allowed: 'channel' "
                             "(one scale per output channel) or 'tensor'")
        if weights.dynamic:
            raise ValueError("float-quantized weights are static (dynamic: false)")
        if input_activations is None:
            raise ValueError("float-quantized is W8A8: input_activations must be given (FP8 weight-only is "
                             "naive-quantized)")
        _check_fp8("input activation type", input_activations)
        acts = (input_activations.strategy, input_activations.dynamic)
        if acts not in (("token", True), ("tensor", False)):
            raise ValueError(f"FP8 input activations with strategy {acts[0]!r} and dynamic {acts[1]} are not "
                             "supported; allowed: 'token' dynamic or 'tensor' static")

    def encode_weight(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        if qw.q.dtype != E4M3:
            raise ValueError(f"float-quantized weights are {E4M3}, not {qw.q.dtype}")
        return {"weight": qw.q.contiguous(), "weight_scale": qw.scale.contiguous()}

    def decode_weight(self, parts: dict[str, torch.Tensor], weights: QuantArgs) -> FloatQuantizedWeight:
        q, scale = parts["weight"], parts["weight_scale"]
        if q.dtype != E4M3 or q.dim() != 2:
            raise ValueError(f"weight is {q.dtype} {tuple(q.shape)}; float-quantized needs {E4M3} [N, K]")
        want = (q.shape[0], 1) if weights.strategy == "channel" else (1,)
        if tuple(scale.shape) != want or not scale.is_floating_point():
            raise ValueError(f"weight_scale {scale.dtype} {tuple(scale.shape)} does not match a {weights.strategy} "
                             f"scale {want} of weight {tuple(q.shape)}")
        return FloatQuantizedWeight(q=q, scale=scale, zero=None, args=weights)

    def vllm_incompatibility(self, weights: QuantArgs, input_activations: QuantArgs | None = None) -> str | None:
        return vllm_fp8_incompatibility(weights, input_activations)


register_codec(FloatQuantizedCodec())
