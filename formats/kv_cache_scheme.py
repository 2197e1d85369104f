"""A checkpoint's FP8 KV cache: compressed-tensors' ``kv_cache_scheme`` and its scale tensors.

``quantization_config.kv_cache_scheme`` holds the QuantizationArgs of the cached keys and
values: 8-bit float (E4M3), symmetric, static, with strategy "tensor" (one scale for all of a
layer's keys, one for its values) or "attn_head" (one per KV head). Each decoder block's
attention module carries the scales as ``{block}.self_attn.k_scale`` / ``.v_scale``, the names
llm-compressor writes and vLLM reads, shaped as compressed-tensors initialises them: (1,) per
tensor, (num_kv_heads, 1, 1) per head. A cached element is stored / scale, rounded to E4M3 and
clipped to +-448, and read back as stored * scale; calibration sets scale = amax / 448 over the
post-rotary keys (values) the calibration data produces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_SCALE_NAMES = ("k_scale", "v_scale")
KV_STRATEGIES = ("tensor", "attn_head")
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class KVCacheScheme:
    """FP8 (E4M3) keys and values with static scales, per tensor or per KV head."""

    strategy: str = "tensor"

    def __post_init__(self) -> None:
        if self.strategy not in KV_STRATEGIES:
            raise ValueError(f"kv cache strategy={self.strategy!r} is not supported; allowed: "
                             f"{', '.join(KV_STRATEGIES)}")

    def to_compressed_tensors(self) -> dict:
        """config.json's ``kv_cache_scheme`` (compressed-tensors' QuantizationArgs fields)."""
        return {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": self.strategy,
            "group_size": None,
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
            "observer_kwargs": {},
            "block_structure": None,
        }

    @classmethod
    def from_compressed_tensors(cls, d: dict) -> "KVCacheScheme":
        """Inverse of to_compressed_tensors; ValueError for a KV cache quantization this
        scheme cannot hold (integer, not 8 bits, asymmetric, dynamic, other strategies)."""
        if not isinstance(d, dict):
            raise ValueError(f"kv_cache_scheme must be a mapping, got {type(d).__name__}")
        kind, bits = d.get("type", "int"), d.get("num_bits")
        if kind != "float" or bits != 8:
            raise ValueError(f"kv_cache_scheme {kind} {bits}-bit is not supported; allowed: float 8-bit (E4M3)")
        if not d.get("symmetric", True):
            raise ValueError("an asymmetric kv_cache_scheme is not supported; allowed: symmetric")
        if d.get("dynamic", False) is not False:
            raise ValueError(f"kv_cache_scheme dynamic={d.get('dynamic')!r} is not supported; allowed: false "
                             "(static scales; dynamic ones are the runtime's --kv-cache-dtype fp8)")
        return cls(strategy=d.get("strategy") or "tensor")

    def scale_shape(self, num_kv_heads: int) -> tuple[int, ...]:
        """The shape of one layer's k_scale / v_scale tensor in the checkpoint."""
        return (1,) if self.strategy == "tensor" else (num_kv_heads, 1, 1)

    def per_head(self, scale: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """A checkpoint scale tensor as float32 [num_kv_heads] (a per-tensor one repeated);
        ValueError for a wrong shape or a scale that is not finite and positive."""
        if scale.numel() not in ((1,) if self.strategy == "tensor" else (num_kv_heads,)):
            raise ValueError(f"a {self.strategy} kv_cache_scheme needs {self.scale_shape(num_kv_heads)} scales, "
                             f"got {tuple(scale.shape)}")
        s = scale.detach().float().reshape(-1)
        if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise ValueError(f"scales must be finite and > 0, got {s.tolist()}")
        return s.expand(num_kv_heads).contiguous()
