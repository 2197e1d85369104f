"""A quantized weight: integer codes plus the grid that maps them back to floats. How a
format stores one is its codec's business (formats/codec.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .args import QuantArgs
from .grid import dequantize


@dataclass
class QuantizedWeight:
    """Codes q [N, K] int8 in [qmin, qmax], scale [N, groups] (checkpoint dtype),
    zero [N, groups] int8 or None (symmetric)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    args: QuantArgs

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero, dtype)

    def cpu(self) -> "QuantizedWeight":
        return QuantizedWeight(q=self.q.cpu(), scale=self.scale.cpu(),
                               zero=None if self.zero is None else self.zero.cpu(), args=self.args)
