"""RMSNorm, optionally fused with the residual add that precedes it (kernels/rmsnorm.py)."""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """forward(x) -> norm(x) * w; forward(x, residual) -> (norm(x + residual) * w, x + residual),
    rounded as HF's LlamaRMSNorm rounds."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32, device=None,
                 backend: str = "torch") -> None:
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.loaded: set = set()

    def expected_loads(self) -> set:
        return {("weight", None)}

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        if name != "weight" or loaded.shape != self.weight.shape:
            raise ValueError(f"norm: expected weight {tuple(self.weight.shape)}, got {name} {tuple(loaded.shape)}")
        self.weight.data.copy_(loaded)
        self.loaded.add(("weight", None))

    def process_weights_after_loading(self) -> None:
        pass

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
        """residual_out: where x + residual goes (kernels/rmsnorm.py's rms_norm)."""
        return rms_norm(x, self.weight, self.eps, residual=residual, backend=self.backend, residual_out=residual_out)
