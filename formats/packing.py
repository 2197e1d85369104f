"""Pack signed b-bit integer codes into int32 words, as compressed-tensors `pack-quantized`.

The layout is a dense bit stream along the packed dimension: code i of a row occupies bits
[i*b, (i+1)*b) of the row's stream, words are little-end first, codes are stored unsigned
(q + 2^(b-1)), and a code may straddle two words when 32 is not a multiple of b. For b = 4
this is the classic "8 codes per int32, code j in bits [4j, 4j+4)" layout vLLM reads.
"""

from __future__ import annotations

import math

import torch


def _check_bits(num_bits: int) -> None:
    if not 1 <= num_bits <= 8:
        raise ValueError(f"num_bits={num_bits} cannot be packed; allowed: 1..8")


def pack_int32(q: torch.Tensor, num_bits: int, dim: int = 1) -> torch.Tensor:
    """Signed int8 codes [R, C] -> int32 words, packed along ``dim`` (1: [R, ceil(C*b/32)])."""
    _check_bits(num_bits)
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"expected a 2-D int8 tensor of codes, got {q.dim()}-D {q.dtype}")
    if dim == 0:
        return pack_int32(q.t(), num_bits, 1).t().contiguous()
    rows, cols = q.shape
    u = (q.to(torch.int64) + (1 << (num_bits - 1))) & ((1 << num_bits) - 1)
    pos = torch.arange(cols, device=q.device, dtype=torch.int64) * num_bits
    word, shift = pos // 32, pos % 32
    nwords = math.ceil(cols * num_bits / 32)
    # int64 accumulation: the low 32 bits of each word, plus the spill of straddling codes
    acc = torch.zeros(rows, nwords + 1, dtype=torch.int64, device=q.device)
    acc.index_add_(1, word, u << shift)
    spill = shift + num_bits > 32
    if spill.any():
        acc.index_add_(1, word[spill] + 1, u[:, spill] >> (32 - shift[spill]))
    low = acc[:, :nwords] & 0xFFFFFFFF
    return torch.where(low >= 2**31, low - 2**32, low).to(torch.int32).contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """int32 words -> signed int8 codes; ``length`` is the unpacked size along ``dim``."""
    _check_bits(num_bits)
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"expected a 2-D int32 tensor of packed words, got {packed.dim()}-D {packed.dtype}")
    if dim == 0:
        return unpack_int32(packed.t(), num_bits, length, 1).t().contiguous()
    if packed.shape[1] != math.ceil(length * num_bits / 32):
        raise ValueError(
            f"packed width {packed.shape[1]} does not hold {length} {num_bits}-bit codes "
            f"(expected {math.ceil(length * num_bits / 32)} words)"
        )
    w = packed.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[:, :1])], dim=1)
    pos = torch.arange(length, device=packed.device, dtype=torch.int64) * num_bits
    word, shift = pos // 32, pos % 32
    both = w[:, word] | (w[:, word + 1] << 32)
    u = (both >> shift) & ((1 << num_bits) - 1)
    return (u - (1 << (num_bits - 1))).to(torch.int8)
