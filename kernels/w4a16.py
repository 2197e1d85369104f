"""W4A16 GEMM: int4 weights with grouped scales (and optional zero points) times bf16/fp16
activations, fp32 accumulation.

    y[m, n] = sum_k x[m, k] * (q[n, k] - zero[n, k // G]) * scale[n, k // G]  (+ bias[n])

Runtime layout (``prepack_w4a16``, once at load)
    ``packed`` is int32 [Kp // 8, N] with N contiguous (Kp = K rounded up to 32). Word
    (r, n) holds eight nibbles u = q + 8, nibble j in bits [4j, 4j + 4), of column n at
    ``k = 32 * (r // 4) + 4 * j + r % 4``. ``scales`` [K // G, N] and ``zeros`` int8
    [K // G, N] are transposed the same way.
Why this layout
    * N contiguous: every tile is whole row segments of words, read with 16-byte vector
      loads and fully coalesced, whatever BLOCK_N or the split-K factor.
    * Eight k per word, all inside one quantization group (G is a multiple of 32): the
      GEMV folds scale and zero point once per word after an 8-term in-thread dot product.
    * The 4-row interleave makes "nibble j of a tile" a set of x columns in contiguous
      runs of 4, so the tensor-core path multiplies eight [BM, BK/8] x [BK/8, BN] slices
      (one per nibble) with no register reshape of the unpacked tile.
Dequant: nibble u moved into mantissa bits 19..22 of 1.0f reads as 1 + u/16 exactly, so
16 * f - (24 + zero) = q - zero without an int->float conversion (shift, and/or, FMA).
Split-K: each split stores its fp32 partial tile into a workspace and bumps a per-tile
counter (``W4A16Weight.locks``); the last split to arrive sums the partials in split
order (deterministic), adds the bias, writes y and resets the counter. One launch, no
float atomics, no memset -- but one weight must not run on two streams at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .w4a16_configs import M_BUCKETS, W4A16_CONFIGS, W4A16Config, default_w4a16_config, m_bucket  # noqa: F401

BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOCK_SLOTS = 1024  # output tiles one launch may split over K; more tiles -> no split-K


# --------------------------------------------------------------------------- weight
@dataclass(frozen=True)
class W4A16Weight:
    """Prepacked int4 weight of a [N, K] linear (see the module docstring for the layout).

    packed: int32 [ceil(K/32)*4, N]; scales: [K // group_size, N] float; zeros: int8
    [K // group_size, N] or None (symmetric); locks: int32 [LOCK_SLOTS] split-K counters,
    zero between calls.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    locks: torch.Tensor
    N: int
    K: int
    group_size: int


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


def prepack_w4a16(q: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                  group_size: int, dtype: Optional[torch.dtype] = None) -> W4A16Weight:
    """Repack quantized values into the runtime layout (once, at load).

    q: int8 [N, K] in [-8, 7]; scales: [N, K // group_size] float; zeros: int8
    [N, K // group_size] or None; group_size: a multiple of 32 dividing K, or K itself
    (per-channel). dtype: cast the scales to it (use the activation dtype); None keeps them.
    Dequantized weight: (q - zero) * scale.
    """
    _check_quantized(q, scales, zeros, group_size)
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"dtype: must be a floating dtype or None, got {dtype}")
    n, k = q.shape
    kp = -(-k // 32) * 32
    u = q.to(torch.int32) + 8
    if kp != k:  # only per-channel weights pad; the pad multiplies masked (zero) x columns
        u = F.pad(u, (0, kp - k), value=8)
    # [N, Kp] -> [b, j, rr, N] (k = 32b + 4j + rr) -> [b, rr, j, N]
    u = u.t().reshape(kp // 32, 8, 4, n).permute(0, 2, 1, 3)
    # nibble 7 enters as its signed value so the sum stays inside int32 without wrapping
    top = ((u[:, :, 7] ^ 8) - 8) << 28
    shifts = (4 * torch.arange(7, device=q.device, dtype=torch.int32)).view(1, 1, 7, 1)
    words = (u[:, :, :7] << shifts).sum(dim=2, dtype=torch.int32) + top
    scales_t = scales.t().contiguous() if dtype is None else scales.t().to(dtype).contiguous()
    zeros_t = None if zeros is None else zeros.t().contiguous()
    locks = torch.zeros(LOCK_SLOTS, dtype=torch.int32, device=q.device)
    return W4A16Weight(words.reshape(kp // 8, n).contiguous(), scales_t, zeros_t, locks,
                       n, k, group_size)


def dequantize_w4a16(w: W4A16Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack the runtime layout to the dense weight (q - zero) * scale, [N, K] in dtype
    (computed in float32, then cast)."""
    kw, n = w.packed.shape
    shifts = 4 * torch.arange(8, device=w.packed.device, dtype=torch.int32)
    u = (w.packed.view(kw // 4, 4, n, 1) >> shifts) & 15          # [b, rr, N, j]
    q = u.permute(0, 3, 1, 2).reshape(kw * 8, n)[: w.K].float() - 8.0  # [K, N]
    s = w.scales.float().repeat_interleave(w.group_size, dim=0)
    if w.zeros is not None:
        q = q - w.zeros.float().repeat_interleave(w.group_size, dim=0)
    return (q * s).t().to(dtype)


def w4a16_linear_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                     zeros: Optional[torch.Tensor], group_size: int,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain float32 reference from the unpacked values: x [..., K], q int8 [N, K],
    scales / zeros [N, K // group_size] -> y [..., N] float32."""
    s = scales.float().repeat_interleave(group_size, dim=1)
    qz = q.float() if zeros is None else q.float() - zeros.float().repeat_interleave(group_size, dim=1)
    y = x.float() @ (qz * s).t()
    return y if bias is None else y + bias.float()


# configs: kernels/w4a16_configs.py


# --------------------------------------------------------------------------- kernels
@triton.jit
def _nibble(words, J: tl.constexpr):
    """Nibble J of every int32 word as float32 1 + u/16 (exact)."""
    if 4 * J <= 19:
        v = words << (19 - 4 * J)
    else:
        v = words >> (4 * J - 19)
    return ((v & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _group_params(s_ptr, z_ptr, r0, rows, offs_n, N, KW, rows_per_group,
                  PER_BLOCK: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """fp32 scale and zero offset (24 + zero) of the packed rows of one block:
    [1, BN] when the block lies inside one group, else [BKW, BN]."""
    if PER_BLOCK:
        offs = (r0 // rows_per_group) * N + offs_n[None, :]
        mask = ((offs_n < N) & (offs_n * 0 + r0 < KW))[None, :]
    else:
        offs = (rows // rows_per_group)[:, None] * N + offs_n[None, :]
        mask = (rows < KW)[:, None] & (offs_n < N)[None, :]
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zoff = tl.load(z_ptr + offs, mask=mask, other=0).to(tl.float32) + 24.0
    else:
        zoff = tl.zeros_like(s) + 24.0
    return s, zoff


@triton.jit
def _store_out(acc, offs_m, offs_n, mask, y_ptr, stride_ym, b_ptr, N, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_offs = offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, y_ptr, stride_ym, b_ptr, ws_ptr, lock_ptr, tile, pid_k,
              HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K > 1:
        ws_offs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * M * N + ws_offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):  # fixed order: same bits whoever is last
                total += tl.load(ws_ptr + s * M * N + ws_offs, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            _store_out(total, offs_m, offs_n, mask, y_ptr, stride_ym, b_ptr, N, HAS_BIAS)
            tl.atomic_xchg(lock_ptr + tile, 0)
    else:
        _store_out(acc, offs_m, offs_n, mask, y_ptr, stride_ym, b_ptr, N, HAS_BIAS)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
                       M, N, K, KW, stride_xm, stride_ym, rows_per_group, rows_per_split, iters,
                       HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, PER_BLOCK: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """CUDA-core path, one x row per program; grid (N tiles, K splits, M)."""
    BKW: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    # per-thread partial sums over K; reduced across threads once, after the loop
    acc = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
    for i in range(iters):
        r0 = pid_k * rows_per_split + i * BKW
        rows = r0 + tl.arange(0, BKW)
        words = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :],
                        mask=(rows < KW)[:, None] & (offs_n < N)[None, :], other=0)
        kbase = (rows // 4) * 32 + rows % 4
        t = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((BKW,), dtype=tl.float32)
        for j in tl.static_range(8):
            k = kbase + 4 * j
            xj = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            t += xj[:, None] * _nibble(words, j)
            xs += xj
        s, zoff = _group_params(s_ptr, z_ptr, r0, rows, offs_n, N, KW, rows_per_group,
                                PER_BLOCK, HAS_ZEROS)
        # sum_j x_j (q_j - z) = 16 * (sum_j x_j f_j - (24 + z) / 16 * sum_j x_j)
        acc += (s * 16.0) * (t - (zoff * 0.0625) * xs[:, None])
    out = tl.sum(acc, axis=0)[None, :]
    _epilogue(out, pid_m + tl.arange(0, 1), offs_n, M, N, y_ptr, stride_ym, b_ptr, ws_ptr,
              lock_ptr, pid_m * tl.num_programs(0) + pid_n, pid_k, HAS_BIAS, SPLIT_K)


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    # DOT_F32: fp32 activations, or the CPU interpreter, which multiplies bf16 as raw
    # uint16; products of bf16/fp16 operands are exact in fp32, so the numbers match.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _w4a16_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
                       M, N, K, KW, stride_xm, stride_ym, rows_per_group, rows_per_split, iters,
                       HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, PER_BLOCK: tl.constexpr,
                       SCALE_AFTER_DOT: tl.constexpr, DOT_F32: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Tensor-core path: dequantize each nibble slice in registers, then tl.dot;
    grid (M tiles * N tiles, K splits)."""
    BKW: tl.constexpr = BLOCK_K // 8
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles walk the same weight columns together, while those are in L2
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(iters):
        r0 = pid_k * rows_per_split + i * BKW
        rows = r0 + tl.arange(0, BKW)
        words = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :],
                        mask=(rows < KW)[:, None] & (offs_n < N)[None, :], other=0)
        kbase = (rows // 4) * 32 + rows % 4
        s, zoff = _group_params(s_ptr, z_ptr, r0, rows, offs_n, N, KW, rows_per_group,
                                PER_BLOCK, HAS_ZEROS)
        if SCALE_AFTER_DOT:  # one group per block: exact integer operand, scale once
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(8):
                k = kbase + 4 * j
                xj = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
                part = _dot(xj, (_nibble(words, j) * 16.0 - zoff).to(dtype), part, DOT_F32)
            acc += part * s
        else:  # keeps one accumulator chain for the big-M tensor-core pipeline
            for j in tl.static_range(8):
                k = kbase + 4 * j
                xj = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
                acc = _dot(xj, ((_nibble(words, j) * 16.0 - zoff) * s).to(dtype), acc, DOT_F32)
    _epilogue(acc, offs_m, offs_n, M, N, y_ptr, stride_ym, b_ptr, ws_ptr, lock_ptr,
              pid_m * num_pid_n + pid_n, pid_k, HAS_BIAS, SPLIT_K)


# --------------------------------------------------------------------------- launch
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
            zeros: Optional[torch.Tensor], bias: Optional[torch.Tensor], locks: torch.Tensor,
            k: int, group_size: int, out: Optional[torch.Tensor] = None,
            config: Optional[W4A16Config] = None) -> torch.Tensor:
    m, (kw, n) = x.shape[0], packed.shape
    y = torch.empty((m, n), device=x.device, dtype=x.dtype) if out is None else out
    if m == 0:
        return y
    cfg = config or W4A16_CONFIGS.get((m_bucket(m), n, k)) or default_w4a16_config(m, n, k)
    bkw = cfg.block_k // 8
    num_m, num_n = -(-m // cfg.block_m), -(-n // cfg.block_n)
    split = min(cfg.split_k, -(-kw // bkw))
    if num_m * num_n > locks.numel() or split * m * n >= 2**31:
        split = 1
    rows_per_split = -(-kw // (split * bkw)) * bkw
    split = -(-kw // rows_per_split)  # no empty trailing split
    ws = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else y
    rows_per_group = kw if group_size == k else group_size // 8
    per_block = rows_per_group % bkw == 0 or group_size == k
    args = (x, packed, scales, scales if zeros is None else zeros, y if bias is None else bias,
            y, ws, locks, m, n, k, kw, x.stride(0), y.stride(0), rows_per_group,
            rows_per_split, rows_per_split // bkw)
    flags = dict(HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, PER_BLOCK=per_block)
    launch = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.block_m == 1:
        _w4a16_gemv_kernel[(num_n, split, m)](*args, **flags, **launch)
    else:
        _w4a16_gemm_kernel[(num_m * num_n, split)](
            *args, **flags, BLOCK_M=cfg.block_m, SCALE_AFTER_DOT=per_block and cfg.block_m <= 32,
            DOT_F32=x.dtype == torch.float32 or _interpreting(), GROUP_M=8, **launch)
    return y


@torch.library.custom_op("optllm::w4a16_gemm", mutates_args=())
def _w4a16_gemm_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                   zeros: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   locks: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    # locks are restored to zero before the kernel ends, hence no declared mutation
    return _launch(x, packed, scales, zeros, bias, locks, k, group_size)


@_w4a16_gemm_op.register_fake
def _(x, packed, scales, zeros, bias, locks, k, group_size):
    return x.new_empty((x.shape[0], packed.shape[1]))


def w4a16_gemm(x: torch.Tensor, w: W4A16Weight, bias: Optional[torch.Tensor] = None, *,
               config: Optional[W4A16Config] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton kernels directly, bypassing the op (tests, benchmarks, tuning):
    x [M, K] with unit stride along K -> y [M, N] in x.dtype (written into ``out`` if
    given); ``config`` overrides the table."""
    if x.dim() != 2 or x.shape[1] != w.K or x.dtype not in TRITON_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x: must be bf16/fp16/fp32 [M, K={w.K}] with unit stride along K, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (w.N,):
        raise ValueError(f"bias: must have shape ({w.N},), got {tuple(bias.shape)}")
    if out is not None and (out.shape != (x.shape[0], w.N) or out.dtype != x.dtype
                            or out.stride(-1) != 1):
        raise ValueError(f"out: must be {x.dtype} [{x.shape[0]}, {w.N}] with unit column stride")
    return _launch(x, w.packed, w.scales, w.zeros, bias, w.locks, w.K, w.group_size, out, config)


def w4a16_linear(x: torch.Tensor, w: W4A16Weight, bias: Optional[torch.Tensor] = None,
                 backend: str = "auto") -> torch.Tensor:
    """y = x @ dequant(w).T + bias: x [..., K] -> [..., N] in x.dtype.

    backend: "auto" (Triton on CUDA, or on CPU when TRITON_INTERPRET=1; else torch),
    "triton" (the ``optllm::w4a16_gemm`` op; x bf16/fp16/fp32), "torch" (dequantize to
    x.dtype, then matmul: slow, for CPUs).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {BACKENDS}, got {backend!r}")
    if x.dim() == 0 or x.shape[-1] != w.K:
        raise ValueError(f"x: last dim must be K={w.K}, got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (w.N,):
        raise ValueError(f"bias: must have shape ({w.N},), got {tuple(bias.shape)}")
    triton_ok = x.is_cuda or _interpreting()
    if backend == "auto":
        backend = "triton" if triton_ok else "torch"
    x2 = x.reshape(-1, w.K)
    if backend == "torch":
        y = F.linear(x2, dequantize_w4a16(w, x.dtype), None if bias is None else bias.to(x.dtype))
    elif not triton_ok or x.dtype not in TRITON_DTYPES:
        raise ValueError("backend: 'triton' needs bf16/fp16/fp32 x on CUDA or TRITON_INTERPRET=1, "
                         f"got {x.dtype} on {x.device}")
    else:
        y = torch.ops.optllm.w4a16_gemm(x2 if x2.stride(1) == 1 else x2.contiguous(), w.packed,
                                        w.scales, w.zeros, bias, w.locks, w.K, w.group_size)
    return y.reshape(*x.shape[:-1], w.N)
