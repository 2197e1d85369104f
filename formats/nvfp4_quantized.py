"""compressed-tensors ``nvfp4-pack-quantized``: NVFP4 weights (E2M1 values in groups of 16, one
E4M3 scale per group, one FP32 global scale per tensor), with NVFP4 input activations (W4A4,
the ``nvfp4`` scheme) or none (W4A16, ``nvfp4a16``).

Each quantized linear X has X.weight_packed (uint8 [N, K/2]: two E2M1 codes a byte, even k in
the low nibble), X.weight_scale (float8_e4m3fn [N, K/16]), X.weight_global_scale (float32 [1])
and, W4A4, X.input_global_scale (float32 [1]). w = e2m1 * (weight_scale / weight_global_scale);
a global scale is 448 * 6 / amax, so the largest group scale lands at the top of E4M3. The
activations' group scales are taken per call (dynamic "local") under the calibrated
input_global_scale. kernels/nvfp4_format.py computes and reads these tensors bit for bit.

Matched against compressed-tensors 0.20.1 (the package installed in .venv):
- compressors/nvfp4/base.py: NVFP4PackedCompressor (registered as "nvfp4-pack-quantized"; it
  takes float 4-bit weights of group size 16) stores weight_packed (quantize_and_pack_fp4),
  weight_scale cast to the weights' scale_dtype (E4M3) and weight_global_scale; symmetric, so
  no weight_zero_point. decompress: unpacked * (scale / global_scale).
- quantization/lifecycle/initialize.py: strategy "tensor_group" registers {base}_global_scale
  (float32 [1]) for the weights and for inputs whose dynamic is false or "local"; "local"
  registers no input_scale (the group scales are computed on the fly).
- quantization/quant_scheme.py presets NVFP4A16 = weights {4, float, tensor_group, group_size
  16, symmetric, static, scale_dtype float8_e4m3fn}; NVFP4 adds input_activations {the same
  but dynamic "local", observer "static_minmax"}. config_group writes them field for field.
  scale_dtype is not decoration: compressed-tensors rounds the activations' dynamic group
  scales to it (utils/helpers.py calculate_qparams), so a reader without it computes other
  activations.
- utils/helpers.py generate_gparam: global scale = 448 * 6 / amax (the weight's absmax; for
  inputs a running absmax over the calibration, the "static_minmax" observer).
vLLM (model_executor/layers/quantization/compressed_tensors/compressed_tensors.py):
``_is_fp4a16_nvfp4`` (float 4-bit tensor_group weights of group 16, symmetric, no input
activations) runs CompressedTensorsW4A16Fp4 (Marlin); ``_is_fp4a4_nvfp4`` (weights and inputs
both so) CompressedTensorsW4A4Fp4 where the GPU has FP4 tensor cores (Blackwell), else the
W4A16 Marlin path with the input global scale ignored. vLLM collapses the global scales of
the linears it fuses (q/k/v, gate/up) with max(), so they must be equal (llm-compressor makes
them so; quant/nvfp4.py does too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.nvfp4_format import GROUP, check_nvfp4_tensors, dequantize_nvfp4
from .args import LOCAL, QuantArgs
from .codec import StaticInputScaleCodec, register_codec
from .qweight import QuantizedWeight

E4M3 = torch.float8_e4m3fn
SCALE_DTYPE = "torch.float8_e4m3fn"  # compressed-tensors' spelling of the group scales' dtype


@dataclass
class NVFP4QuantizedWeight(QuantizedWeight):
    """q: uint8 [N, K/2] packed E2M1 codes; scale: float8_e4m3fn [N, K/16]; zero None;
    global_scale: float32 [1]; input_global_scale: float32 [1] (W4A4) or None (W4A16)."""

    global_scale: torch.Tensor | None = None
    input_global_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight, not of the packed bytes."""
        return self.q.shape[0], self.q.shape[1] * 2

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """w [N, K]: e2m1 * (scale / global_scale) in float32, then cast once to dtype (float32 when
        None): compressed-tensors' values, bit for bit."""
        return dequantize_nvfp4(self.q, self.scale, self.global_scale, dtype or torch.float32)

    def cpu(self) -> "NVFP4QuantizedWeight":
        return NVFP4QuantizedWeight(
            q=self.q.cpu(), scale=self.scale.cpu(), zero=None, args=self.args, global_scale=self.global_scale.cpu(),
            input_global_scale=None if self.input_global_scale is None else self.input_global_scale.cpu())


def _check_nvfp4(role: str, args: QuantArgs) -> None:
    if (args.type, args.num_bits, args.strategy, args.group_size) != ("float", 4, "tensor_group", GROUP):
        size = f", group_size {args.group_size}" if args.group_size else ""
        raise ValueError(f"NVFP4 {role} are float 4-bit with strategy 'tensor_group' and group_size {GROUP}, not "
                         f"{args.type} {args.num_bits}-bit with strategy {args.strategy!r}{size}")


class NVFP4PackQuantizedCodec(StaticInputScaleCodec):
    name = "nvfp4-pack-quantized"
    tensor_names = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
    input_tensor = "input_global_scale"

    def check(self, weights: QuantArgs, input_activations: QuantArgs | None = None) -> None:
        _check_nvfp4("weights", weights)
        if weights.dynamic:
            raise ValueError("nvfp4-pack-quantized weights are static (dynamic: false)")
        if input_activations is not None:
            _check_nvfp4("input activations", input_activations)
            if input_activations.dynamic != LOCAL:
                raise ValueError(f"NVFP4 input activations take dynamic {LOCAL!r} (group scales per call under a "
                                 f"calibrated global scale), not {input_activations.dynamic!r}")

    def encode_weight(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        g = getattr(qw, "global_scale", None)
        if g is None:
            raise ValueError("nvfp4-pack-quantized weights need a global_scale")
        check_nvfp4_tensors(qw.q, qw.scale, g.float())
        return {"weight_packed": qw.q.contiguous(), "weight_scale": qw.scale.contiguous(),
                "weight_global_scale": g.float().reshape(1).contiguous()}

    def decode_weight(self, parts: dict[str, torch.Tensor], weights: QuantArgs) -> NVFP4QuantizedWeight:
        packed, scale, g = parts["weight_packed"], parts["weight_scale"], parts["weight_global_scale"]
        check_nvfp4_tensors(packed, scale, g)
        return NVFP4QuantizedWeight(q=packed, scale=scale, zero=None, args=weights, global_scale=g.reshape(1))

    def config_group(self, targets: list[str], weights: QuantArgs, input_activations: QuantArgs | None) -> dict:
        group = super().config_group(targets, weights, input_activations)
        for role in ("weights", "input_activations"):
            if group[role] is not None:
                group[role]["scale_dtype"] = SCALE_DTYPE
        return group

    def vllm_incompatibility(self, weights: QuantArgs, input_activations: QuantArgs | None = None) -> str | None:
        return None  # check() admits only what vLLM's two NVFP4 schemes take


register_codec(NVFP4PackQuantizedCodec())
