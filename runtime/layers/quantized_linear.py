"""QuantizedLinear: a linear layer that keeps a checkpoint's int4 weights packed and runs
the W4A16 kernels (their torch reference on a CPU without the Triton interpreter).

Swapped into a transformers model by optllm.quant.load.load_quantized(linear="kernel"); the
runtime reuses it. Weights of other bit widths have no kernel yet and are held dequantized.
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.w4a16 import W4A16Weight, prepack_w4a16, w4a16_linear
from ...quant.qweight import QuantizedWeight


class QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, group_size: int, backend: str = "auto") -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.backend = backend
        self.dense: torch.Tensor | None = None  # set for bit widths without a kernel

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                       backend: str = "auto") -> "QuantizedLinear":
        n, k = qw.shape
        gs = qw.args.group_size or k
        mod = cls(k, n, gs, backend)
        if qw.args.num_bits == 4:
            w = prepack_w4a16(qw.q.to(device), qw.scale.to(device), None if qw.zero is None else qw.zero.to(device),
                              gs, dtype=dtype)
            mod.register_buffer("packed", w.packed)
            mod.register_buffer("scales", w.scales)
            mod.register_buffer("zeros", w.zeros)
            mod.register_buffer("locks", w.locks, persistent=False)
        else:
            mod.register_buffer("dense", qw.dequantize().to(device=device, dtype=dtype))
        mod.register_buffer("bias", None if bias is None else bias.to(device=device, dtype=dtype))
        return mod

    def weight_view(self) -> W4A16Weight:
        return W4A16Weight(self.packed, self.scales, self.zeros, self.locks,
                           self.out_features, self.in_features, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return nn.functional.linear(x, self.dense.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if x.dtype != self.scales.dtype:  # the kernels take the activation dtype of their scales
            x = x.to(self.scales.dtype)
        return w4a16_linear(x, self.weight_view(), self.bias, backend=self.backend)

    def extra_repr(self) -> str:
        kind = "int4 packed" if self.dense is None else "dequantized"
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, {kind}"
