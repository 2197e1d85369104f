"""W4A16 GEMM: int4 weights with grouped scales (and optional zero points) times bf16/fp16
activations, fp32 accumulation on the tensor cores.

    y[m, n] = sum_k x[m, k] * w[n, k],   w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]

Layout: the checkpoint's words, nibbles reordered inside each word, scales transposed
    ``packed`` is int32 [N, K // 8], K contiguous: word (n, c) holds u = q + 8 of
    k = 8c .. 8c + 7, as the compressed-tensors ``pack-quantized`` ``weight_packed`` that
    vLLM reads, except that nibble j (bits [4j, 4j + 4)) holds k = 8c + _NIBBLE_K[j]: 0, 2,
    4, 6 in nibbles 0..3 and 1, 3, 5, 7 in nibbles 4..7, so nibbles j and j + 4 are the
    consecutive pair (8c + 2j, 8c + 2j + 1) that one lop3 turns into a bf16x2 and that meets
    one bf16x2 pair of x. Repacked once at load (``prepack_w4a16``), because the checkpoint
    order would need a byte permute per pair on the hot path. ``scales`` [K // G, N] and
    ``zeros`` int8 [K // G, N] are transposed (N contiguous: a K-block reads one coalesced
    row of them).
Dequantization (in registers, per K-block of BLOCK_K <= G, so one scale per column)
    On CUDA with bf16/fp16 activations a few PTX instructions per word make pairs: one lop3
    puts nibbles j and j + 4 into the mantissas of a bf16x2 (fp16x2) 128 + u (1024 + u),
    one packed FMA subtracts 136 + zero (exact: small integers), one packed multiply applies
    the scale, rounding once. That is exactly the bf16 weight the checkpoint dequantizes to
    ((q - zero) * scale in the scale dtype), so the tensor-core kernels and a dequantized
    model differ only in summation order. Elsewhere (fp32, the CPU interpreter, and the
    tiled path, see _launch) plain float ops compute the same values. The eight nibble
    slices are interleaved back into K order with a ``tl.join`` tree and a free reshape.
Paths (kernels/w4a16_configs.py picks one per (M, N, K))
    * gemv (M = 1): CUDA cores, one x row per program; with bf16 the products (q - zero) * x
      are formed and summed four pairs deep in bf16x2, then in fp32 (relative error per
      output about twice a bf16 rounding; see _GEMV_ASM_BF16).
    * swap_ab (small M): y^T = W x^T -- the weight tile is the MMA's M side (64+ rows fill
      a Hopper wgmma), the few x rows its N side.
    * tiled: x [BM, BK] @ W^T tile.
    * dequant: dequantize the weight to a bf16 scratch once, then cuBLAS (large M, where
      the GEMM is compute-bound and the extra pass costs a few per cent).
Split-K: each split stores its fp32 partial tile into a workspace and bumps a per-tile
counter (``W4A16Weight.locks``); the last split to arrive sums the partials in split order
(deterministic), adds the bias, writes y and resets the counter. One launch, no float
atomics, no memset -- but one weight must not run on two streams at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import CompiledLaunch, grouped_tile, interpreting, pow2
from .w4a16_configs import (  # noqa: F401
    M_BUCKETS,
    W4A16_CONFIGS,
    W4A16Config,
    default_w4a16_config,
    lookup_w4a16_config,
    m_bucket,
)

BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOCK_SLOTS = 1024  # output tiles one launch may split over K; more tiles -> no split-K
# nibble j of a word holds k = 8c + _NIBBLE_K[j]: nibbles j and j + 4 are consecutive k, so
# one lop3 on the word shifted by 4j yields the bf16x2 pair (k, k + 1) = one x pair
_NIBBLE_K = [0, 2, 4, 6, 1, 3, 5, 7]
_K_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]  # its inverse: k = 8c + i lives in nibble _K_NIBBLE[i]


# --------------------------------------------------------------------------- weight
@dataclass(frozen=True)
class W4A16Weight:
    """Prepacked int4 weight of a [N, K] linear (see the module docstring for the layout).

    packed: int32 [N, K // 8] (n_major False) or its transpose [K // 8, N] (n_major True);
    scales: [K // group_size, N] float; zeros: int8 [K // group_size, N] or None
    (symmetric); locks: int32 [LOCK_SLOTS] split-K counters, zero between calls.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    locks: torch.Tensor
    N: int
    K: int
    group_size: int
    n_major: bool = False


def _check_quantized(q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                     group_size: int) -> None:
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"q: must be a 2-D int8 tensor [N, K], got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    if k % 8 != 0:
        raise ValueError(f"K: in_features must be a multiple of 8, got {k}")
    if group_size <= 0 or k % group_size != 0:
        raise ValueError(f"group_size: must divide K={k}, got {group_size}")
    if group_size % 32 != 0 and group_size != k:
        raise ValueError(f"group_size: must be a multiple of 32 or K={k}, got {group_size}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("q: values must lie in the signed int4 range [-8, 7]")
    groups = (n, k // group_size)
    if not scales.is_floating_point() or tuple(scales.shape) != groups:
        raise ValueError(f"scales: must be a float tensor of shape {groups}, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    if zeros is not None and (zeros.dtype != torch.int8 or tuple(zeros.shape) != groups):
        raise ValueError(f"zeros: must be None or an int8 tensor of shape {groups}, got "
                         f"{zeros.dtype} {tuple(zeros.shape)}")
    if zeros is not None and zeros.numel() and (int(zeros.min()) < -8 or int(zeros.max()) > 7):
        raise ValueError("zeros: values must lie in the signed int4 range [-8, 7]")


def prepack_w4a16(q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                  group_size: int, dtype: Optional[torch.dtype] = None,
                  n_major: bool = False) -> W4A16Weight:
    """Pack quantized values into the kernels' layout (once, at load).

    q: int8 [N, K] in [-8, 7]; scales: [N, K // group_size] float; zeros: int8
    [N, K // group_size] in [-8, 7] or None; group_size: a multiple of 32 dividing K, or K
    (per-channel). dtype: cast the scales to it (use the activation dtype: the fast
    dequantization needs scales in x's dtype); None keeps them. n_major: store the words
    transposed, [K // 8, N] (each word still holds eight k of one n): a warp then reads
    consecutive n of one k range, which the N-major GEMV streams (see _w4a16_gemv_n_kernel).
    Dequantized weight: (q - zero) * scale.
    """
    _check_quantized(q, scales, zeros, group_size)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating dtype or None, got {dtype}")
    n, k = q.shape
    u = (q.to(torch.int32) + 8).view(n, k // 8, 8)[:, :, _NIBBLE_K]  # nibble j <- k = 8c + _NIBBLE_K[j]
    # nibble 7 enters as its signed value so the sum stays inside int32 without wrapping
    top = ((u[:, :, 7] ^ 8) - 8) << 28
    shifts = 4 * torch.arange(7, device=q.device, dtype=torch.int32)
    words = (u[:, :, :7] << shifts).sum(dim=2, dtype=torch.int32) + top
    scales_t = scales.t().contiguous() if dtype is None else scales.t().to(dtype).contiguous()
    zeros_t = None if zeros is None else zeros.t().contiguous()
    locks = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=q.device)
    words = words.t().contiguous() if n_major else words.contiguous()
    return W4A16Weight(words, scales_t, zeros_t, locks, n, k, group_size, n_major)


def dequantize_w4a16(w: W4A16Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack to the dense weight (q - zero) * scale, [N, K] in dtype (computed in float32,
    rounded once to dtype: the same bits as the kernels' and the checkpoint's dequant)."""
    shifts = 4 * torch.arange(8, device=w.packed.device, dtype=torch.int32)
    words = w.packed.t() if w.n_major else w.packed
    u = (words.unsqueeze(-1) >> shifts) & 15  # [N, K // 8, nibble]
    q = u[:, :, _K_NIBBLE].reshape(w.N, w.K).float() - 8.0
    s = w.scales.t().float().repeat_interleave(w.group_size, dim=1)
    if w.zeros is not None:
        q = q - w.zeros.t().float().repeat_interleave(w.group_size, dim=1)
    return (q * s).to(dtype)


def w4a16_linear_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                     zeros: Optional[torch.Tensor], group_size: int,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain float32 reference from the unpacked values: x [..., K], q int8 [N, K],
    scales / zeros [N, K // group_size] -> y [..., N] float32."""
    s = scales.float().repeat_interleave(group_size, dim=1)
    qz = q.float() if zeros is None else q.float() - zeros.float().repeat_interleave(group_size, dim=1)
    y = x.float() @ (qz * s).t()
    return y if bias is None else y + bias.float()


# --------------------------------------------------------------------------- kernels
def _nibble_pairs(word: str, then) -> str:
    """PTX for the four nibble pairs (j, j + 4) of ``word``: pair j is shifted down, lop3-ed
    into the mantissas of the x2 register ``p`` over the magic ``m``, then ``then(j)``'s
    instructions consume it."""
    lines = []
    for j in range(4):
        if j:
            lines.append(f"shr.u32 t, {word}, {4 * j};")
        lines.append(f"lop3.b32 p, {word if j == 0 else 't'}, 0x000F000F, m, 0xEA;")
        lines.append(then(j))
    return "\n".join(lines)


def _ptx(regs: str, magic: str, one: str, pairs: str, tail: str = "") -> str:
    return (f"\n{{\n.reg .b32 {regs};\nmov.b32 m, {magic};\nmov.b32 c1, {one};\n"
            f"mov.b32 nz, 0x80008000;\n{pairs}\n{tail}}}\n")


# Tensor-core dequant: $0..$7 = the eight nibbles as 16-bit floats, $8 = word, $9 =
# -(magic base + 8 + zero) x2, $10 = scale x2. magic: 128 + u (bf16) or 1024 + u (fp16)
# once a nibble is or-ed in; one: 1.0 x2.
def _dequant_ptx(magic: str, one: str, ty: str) -> str:
    def then(j):
        return (f"fma.rn.{ty} p, p, c1, $9;\nfma.rn.{ty} p, p, $10, nz;\n"
                f"mov.b32 {{${j}, ${j + 4}}}, p;")
    return _ptx("t, p, m, c1, nz", magic, one, _nibble_pairs("$8", then))


_ASM_BF16 = tl.constexpr(_dequant_ptx("0x43004300", "0x3F803F80", "bf16x2"))
_ASM_FP16 = tl.constexpr(_dequant_ptx("0x64006400", "0x3C003C00", "f16x2"))


# GEMV: dot product of one word's eight (q - zero) with the matching four x pairs; products
# and the four-pair chain in bf16x2 (rounding 2^-9 each, like one bf16 rounding of y), the
# two halves added in fp32. $0 = result, $1 = word, $2..$5 = x pairs, $6 = -(136 + zero) x2.
def _gemv_then(j):
    return f"fma.rn.bf16x2 q, p, c1, $6;\nfma.rn.bf16x2 r, q, ${j + 2}, {'nz' if j == 0 else 'r'};"


_GEMV_ASM_BF16 = tl.constexpr(_ptx(
    "t, p, q, r, m, c1, nz, a, b", "0x43004300", "0x3F803F80", _nibble_pairs("$1", _gemv_then),
    "and.b32 a, r, 0xFFFF0000;\nshl.b32 b, r, 16;\nadd.f32 $0, a, b;\n"))


@triton.jit
def _pair(v):
    """A 16-bit float tensor's bits, twice, in one int32 (a packed x2 operand)."""
    lo = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo | (lo << 16)


@triton.jit
def _magic_f32(v):
    """The low nibble u of each int32 as the float32 2^23 + u (exact; one and-or, no
    int-to-float conversion)."""
    return ((v & 15) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _dequant_tile(words, s, zoff, dtype: tl.constexpr, USE_ASM: tl.constexpr):
    """words int32 [BN, BKW] -> weight tile [BN, 8 * BKW] in dtype, K order.

    s: [BN] scales (fp32 values of the scale dtype); zoff: [BN] fp32 8 + zero.
    """
    if USE_ASM:
        if dtype == tl.float16:
            negc = tl.broadcast_to(_pair((-(zoff + 1024.0)).to(dtype))[:, None], words.shape)
            s2 = tl.broadcast_to(_pair(s.to(dtype))[:, None], words.shape)
            e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
                _ASM_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, negc, s2],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            negc = tl.broadcast_to(_pair((-(zoff + 128.0)).to(dtype))[:, None], words.shape)
            s2 = tl.broadcast_to(_pair(s.to(dtype))[:, None], words.shape)
            e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
                _ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [words, negc, s2],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        s_ = s[:, None]
        z_ = zoff[:, None] + 8388608.0
        e0 = ((_magic_f32(words >> 0) - z_) * s_).to(dtype)
        e1 = ((_magic_f32(words >> 4) - z_) * s_).to(dtype)
        e2 = ((_magic_f32(words >> 8) - z_) * s_).to(dtype)
        e3 = ((_magic_f32(words >> 12) - z_) * s_).to(dtype)
        e4 = ((_magic_f32(words >> 16) - z_) * s_).to(dtype)
        e5 = ((_magic_f32(words >> 20) - z_) * s_).to(dtype)
        e6 = ((_magic_f32(words >> 24) - z_) * s_).to(dtype)
        e7 = ((_magic_f32(words >> 28) - z_) * s_).to(dtype)
    # position 4a + 2b + c of a word's eight (k = 8c' + 4a + 2b + c): c picks the outer join,
    # b the middle, a the inner; even k sit in nibbles 0..3, odd k in nibbles 4..7
    t = tl.join(tl.join(tl.join(e0, e2), tl.join(e1, e3)), tl.join(tl.join(e4, e6), tl.join(e5, e7)))
    return tl.reshape(t, (words.shape[0], words.shape[1] * 8))


@triton.jit
def _group_params(s_ptr, z_ptr, kb, blocks_per_group, offs_n, mask, N, HAS_ZEROS: tl.constexpr):
    """fp32 scales [BN] and 8 + zero [BN] of the quantization group holding K-block kb."""
    g = kb // blocks_per_group
    s = tl.load(s_ptr + g * N + offs_n, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zoff = tl.load(z_ptr + g * N + offs_n, mask=mask, other=0).to(tl.float32) + 8.0
    else:
        zoff = tl.zeros_like(s) + 8.0
    return s, zoff


@triton.jit
def _load_block(w_ptr, s_ptr, z_ptr, kb, offs_n, n_mask, N, K, KW, stride_wn, stride_wk, blocks_per_group,
                dtype: tl.constexpr, BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr,
                USE_ASM: tl.constexpr):
    """Dequantized weight tile [BN, BLOCK_K] of K-block kb, K order (zeros past K are
    harmless: the matching x columns load as zero)."""
    BKW: tl.constexpr = BLOCK_K // 8
    cols = kb * BKW + tl.arange(0, BKW)
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + cols[None, :] * stride_wk,
                    mask=n_mask[:, None] & (cols < KW)[None, :], other=0)
    s, zoff = _group_params(s_ptr, z_ptr, kb, blocks_per_group, offs_n, n_mask, N, HAS_ZEROS)
    return _dequant_tile(words, s, zoff, dtype, USE_ASM)


@triton.jit
def _store_out(acc, offs_m, offs_n, mask, y_ptr, stride_ym, b_ptr, N, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_offs = offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, y_ptr, stride_ym, b_ptr, ws_ptr, lock_ptr, tile, pid_k,
              split, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        ws_offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * M * N + ws_offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split - 1:
            total = tl.zeros_like(acc)
            for s in range(split):  # fixed order: same bits whoever is last
                total += tl.load(ws_ptr + s * M * N + ws_offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            _store_out(total, offs_m, offs_n, mask, y_ptr, stride_ym, b_ptr, N, HAS_BIAS)
            tl.atomic_xchg(lock_ptr + tile, 0)
    else:
        _store_out(acc, offs_m, offs_n, mask, y_ptr, stride_ym, b_ptr, N, HAS_BIAS)


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    # DOT_F32: fp32 activations, or the CPU interpreter, which multiplies bf16 as raw
    # uint16; products of bf16/fp16 operands are exact in fp32, so the numbers match.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# sizes that change from step to step are not specialized on (== 1, % 16): no compile mid-serving
@triton.jit(do_not_specialize=["M"])
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
                  M, N, K, KW, stride_wn, stride_wk, stride_xm, stride_ym, blocks_per_group,
                  blocks_per_split, split,
                  HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SWAP_AB: tl.constexpr,
                  USE_ASM: tl.constexpr, DOT_F32: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT: tl.constexpr, GROUP_M: tl.constexpr):
    """grid (M tiles * N tiles, K splits). SWAP_AB: acc^T [BN, BM] += W [BN, BK] @ x^T."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    dtype = x_ptr.dtype.element_ty
    kb0 = pid_k * blocks_per_split
    nblocks = tl.minimum(blocks_per_split, tl.cdiv(K, BLOCK_K) - kb0)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(nblocks):
        kb = kb0 + i
        ks = kb * BLOCK_K + offs_k
        w = _load_block(w_ptr, s_ptr, z_ptr, kb, offs_n, n_mask, N, K, KW, stride_wn, stride_wk,
                        blocks_per_group, dtype, BLOCK_K, HAS_ZEROS, USE_ASM)
        if SWAP_AB:
            xt = tl.load(x_rows[None, :] + ks[:, None], mask=(ks < K)[:, None] & m_mask[None, :],
                         other=0.0)
            acc = _dot(w, xt, acc, DOT_F32)
        else:
            xt = tl.load(x_rows[:, None] + ks[None, :], mask=m_mask[:, None] & (ks < K)[None, :],
                         other=0.0)
            acc = _dot(xt, tl.trans(w), acc, DOT_F32)
    if SWAP_AB:
        acc = tl.trans(acc)
    _epilogue(acc, offs_m, offs_n, M, N, y_ptr, stride_ym, b_ptr, ws_ptr, lock_ptr,
              pid_m * num_pid_n + pid_n, pid_k, split, HAS_BIAS, SPLIT)


# sizes that change from step to step are not specialized on (== 1, % 16): no compile mid-serving
@triton.jit(do_not_specialize=["M"])
def _w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
                       M, N, K, KW, stride_wn, stride_wk, stride_xm, stride_ym, blocks_per_group,
                       blocks_per_split, split, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """CUDA-core GEMV, one x row per program; grid (N tiles, K splits, M). Per thread:
    whole words (eight k) of a few weight rows; partial sums stay per word slot until the
    end. USE_ASM (bf16 only): packed bf16x2 dequant and products, see _GEMV_ASM_BF16.
    LOOP_STAGES > 1: Triton software-pipelines the loop, copying the weight (and scale)
    blocks of the next LOOP_STAGES - 1 iterations into shared memory asynchronously while
    this one computes; otherwise only the warps an SM holds hide the load latency."""
    BKW: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BKW)
    n_mask = offs_n < N
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    kb0 = pid_k * blocks_per_split
    nblocks = tl.minimum(blocks_per_split, tl.cdiv(K, BLOCK_K) - kb0)
    acc = tl.zeros((BLOCK_N, BKW), dtype=tl.float32)
    for i in tl.range(nblocks, num_stages=LOOP_STAGES):
        kb = kb0 + i
        cols = kb * BKW + offs_w
        c_mask = cols < KW
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + cols[None, :] * stride_wk,
                        mask=n_mask[:, None] & c_mask[None, :], other=0)
        s, zoff = _group_params(s_ptr, z_ptr, kb, blocks_per_group, offs_n, n_mask, N, HAS_ZEROS)
        if USE_ASM:
            xp = x_row.to(tl.pointer_type(tl.int32), bitcast=True) + 4 * cols
            x0 = tl.broadcast_to(tl.load(xp, mask=c_mask, other=0)[None, :], words.shape)
            x1 = tl.broadcast_to(tl.load(xp + 1, mask=c_mask, other=0)[None, :], words.shape)
            x2 = tl.broadcast_to(tl.load(xp + 2, mask=c_mask, other=0)[None, :], words.shape)
            x3 = tl.broadcast_to(tl.load(xp + 3, mask=c_mask, other=0)[None, :], words.shape)
            negc = tl.broadcast_to(_pair((-(zoff + 128.0)).to(tl.bfloat16))[:, None], words.shape)
            d = tl.inline_asm_elementwise(_GEMV_ASM_BF16, "=r,r,r,r,r,r,r",
                                          [words, x0, x1, x2, x3, negc], dtype=tl.float32,
                                          is_pure=True, pack=1)
        else:
            d = tl.zeros((BLOCK_N, BKW), dtype=tl.float32)
            for j in tl.static_range(8):  # nibble j holds k = 8c + 2j (j < 4), 8c + 2(j - 4) + 1
                kj = 8 * cols + (2 * j if j < 4 else 2 * (j - 4) + 1)
                xj = tl.load(x_row + kj, mask=kj < K, other=0.0).to(tl.float32)
                d += (((words >> (4 * j)) & 15).to(tl.float32) - zoff[:, None]) * xj[None, :]
        acc += d * s[:, None]
    out = tl.sum(acc, axis=1)[None, :]
    _epilogue(out, pid_m + tl.arange(0, 1), offs_n, M, N, y_ptr, stride_ym, b_ptr, ws_ptr,
              lock_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, split, HAS_BIAS, SPLIT)


# sizes that change from step to step are not specialized on (== 1, % 16): no compile mid-serving
@triton.jit(do_not_specialize=["M"])
def _w4a16_gemv_n_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
                         M, N, K, KW, stride_xm, stride_ym, blocks_per_group, blocks_per_split,
                         split, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                         USE_ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_KW: tl.constexpr, SPLIT: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """CUDA-core GEMV over N-major words (w [K // 8, N]): grid (N tiles, K splits, M tiles).

    A step loads the words [BLOCK_KW, BLOCK_N] of BLOCK_KW word rows (8 k each) for
    BLOCK_N consecutive n: each thread reads consecutive n with one vector load, a warp one
    contiguous run per word row, and the x values a word row meets are the same for every
    thread (a broadcast load, reused across the thread's n and, with BLOCK_M > 1 rows of x,
    the words reused across the rows). Per-word partial sums stay in registers
    ([BLOCK_M, BLOCK_KW, BLOCK_N]) until one reduction over the word rows at the end, so the
    loop has no cross-thread traffic. Arithmetic as _w4a16_gemv_kernel: USE_ASM (bf16) forms
    and sums the products in bf16x2 (_GEMV_ASM_BF16), else plain float ops. A step is the
    other kernels' K-block (8 * BLOCK_KW k, inside one quantization group), so it reads one
    row of scales."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_KW)
    n_mask = offs_n < N
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[None, :]
    kb0 = pid_k * blocks_per_split
    nblocks = tl.minimum(blocks_per_split, tl.cdiv(KW, BLOCK_KW) - kb0)
    acc = tl.zeros((BLOCK_M, BLOCK_KW, BLOCK_N), dtype=tl.float32)
    for i in tl.range(nblocks, num_stages=LOOP_STAGES):
        kb = kb0 + i
        rows = kb * BLOCK_KW + offs_r
        r_mask = rows < KW
        words = tl.load(w_rows + rows[:, None].to(tl.int64) * N, mask=r_mask[:, None] & n_mask[None, :],
                        other=0)
        s, zoff = _group_params(s_ptr, z_ptr, kb, blocks_per_group, offs_n, n_mask, N, HAS_ZEROS)
        x_mask = m_mask[:, None] & r_mask[None, :]
        shape: tl.constexpr = (BLOCK_M, BLOCK_KW, BLOCK_N)
        if USE_ASM:
            xp = x_rows.to(tl.pointer_type(tl.int32), bitcast=True)[:, None] + 4 * rows[None, :]
            x0 = tl.broadcast_to(tl.load(xp, mask=x_mask, other=0)[:, :, None], shape)
            x1 = tl.broadcast_to(tl.load(xp + 1, mask=x_mask, other=0)[:, :, None], shape)
            x2 = tl.broadcast_to(tl.load(xp + 2, mask=x_mask, other=0)[:, :, None], shape)
            x3 = tl.broadcast_to(tl.load(xp + 3, mask=x_mask, other=0)[:, :, None], shape)
            negc = tl.broadcast_to(_pair((-(zoff + 128.0)).to(tl.bfloat16))[None, None, :], shape)
            d = tl.inline_asm_elementwise(_GEMV_ASM_BF16, "=r,r,r,r,r,r,r",
                                          [tl.broadcast_to(words[None, :, :], shape), x0, x1, x2, x3,
                                           negc], dtype=tl.float32, is_pure=True, pack=1)
        else:
            d = tl.zeros(shape, dtype=tl.float32)
            for j in tl.static_range(8):  # nibble j holds k = 8r + 2j (j < 4), 8r + 2(j - 4) + 1
                kj = 8 * rows + (2 * j if j < 4 else 2 * (j - 4) + 1)
                xj = tl.load(x_rows[:, None] + kj[None, :], mask=x_mask, other=0.0).to(tl.float32)
                u = ((words >> (4 * j)) & 15).to(tl.float32) - zoff[None, :]
                d += u[None, :, :] * xj[:, :, None]
        acc += d * s[None, None, :]
    out = tl.sum(acc, axis=1)
    _epilogue(out, offs_m, offs_n, M, N, y_ptr, stride_ym, b_ptr, ws_ptr, lock_ptr,
              pid_m * tl.num_programs(0) + pid_n, pid_k, split, HAS_BIAS, SPLIT)


@triton.jit
def _w4a16_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, KW, stride_wn, stride_wk, blocks_per_group,
                          HAS_ZEROS: tl.constexpr, USE_ASM: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [N, K] = dequantized weight, in out's dtype; grid (N tiles, K blocks)."""
    kb = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w = _load_block(w_ptr, s_ptr, z_ptr, kb, offs_n, n_mask, N, K, KW, stride_wn, stride_wk,
                    blocks_per_group, out_ptr.dtype.element_ty, BLOCK_K, HAS_ZEROS, USE_ASM)
    ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * K + ks[None, :], w,
             mask=n_mask[:, None] & (ks < K)[None, :])


# --------------------------------------------------------------------------- launch
_FORCED: list = []  # a stack of W4A16Config that overrides the table (force_config)


@contextlib.contextmanager
def force_config(config: W4A16Config):
    """Run every W4A16 call inside the block with ``config`` whatever M is, e.g. to check
    the decode kernels' numerics on a whole model (benchmarks/quality.py --kernels)."""
    _FORCED.append(config)
    try:
        yield config
    finally:
        _FORCED.pop()


# OPTLLM_W4A16_ASM=0 turns the packed-PTX dequantization off (read once, at import)
_ASM = os.environ.get("OPTLLM_W4A16_ASM", "1") != "0"


def _use_asm(x_dtype: torch.dtype, scales: torch.Tensor) -> bool:
    """Packed-PTX dequant: CUDA, 16-bit activations with scales of the same dtype."""
    return (_ASM and scales.is_cuda and x_dtype in (torch.bfloat16, torch.float16) and scales.dtype == x_dtype
            and not interpreting())


def _block_k(block_k: int, k: int, group_size: int) -> int:
    """The config's block_k, halved until a K-block lies inside one quantization group."""
    bk = block_k
    while group_size != k and group_size % bk:
        bk //= 2
    return bk


def _word_strides(n: int, k: int, n_major: bool) -> tuple:
    """(stride along n, stride along word columns) of the packed words, in words."""
    return (1, n) if n_major else (k // 8, 1)


def _blocks_per_group(k: int, group_size: int, bk: int) -> int:
    return -(-k // bk) if group_size == k else group_size // bk


def dequantize_w4a16_triton(w: W4A16Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense [N, K] tensor in dtype, by a Triton kernel (same bits as
    ``dequantize_w4a16``)."""
    out = torch.empty((w.N, w.K), device=w.packed.device, dtype=dtype)
    bk = _block_k(128, w.K, w.group_size)
    grid = (triton.cdiv(w.N, 64), triton.cdiv(w.K, bk))
    _w4a16_dequant_kernel[grid](
        w.packed, w.scales, w.scales if w.zeros is None else w.zeros, out, w.N, w.K, w.K // 8,
        *_word_strides(w.N, w.K, w.n_major), _blocks_per_group(w.K, w.group_size, bk),
        HAS_ZEROS=w.zeros is not None, USE_ASM=_use_asm(dtype, w.scales), BLOCK_N=64, BLOCK_K=bk, num_warps=4)
    return out


@dataclass(frozen=True)
class _Plan:
    """What a call's shapes, dtypes and config decide, worked out once per key (_plan): the
    kernel, its grid, the int arguments around the call's strides, the constexprs. kernel None:
    dequantize + cuBLAS."""

    kernel: Optional[CompiledLaunch]
    grid: tuple
    before: tuple  # the int arguments after the eight pointers, up to x's row stride
    after: tuple  # those after y's row stride: blocks per group, blocks per split, splits
    constexprs: dict
    options: dict

    @property
    def split(self) -> int:
        return self.after[2] if self.after else 1


_PLANS: dict = {}
_GEMV = CompiledLaunch(_w4a16_gemv_kernel, pointers=8)
_GEMV_N = CompiledLaunch(_w4a16_gemv_n_kernel, pointers=8)
_TILED = CompiledLaunch(_w4a16_kernel, pointers=8)


def _plan(m: int, n: int, k: int, group_size: int, n_major: bool, has_zeros: bool, has_bias: bool,
          x_dtype: torch.dtype, asm: bool, lock_slots: int, config: Optional[W4A16Config]) -> _Plan:
    cfg = config or lookup_w4a16_config(m, n, k, n_major)
    if cfg.gemv and m > 65535:  # grid z limit
        cfg = W4A16Config(128, 128, 128, dequant=True)
    if cfg.dequant:
        return _Plan(None, (), (), (), {}, {})
    bk = _block_k(cfg.block_k, k, group_size)
    if not (cfg.gemv or cfg.swap_ab) and bk < 64:  # triton 3.6 fails to compile that tiled dot
        cfg = dataclasses.replace(cfg, swap_ab=True)
    nblocks = -(-k // bk)
    # the N-major GEMV takes up to block_m rows of x per program (the words read once for all)
    gemv_rows = min(cfg.block_m, pow2(m)) if n_major else 1
    num_m, num_n = (-(-m // gemv_rows) if cfg.gemv else -(-m // cfg.block_m)), -(-n // cfg.block_n)
    split = min(cfg.split_k, nblocks)
    if num_m * num_n > lock_slots or split * m * n >= 2**31 or (cfg.swap_ab and cfg.block_m >= 128 and not cfg.gemv):
        # swap-AB tiles of 128+ rows reduced over K computed wrong on the H100 (forty-sixth session: down, M = 256,
        # relative errors 0.018-0.45 against the float32 reference, not under the CPU interpreter); until the cause
        # is found they run unsplit (no table entry splits them)
        split = 1
    per_split = -(-nblocks // split)
    split = -(-nblocks // per_split)  # no empty trailing split
    head = (m, n, k, k // 8)
    after = (_blocks_per_group(k, group_size, bk), per_split, split)
    flags = dict(HAS_ZEROS=has_zeros, HAS_BIAS=has_bias, BLOCK_N=cfg.block_n, BLOCK_K=bk, SPLIT=split > 1)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    gemv_asm = x_dtype == torch.bfloat16 and asm
    if cfg.gemv and n_major:
        del flags["BLOCK_K"]
        return _Plan(_GEMV_N, (num_n, split, num_m), head, after,
                     dict(flags, USE_ASM=gemv_asm, BLOCK_M=gemv_rows, BLOCK_KW=bk // 8, LOOP_STAGES=cfg.num_stages),
                     options)
    strides = _word_strides(n, k, n_major)
    if cfg.gemv:
        return _Plan(_GEMV, (num_n, split, m), head + strides, after,
                     dict(flags, USE_ASM=gemv_asm, LOOP_STAGES=cfg.num_stages), options)
    # the tiled path keeps plain float ops: triton 3.6 fails to compile the PTX dequant feeding a
    # transposed dot operand (TritonGPUOptimizeDotOperands crashes)
    return _Plan(_TILED, (num_m * num_n, split, 1), head + strides, after,
                 dict(flags, SWAP_AB=cfg.swap_ab, USE_ASM=cfg.swap_ab and asm,
                      DOT_F32=x_dtype == torch.float32 or interpreting(), BLOCK_M=cfg.block_m, GROUP_M=8),
                 options)


def _launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
            zeros: Optional[torch.Tensor], bias: Optional[torch.Tensor], locks: torch.Tensor,
            k: int, group_size: int, out: Optional[torch.Tensor] = None,
            config: Optional[W4A16Config] = None, n_major: bool = False) -> torch.Tensor:
    """y = x @ W^T (+ bias) by the kernel the config table picks. Host cost: a dict lookup of the
    call's plan, then the compiled kernel's launcher (CompiledLaunch), no environment reads."""
    m, n = x.shape[0], (packed.shape[1] if n_major else packed.shape[0])
    y = torch.empty((m, n), device=x.device, dtype=x.dtype) if out is None else out
    if m == 0:
        return y
    config = config or (_FORCED[-1] if _FORCED else None)
    if x.is_cuda and x.data_ptr() & 15:  # the bf16x2 paths read x as int32 words: 4-byte alignment at least
        x = x.clone()
    key = (m, n, k, group_size, n_major, zeros is not None, bias is not None, x.dtype, scales.dtype, x.is_cuda,
           locks.numel(), config)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 4096:  # eager prefill sees many M
            _PLANS.clear()
        plan = _PLANS[key] = _plan(m, n, k, group_size, n_major, zeros is not None, bias is not None, x.dtype,
                                   _use_asm(x.dtype, scales), locks.numel(), config)
    if plan.kernel is None:
        w = W4A16Weight(packed, scales, zeros, locks, n, k, group_size, n_major)
        dense = dequantize_w4a16_triton(w, x.dtype)
        return torch.addmm(bias, x, dense.t(), out=out) if bias is not None else \
            torch.mm(x, dense.t(), out=out)
    ws = torch.empty((plan.split, m, n), device=x.device, dtype=torch.float32) if plan.split > 1 else y
    z = scales if zeros is None else zeros
    b = y if bias is None else bias
    sx, sy = x.stride(0), y.stride(0)
    plan.kernel((key, sx, sy), plan.grid, (x, packed, scales, z, b, y, ws, locks, *plan.before, sx, sy, *plan.after),
                plan.constexprs, plan.options)
    return y


@torch.library.custom_op("optllm::w4a16_gemm", mutates_args=())
def _w4a16_gemm_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                   zeros: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   locks: torch.Tensor, k: int, group_size: int, n_major: bool = False) -> torch.Tensor:
    # locks are restored to zero before the kernel ends, hence no declared mutation
    return _launch(x, packed, scales, zeros, bias, locks, k, group_size, n_major=n_major)


@_w4a16_gemm_op.register_fake
def _(x, packed, scales, zeros, bias, locks, k, group_size, n_major=False):
    return x.new_empty((x.shape[0], packed.shape[1] if n_major else packed.shape[0]))


def w4a16_gemm(x: torch.Tensor, w: W4A16Weight, bias: Optional[torch.Tensor] = None, *,
               config: Optional[W4A16Config] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton kernels directly, bypassing the op (tests, benchmarks, tuning):
    x [M, K] with unit stride along K -> y [M, N] in x.dtype (written into ``out`` if
    given); ``config`` overrides the table."""
    if x.dim() != 2 or x.shape[1] != w.K or x.dtype not in TRITON_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x: must be bf16/fp16/fp32 [M, K={w.K}] with unit stride along K, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (tuple(bias.shape) != (w.N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias: must be {x.dtype} of shape ({w.N},), got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if out is not None and (out.shape != (x.shape[0], w.N) or out.dtype != x.dtype
                            or not out.is_contiguous()):
        raise ValueError(f"out: must be a contiguous {x.dtype} [{x.shape[0]}, {w.N}] tensor")
    return _launch(x, w.packed, w.scales, w.zeros, bias, w.locks, w.K, w.group_size, out, config,
                   w.n_major)


def w4a16_linear(x: torch.Tensor, w: W4A16Weight, bias: Optional[torch.Tensor] = None,
                 backend: str = "auto") -> torch.Tensor:
    """y = x @ dequant(w).T + bias: x [..., K] -> [..., N] in x.dtype.

    backend: "auto" (Triton on CUDA, or on CPU when TRITON_INTERPRET=1; else torch),
    "triton" (the kernels, through the ``optllm::w4a16_gemm`` op under torch.compile; x
    bf16/fp16/fp32), "torch" (dequantize to x.dtype, then matmul: slow, for CPUs).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
    if x.dim() == 0 or x.shape[-1] != w.K:
        raise ValueError(f"x: last dim must be K={w.K}, got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (w.N,):
        raise ValueError(f"bias: must have shape ({w.N},), got {tuple(bias.shape)}")
    triton_ok = x.is_cuda or interpreting()
    if backend == "auto":
        backend = "triton" if triton_ok else "torch"
    x2 = x if x.dim() == 2 else x.reshape(-1, w.K)
    if backend == "torch":
        y = F.linear(x2, dequantize_w4a16(w, x.dtype), None if bias is None else bias.to(x.dtype))
    elif not triton_ok or x.dtype not in TRITON_DTYPES:
        raise ValueError("backend: 'triton' needs bf16/fp16/fp32 x on CUDA or TRITON_INTERPRET=1, "
                         f"got {x.dtype} on {x.device}")
    else:
        # through the op only while torch.compile traces: eager calls skip the dispatcher
        gemm = torch.ops.optllm.w4a16_gemm if torch.compiler.is_compiling() else _launch
        y = gemm(x2 if x2.stride(1) == 1 else x2.contiguous(), w.packed, w.scales, w.zeros,
                 None if bias is None else bias.to(x.dtype), w.locks, w.K, w.group_size, n_major=w.n_major)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], w.N)
