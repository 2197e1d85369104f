"""The k largest log-probabilities of each row of logits, in two kernel launches.

    lse = logsumexp(x32)                       x32 = the row in float32
    vals, ids = the k largest of x32, descending; ties: the lowest index first
    out = min(vals - lse, 0)                   (the k best log-softmax values, clamped to <= 0)

What an EAGLE-2 tree needs at each draft level: torch's log_softmax, then topk over a 49k
vocabulary, is a float copy of the logits, a softmax kernel, and a radix select of 4-5 kernels
per call, with the rows read and written several times; at batch 64 with 8 frontier nodes a
level they were half of a speculative step's GPU time. Here the logits are read once.

Stage 1, grid (rows, chunks of BLOCK columns): each program finds its chunk's max and sum of
exp(x - max), and its k best entries, by k rounds of a max over (value, index) keys packed in
one integer: the value's bits made order-preserving above the complement of the index, so the
max is unique, prefers the lower index among equal values, and removing it removes one entry
(16-bit logits: int32 keys of the value and the column in the chunk; float32: int64 keys).
Stage 2, grid (rows,): the k best of the chunks' candidates the same way, and the row's
log-sum-exp from the chunks' (max, sum) pairs.

NaN sorts above +inf (as in torch.topk); -inf entries (a reduced draft vocabulary's unmapped
words) are ordinary values that add nothing to the sum. A row must have at least k entries
(k <= V).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import pow2, use_triton

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_K = 64
_IDX = 0x7FFFFFFF  # the low word of a key: _IDX - index (a higher word: the lower index)


@triton.jit
def _keys(x, cols):
    """int64 keys of float32 values x at columns cols: order-preserving, one per entry."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)


@triton.jit
def _unkey(key):
    """(float32 value, int64 column) of int64 keys."""
    ordered = (key >> 32).to(tl.int32)
    bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
    low = key - ((key >> 32) << 32)  # the low word, in [0, 2^31)
    return bits.to(tl.float32, bitcast=True), 0x7FFFFFFF - low


@triton.jit(do_not_specialize=["R"])
def _chunk_kernel(x_ptr, keys_ptr, m_ptr, s_ptr, R, V, stride_x, S,
                  K: tl.constexpr, K_PAD: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr):
    """grid (R, S): row r's columns [c * BLOCK, +BLOCK): its max, sum of exp(x - max) and k best
    keys, to keys [R, S, K_PAD] (slots >= K untouched), m / s [R, S]. HALF (16-bit logits,
    BLOCK <= 65536): the rounds run on int32 keys, the value's 16 bits above (65535 - the
    column within the chunk), a third of the int64 keys' instructions."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    local = tl.arange(0, BLOCK)
    cols = c * BLOCK + local
    inside = cols < V
    raw = tl.load(x_ptr + r * stride_x + cols, mask=inside, other=float("-inf"))
    x = raw.to(tl.float32)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # all -inf: a sum of 0, not NaN
    s = tl.sum(tl.where(inside, tl.exp(x - m_safe), 0.0), axis=0)
    tl.store(m_ptr + r * S + c, m)
    tl.store(s_ptr + r * S + c, s)
    out = keys_ptr + (r * S + c) * K_PAD
    if HALF:
        bits = raw.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
        key = ((bits ^ ((bits >> 15) & 0x7FFF)) << 16) | (0xFFFF - local)
        for j in tl.static_range(K):
            best = tl.max(key, axis=0)
            hi = best >> 16
            val = (hi ^ ((hi >> 15) & 0x7FFF)).to(tl.int16).to(raw.dtype, bitcast=True).to(tl.float32)
            col = c * BLOCK + 0xFFFF - (best & 0xFFFF)
            tl.store(out + j, _keys(val, col))
            key = tl.where(key == best, -2147483647 - 1, key)
    else:
        key = _keys(x, cols)
        for j in tl.static_range(K):
            best = tl.max(key, axis=0)
            tl.store(out + j, best)
            key = tl.where(key == best, -9223372036854775807 - 1, key)


@triton.jit(do_not_specialize=["R"])
def _merge_kernel(keys_ptr, m_ptr, s_ptr, vals_ptr, ids_ptr, map_ptr, R, S,
                  K: tl.constexpr, K_PAD: tl.constexpr, S_PAD: tl.constexpr, HAS_MAP: tl.constexpr):
    """grid (R,): the k best of row r's S * K_PAD candidates and its log-sum-exp; vals float32
    [R, K] = min(value - lse, 0), ids int64 [R, K] (HAS_MAP: map[column])."""
    r = tl.program_id(0).to(tl.int64)
    ch = tl.arange(0, S_PAD)
    slot = tl.arange(0, K_PAD)
    cand_ok = (ch < S)[:, None] & (slot < K)[None, :]
    lowest = -9223372036854775807 - 1
    key = tl.load(keys_ptr + (r * S + ch[:, None]) * K_PAD + slot[None, :], mask=cand_ok, other=lowest)
    m = tl.load(m_ptr + r * S + ch, mask=ch < S, other=float("-inf"))
    s = tl.load(s_ptr + r * S + ch, mask=ch < S, other=0.0)
    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    total = tl.sum(s * tl.exp(m - big_safe), axis=0)
    lse = big_safe + tl.log(total)
    for j in tl.static_range(K):
        best = tl.max(tl.max(key, axis=1), axis=0)
        val, col = _unkey(best)
        tl.store(vals_ptr + r * K + j, tl.minimum(val - lse, 0.0))
        if HAS_MAP:
            col = tl.load(map_ptr + col)
        tl.store(ids_ptr + r * K + j, col)
        key = tl.where(key == best, lowest, key)


def topk_logprobs_ref(logits: torch.Tensor, k: int,
                      id_map: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch: log_softmax in float32, then topk (its own order among equal values), clamped to <= 0."""
    vals, ids = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1, sorted=True)
    return vals.clamp_max(0.0), ids if id_map is None else id_map[ids]


