"""Rotary position embedding with the scaling variants Llama-family checkpoints ship with.

The inverse frequencies are HF transformers' own (its ROPE_INIT_FUNCTIONS, from the model's
config), so every variant matches the reference model exactly: "default", "linear" (Llama 2
long-context fine-tunes), "llama3" (Llama 3.1 / 3.2), "yarn" (Qwen2.5 / Qwen3 long context).
"dynamic" and "longrope" change the frequencies with the current sequence length, which a KV
cache cannot follow: they are refused with one line. cos/sin are tabulated once in float32
for every position up to max_position, and applied in place by kernels/rotary.py.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import UserError
from ...kernels.rotary import apply_rotary, apply_rotary_and_store, fused_store_ok, rotary_cos_sin

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")


def rope_parameters(config) -> dict:
    """The config's rope parameters as one dict with rope_type and rope_theta (transformers
    5 keeps them in ``rope_parameters``; 4.x in ``rope_theta`` + ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def inv_freq_and_scaling(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32, cos/sin scaling) as HF computes them."""
    params = rope_parameters(config)
    kind = params["rope_type"]
    if kind not in SUPPORTED_ROPE:
        raise UserError(f"rope_type {kind!r} is not supported (its frequencies change with the sequence "
                        f"length); supported: {', '.join(SUPPORTED_ROPE)}")
    if kind == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """forward(positions [T], q [T, Hq*D], k [T, Hkv*D]) rotates q and k in place."""

    def __init__(self, config, head_dim: int, max_position: int, device=None, backend: str = "torch") -> None:
        super().__init__()
        inv_freq, scaling = inv_freq_and_scaling(config, head_dim)
        self.head_dim, self.backend = head_dim, backend
        self.register_buffer("cos_sin_cache", rotary_cos_sin(inv_freq, max_position, scaling).to(device),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return apply_rotary(positions, q, k, self.cos_sin_cache, self.head_dim, backend=self.backend)

    def fuses_store(self, k_cache: torch.Tensor | None) -> bool:
        """Whether rotate_and_store can write this cache (full rotary, not FP8)."""
        return k_cache is not None and fused_store_ok(self.head_dim, self.cos_sin_cache, k_cache)

    def rotate_and_store(self, positions, q, k, v, k_cache, v_cache, slot_mapping) -> torch.Tensor:
        """Rotate q in place and write the rotated k and v into the paged cache: one kernel."""
        return apply_rotary_and_store(positions, q, k, v, self.cos_sin_cache, self.head_dim, k_cache, v_cache,
                                      slot_mapping, backend=self.backend)
