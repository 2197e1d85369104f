"""A quantized weight: integer codes plus the grid that maps them back to floats."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .args import QuantArgs
from .grid import dequantize
from .packing import pack_int32, unpack_int32


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

    def to_state_dict(self, prefix: str) -> dict[str, torch.Tensor]:
        """compressed-tensors `pack-quantized` tensors of one linear (prefix = module name)."""
        b = self.args.num_bits
        sd = {
            f"{prefix}.weight_packed": pack_int32(self.q, b, dim=1),
            f"{prefix}.weight_scale": self.scale.contiguous(),
            f"{prefix}.weight_shape": torch.tensor(self.q.shape, dtype=torch.int64),
        }
        if self.zero is not None:
            sd[f"{prefix}.weight_zero_point"] = pack_int32(self.zero, b, dim=0)
        return sd

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], prefix: str, args: QuantArgs) -> "QuantizedWeight":
        """Inverse of to_state_dict; raises ValueError when a tensor is missing or malformed."""
        try:
            packed = sd[f"{prefix}.weight_packed"]
            scale = sd[f"{prefix}.weight_scale"]
            shape = sd[f"{prefix}.weight_shape"]
        except KeyError as e:
            raise ValueError(f"checkpoint lacks {e.args[0]}") from None
        n, k = (int(v) for v in shape.tolist())
        q = unpack_int32(packed, args.num_bits, k, dim=1)
        if q.shape[0] != n or scale.shape != (n, args.groups(k)):
            raise ValueError(f"{prefix}: scale shape {tuple(scale.shape)} does not match weight [{n}, {k}]")
        zero = None
        if not args.symmetric:
            zp = sd.get(f"{prefix}.weight_zero_point")
            if zp is None:
                raise ValueError(f"checkpoint lacks {prefix}.weight_zero_point (asymmetric scheme)")
            zero = unpack_int32(zp, args.num_bits, n, dim=0)
        return cls(q=q, scale=scale, zero=zero, args=args)
