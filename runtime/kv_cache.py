"""The paged KV cache: one key and one value tensor per layer, [num_blocks, Hkv, block_size, D],
plus per-(token, head) float32 scales when the cache is FP8 (E4M3): each row's own (dynamic),
or, for a checkpoint whose kv_cache_scheme calibrated them, its layer's static per-head scales
written beside every row (the attention kernels read both alike)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.kv_cache_scheme import KVCacheScheme


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, checkpoint: KVCacheScheme | None) -> torch.dtype:
    """The cache's element type: "fp8" is E4M3 (with the checkpoint's static scales when it has
    them, else dynamic ones); "auto" follows the checkpoint: E4M3 when its kv_cache_scheme
    quantizes the cache, else the model's dtype."""
    if kv_cache_dtype == "fp8" or (kv_cache_dtype == "auto" and checkpoint is not None):
        return torch.float8_e4m3fn
    return model_dtype


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the cache's element type (torch.float8_e4m3fn for fp8)

    @property
    def fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers (K and V, scales included)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.num_kv_heads * self.block_size * self.head_dim * elem
        if self.fp8:
            per_layer += 2 * self.num_kv_heads * self.block_size * 4
        return self.num_layers * per_layer

    def bytes_per_token(self) -> float:
        return self.bytes_per_block() / self.block_size


class KVCache:
    """Allocates the cache and binds each attention layer to its slice."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV cache needs at least one block")
        self.spec, self.num_blocks = spec, num_blocks
        shape = (spec.num_layers, num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=device)
        if spec.fp8:
            sshape = shape[:-1]
            self.k_scale = torch.ones(sshape, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(sshape, dtype=torch.float32, device=device)
        else:
            self.k_scale = self.v_scale = None

    def bind(self, attention_layers) -> None:
        if len(attention_layers) != self.spec.num_layers:
            raise ValueError(f"{len(attention_layers)} attention layers for a {self.spec.num_layers}-layer cache")
        for i, layer in enumerate(attention_layers):
            layer.bind_kv_cache(self.k[i], self.v[i], None if self.k_scale is None else self.k_scale[i],
                                None if self.v_scale is None else self.v_scale[i])

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block()
