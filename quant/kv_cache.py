"""FP8 KV cache calibration: static K and V scales from the calibration data.

`--kv-cache fp8` (one scale per layer for its keys, one for its values: compressed-tensors'
strategy "tensor") or `fp8-head` (one per KV head: "attn_head"). The scales are amax / 448 over
what the runtime's cache would hold: the keys after the rotary (and after Qwen3's k-norm) and
the values, as each attention layer hands them to its KV cache. The observer stands in for
transformers' Cache object, whose update(key_states, value_states, ...) every attention layer
calls with exactly those tensors ([batch, kv_heads, seq, head_dim]); it records their amax and
gives them back unchanged, so the block's outputs are what they are without it.

The pipeline observes each block on its last pass over the calibration data (advance_block),
after the block's weights were quantized and with the inputs earlier quantized blocks made:
the keys and values the served checkpoint computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..formats.kv_cache_scheme import FP8_E4M3_MAX, KV_SCALE_NAMES, KVCacheScheme
from ..hub.architectures import Architecture

# --kv-cache choice -> compressed-tensors strategy
KV_CACHE_CHOICES = {"fp8": "tensor", "fp8-head": "attn_head"}


def kv_cache_scheme(choice: str | None) -> KVCacheScheme | None:
    """The scheme a --kv-cache choice names (None or "none": the cache is not quantized)."""
    if choice is None or choice == "none":
        return None
    if choice not in KV_CACHE_CHOICES:
        raise ValueError(f"kv_cache={choice!r} is not allowed; allowed: none, {', '.join(KV_CACHE_CHOICES)}")
    return KVCacheScheme(KV_CACHE_CHOICES[choice])


def attention_module(arch: Architecture) -> str:
    """The attention module of a block, relative to it ("self_attn"): where the scales live."""
    return arch.qkv[0].rpartition(".")[0]


@dataclass
class KVObserver:
    """A transformers Cache stand-in that keeps the running amax of each KV head's keys and
    values (float32 [kv_heads]) over every update."""

    k_amax: torch.Tensor | None = None
    v_amax: torch.Tensor | None = None
    tokens: int = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states [batch, kv_heads, seq, head_dim]; returned unchanged."""
        k = key_states.detach().abs().amax(dim=(0, 2, 3)).float().cpu()
        v = value_states.detach().abs().amax(dim=(0, 2, 3)).float().cpu()
        self.k_amax = k if self.k_amax is None else torch.maximum(self.k_amax, k)
        self.v_amax = v if self.v_amax is None else torch.maximum(self.v_amax, v)
        self.tokens += key_states.shape[0] * key_states.shape[2]
        return key_states, value_states

    def scales(self, scheme: KVCacheScheme) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_scale, v_scale) float32 in the checkpoint's shape: amax / 448 per head, or of
        the whole layer (the largest head's) per tensor. RuntimeError when nothing was seen."""
        if self.k_amax is None:
            raise RuntimeError("the KV cache observer saw no keys: the block's attention never updated its cache")
        heads = self.k_amax.numel()
        out = []
        for amax in (self.k_amax, self.v_amax):
            a = amax.amax().reshape(1) if scheme.strategy == "tensor" else amax
            # a tensor divisor, as the kernels' reference: IEEE division, not a reciprocal multiply
            s = (a / torch.full_like(a, FP8_E4M3_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
            out.append(s.reshape(scheme.scale_shape(heads)))
        return out[0], out[1]


@dataclass
class KVCalibration:
    """Every block's observed scales, by checkpoint tensor name, and what the report says of them."""

    scheme: KVCacheScheme
    arch: Architecture
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)

    def add(self, index: int, observer: KVObserver) -> None:
        k, v = observer.scales(self.scheme)
        prefix = f"{self.arch.block_prefix(index)}.{attention_module(self.arch)}"
        self.tensors[f"{prefix}.{KV_SCALE_NAMES[0]}"] = k
        self.tensors[f"{prefix}.{KV_SCALE_NAMES[1]}"] = v
        self.layers.append({"index": index, "k_scale": k.reshape(-1).tolist(), "v_scale": v.reshape(-1).tolist(),
                            "k_amax": observer.k_amax.tolist(), "v_amax": observer.v_amax.tolist(),
                            "tokens": observer.tokens})

    def report(self, choice: str) -> dict:
        return {"kv_cache": choice, "strategy": self.scheme.strategy, "format": "float8_e4m3fn",
                "scale": "amax / 448 over the calibration data's post-rotary keys (values)", "layers": self.layers}
