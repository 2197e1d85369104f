"""SiLU-and-multiply of the fused gate/up output (kernels/activation.py)."""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.activation import silu_and_mul


class SiluAndMul(nn.Module):
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:], rounded as HF's LlamaMLP rounds."""

    def __init__(self, backend: str = "torch") -> None:
        super().__init__()
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, backend=self.backend)
