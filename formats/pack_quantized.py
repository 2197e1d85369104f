"""compressed-tensors ``pack-quantized``: integer weights of 2-8 bits packed into int32 words.

Each quantized linear X has X.weight_packed (int32, codes packed along the input dim,
formats/packing.py), X.weight_scale [N, groups] (checkpoint dtype), X.weight_shape (int64
[N, K]) and, for asymmetric grids, X.weight_zero_point (int32, packed along the output dim).
Weight-only (no input quantization), static, one scale per group or per output channel.
vLLM and transformers (with the compressed-tensors package) read this layout.
"""

from __future__ import annotations

import torch

from .args import QuantArgs
from .codec import FormatCodec, register_codec
from .packing import pack_int32, unpack_int32
from .qweight import QuantizedWeight
from .vllm_compat import vllm_incompatibility


class PackQuantizedCodec(FormatCodec):
    name = "pack-quantized"
    tensor_names = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")

    def check(self, weights: QuantArgs, input_activations: QuantArgs | None = None) -> None:
        if weights.type != "int":
            raise ValueError(f"weight type {weights.type!r} is not supported here; allowed: 'int'")
        if weights.strategy not in ("group", "channel"):
            raise ValueError(f"weight strategy {weights.strategy!r} is not supported; allowed: 'group', 'channel'")
        if weights.dynamic:
            raise ValueError("pack-quantized weights are static (dynamic: false)")
        if input_activations is not None:
            raise ValueError("pack-quantized is weight-only: input_activations must be null")

    def required(self, weights: QuantArgs) -> set[str]:
        need = {"weight_packed", "weight_scale", "weight_shape"}
        return need if weights.symmetric else need | {"weight_zero_point"}

    def encode(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        b = qw.args.num_bits
        parts = {
            "weight_packed": pack_int32(qw.q, b, dim=1),
            "weight_scale": qw.scale.contiguous(),
            "weight_shape": torch.tensor(qw.q.shape, dtype=torch.int64),
        }
        if qw.zero is not None:
            parts["weight_zero_point"] = pack_int32(qw.zero, b, dim=0)
        return parts

    def decode(self, parts: dict[str, torch.Tensor], weights: QuantArgs) -> QuantizedWeight:
        missing = sorted(self.required(weights) - parts.keys())
        if missing:
            what = " (asymmetric scheme)" if missing == ["weight_zero_point"] else ""
            raise ValueError(f"checkpoint lacks {missing[0]}{what}")
        n, k = (int(v) for v in parts["weight_shape"].tolist())
        q = unpack_int32(parts["weight_packed"], weights.num_bits, k, dim=1)
        scale = parts["weight_scale"]
        if q.shape[0] != n or scale.shape != (n, weights.groups(k)):
            raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight [{n}, {k}]")
        zero = None if weights.symmetric else unpack_int32(parts["weight_zero_point"], weights.num_bits, n, dim=0)
        return QuantizedWeight(q=q, scale=scale, zero=zero, args=weights)

    def vllm_incompatibility(self, weights: QuantArgs, input_activations: QuantArgs | None = None) -> str | None:
        return vllm_incompatibility(weights)


register_codec(PackQuantizedCodec())
