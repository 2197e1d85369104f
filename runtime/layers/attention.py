"""Attention over the paged KV cache, and the per-step metadata every layer reads.

The new tokens' K/V are written to their cache slots first; attention then reads every key
(cached prefix and new tokens alike) from the paged cache: the split-K decode kernel when
each sequence brings one token, the extend kernel otherwise (prefill, chunked prefill,
prefix-cache hits, token trees under a mask). The metadata travels as an argument through
the model's forward: no module-global context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...kernels.extend_attention import paged_extend_attention
from ...kernels.paged_attention import paged_decode_attention, store_kv_cache


@dataclass
class AttentionMetadata:
    """One step's batch as the attention kernels see it (all tensors on the model's device).

    slot_mapping: int64 [T], the cache slot of each new token (-1: not stored).
    block_tables: int32 [B, max_blocks], each sequence's KV blocks. seq_lens: int32 [B],
    keys per sequence including this step's tokens. decode: one new token per sequence
    (T == B). cu_seqlens_q: int32 [B + 1], sequence b's new tokens are rows
    cu_seqlens_q[b]:cu_seqlens_q[b + 1] (None when decode). max_seqlen_q: host int.
    num_splits: decode's split count along the sequence (None: the kernel chooses).
    mask / mask_offsets: optional token-tree mask over each sequence's new tokens; mask_cols: the
    keys each mask row covers, the sequence's last (0: its new tokens; more: rows written before
    too, as a draft's tree level over the rows of earlier levels). padded: rows past
    cu_seqlens_q[B] are padding (a graph's token bucket): their attention output is zeros, not
    left unwritten (garbage there would overflow in the layers after: harmless to the real rows,
    which no layer mixes with others, but not worth the NaNs).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    decode: bool
    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 1
    num_splits: int | None = None
    mask: torch.Tensor | None = None
    mask_offsets: torch.Tensor | None = None
    mask_cols: int = 0
    padded: bool = False


class Attention(nn.Module):
    """q [T, Hq*D], k/v [T, Hkv*D] (views of the fused QKV output) -> [T, Hq*D]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int = 0,
                 backend: str = "torch") -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.backend = scale, sliding_window or 0, backend
        self.k_cache = self.v_cache = self.k_scale = self.v_scale = None
        # a checkpoint's calibrated fp8 scales, float32 [Hkv] (None: an fp8 cache takes each row's amax)
        self.static_k_scale = self.static_v_scale = None

    def set_static_kv_scale(self, name: str, scale: torch.Tensor) -> None:
        """name "k_scale" | "v_scale": the calibrated scale of this layer's keys | values per KV
        head (float32 [Hkv]), with which an fp8 cache stores them (the loader sets both)."""
        if name not in ("k_scale", "v_scale") or tuple(scale.shape) != (self.num_kv_heads,):
            raise ValueError(f"expected k_scale or v_scale of shape ({self.num_kv_heads},), got {name} "
                             f"{tuple(scale.shape)}")
        setattr(self, f"static_{name}", scale.float().contiguous())

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
        """This layer's cache: [num_blocks, Hkv, block_size, D] (+ fp8 scales [num_blocks, Hkv, block_size])."""
        self.k_cache, self.v_cache, self.k_scale, self.v_scale = k_cache, v_cache, k_scale, v_scale
        if k_cache is not None and self.static_k_scale is not None:  # the static scales live beside the cache
            self.static_k_scale = self.static_k_scale.to(k_cache.device)
            self.static_v_scale = self.static_v_scale.to(k_cache.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        """k, v None: this step's K/V are already in the cache (the fused rotary + store wrote them)."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        if k is not None:
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            static = self.k_scale is not None and self.static_k_scale is not None  # an fp8 cache, calibrated
            store_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, k_scale=self.k_scale,
                           v_scale=self.v_scale, backend=self.backend,
                           static_k_scale=self.static_k_scale if static else None,
                           static_v_scale=self.static_v_scale if static else None)
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale, sliding_window=self.sliding_window,
                      backend=self.backend)
        if meta.decode:
            out = paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, self.scale,
                                         num_splits=meta.num_splits, **scales)
        else:
            out = paged_extend_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                         meta.cu_seqlens_q, meta.max_seqlen_q, self.scale, mask=meta.mask,
                                         mask_offsets=meta.mask_offsets, mask_cols=meta.mask_cols,
                                         out=torch.zeros_like(q) if meta.padded else None, **scales)
        return out.view(t, self.num_heads * self.head_dim)