def _block(v: int) -> int:
    return min(4096, pow2(v))


def topk_logprobs(logits: torch.Tensor, k: int, backend: str = "auto",
                  id_map: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-softmax values of each row of logits [..., V] (bf16 / fp16 / fp32; last
    dim unit-stride) and their columns: (float32 [..., k] descending, clamped to <= 0; int64
    [..., k]). Triton: ties go to the lower column. id_map int64 [V]: ids are id_map[column]
    instead (a reduced draft vocabulary's target ids: read in the same launch). backend: "auto"
    (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch"."""
    if logits.dim() == 0 or logits.dtype not in DTYPES:
        raise ValueError(f"logits: must be a bf16/fp16/fp32 tensor [..., V], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    v = logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(MAX_K, v):
        raise ValueError(f"k={k!r} is not allowed; allowed: an integer in 1..{min(MAX_K, v)} (at most the "
                         f"vocabulary, {v}, and {MAX_K})")
    if id_map is not None and (id_map.shape != (v,) or id_map.dtype != torch.int64 or id_map.device != logits.device
                               or not id_map.is_contiguous()):
        raise ValueError(f"id_map: must be a contiguous int64 [{v}] tensor on {logits.device}, got {id_map.dtype} "
                         f"{tuple(id_map.shape)} on {id_map.device}")
    if not use_triton(backend, logits):
        return topk_logprobs_ref(logits, k, id_map)
    lead = logits.shape[:-1]
    x = logits.reshape(-1, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    r = x.shape[0]
    dev = x.device
    vals = torch.empty(r, k, dtype=torch.float32, device=dev)
    ids = torch.empty(r, k, dtype=torch.int64, device=dev)
    if r == 0:
        return vals.view(*lead, k), ids.view(*lead, k)
    block = _block(v)
    s = -(-v // block)
    k_pad = pow2(k)
    keys = torch.empty(r, s, k_pad, dtype=torch.int64, device=dev)
    m = torch.empty(r, s, dtype=torch.float32, device=dev)
    sums = torch.empty(r, s, dtype=torch.float32, device=dev)
    _chunk_kernel[(r, s)](x, keys, m, sums, r, v, x.stride(0), s, K=k, K_PAD=k_pad, BLOCK=block,
                          HALF=x.dtype != torch.float32, num_warps=4 if block <= 2048 else 8)
    _merge_kernel[(r,)](keys, m, sums, vals, ids, ids if id_map is None else id_map, r, s, K=k, K_PAD=k_pad,
                        S_PAD=pow2(s), HAS_MAP=id_map is not None, num_warps=1 if pow2(s) * k_pad <= 256 else 4)
    return vals.view(*lead, k), ids.view(*lead, k)
