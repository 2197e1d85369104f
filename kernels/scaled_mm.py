"""Scaled matmul shared by the W8A8-INT8 (kernels/w8a8_int8.py) and FP8 (kernels/fp8.py)
GEMMs: 8-bit operands a [M, K] and b [N, K], each with a per-row or per-tensor float32 scale.

    out[m, n] = a_scale[m or 0] * b_scale[n or 0] * sum_k a[m, k] * b[n, k]  (+ bias[n])

The two families differ only in operand dtype, accumulator dtype (int32 for int8, fp32 for
fp8) and whether each scale is a scalar or a vector, so one Triton kernel serves both. Also
here: its launch config (GemmConfig) and M buckets, the launch parameters of the
one-program-per-row activation quantizers, and the argument checks both families share.

Weight layout: kept as the checkpoint's [N, K] row-major, never transposed. Hopper's 8-bit
tensor-core MMA (wgmma) takes both operands K-major only, and a [N, K] row-major weight
tile is K-major as loaded; a [K, N] copy would cost a shared-memory transpose per tile. The
peer ``torch._int_mm(A [M, K], B [K, N])`` is called with ``B = w.t()``, a column-major view
of the same storage (cuBLASLt's int8 "TN" form), so both read the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import CompiledLaunch, grouped_tile, pow2

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SCALE_EPS = 1e-10  # floor of a per-token scale, so an all-zero row quantizes to 0, not NaN
M_BUCKETS = (16, 32, 64, 128, 256, 512, 1024)


# --------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch parameters of the scaled-matmul kernel.

    ``swap_ab`` computes the transposed product (weight rows on the MMA's M side) so that
    tiny M still fills 64-row tensor-core tiles; it is meant for M <= 32.
    ``fast_accum`` (fp8 only) lets Hopper's tensor cores accumulate the whole K in their
    reduced-precision mode; otherwise partial sums are promoted to fp32 every block_k.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    fast_accum: bool = False

    def __post_init__(self) -> None:
        # 8-bit MMAs take K in steps of 32
        for name, low in (("block_m", 16), ("block_n", 16), ("block_k", 32)):
            v = getattr(self, name)
            if v < low or v & (v - 1):
                raise ValueError(f"{name}={v} is not allowed; allowed: a power of two >= {low}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} is not allowed; allowed: 1, 2, 4, 8, 16")
        if self.group_m < 1 or self.num_stages < 1:
            raise ValueError(f"group_m={self.group_m}, num_stages={self.num_stages}: both must be >= 1")


def m_bucket(m: int) -> int:
    """Smallest of M_BUCKETS >= m (the last bucket takes every larger m)."""
    return min(max(16, 1 << (m - 1).bit_length()), M_BUCKETS[-1])


# --------------------------------------------------------------------------- kernel
@triton.jit(do_not_specialize=["M"])
def _scaled_mm_kernel(
    a_ptr, b_ptr, out_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    M, N, K, stride_am, stride_bn, stride_om,
    A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
    ACC_DTYPE: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Wrapping rows/cols past the edge keeps the loads unmasked along M and N; the store masks.
    rows_a = (offs_m % M).to(tl.int64)
    rows_b = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :]

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=ACC_DTYPE)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k[None, :] < K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=k_ok, other=0.0)
        if SWAP_AB:
            acc = tl.dot(b, tl.trans(a), acc, out_dtype=ACC_DTYPE, max_num_imprecise_acc=IMPRECISE_ACC)
        else:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=ACC_DTYPE, max_num_imprecise_acc=IMPRECISE_ACC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)

    m_ok = offs_m < M
    n_ok = offs_n < N
    c = acc.to(tl.float32)
    if A_SCALE_ROWS:
        c = c * tl.load(a_scale_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    else:
        c = c * tl.load(a_scale_ptr)
    if B_SCALE_ROWS:
        c = c * tl.load(b_scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    else:
        c = c * tl.load(b_scale_ptr)
    if HAS_BIAS:
        c = c + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, c.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------- quantizer helpers
_SCALED_MM = CompiledLaunch(_scaled_mm_kernel, pointers=6)


@triton.jit
def div_rn(x, d, inv, INTERPRET: tl.constexpr):
    """x / d correctly rounded (IEEE round to nearest even), given inv = RN(1 / d).

    On the GPU: q = RN(x * inv) is within one ulp of x / d, and one FMA correction
    RN(q + (x - d q) inv), with the remainder exact by FMA, is the correctly rounded
    quotient (Markstein's theorem) -- three instructions instead of a division with a
    slow-path branch per element, which made the quantizers instruction-bound. Results
    below 2^-126, where the theorem's premises fail, quantize to zero either way. The
    CPU interpreter does not fuse tl.fma, so there we divide."""
    if INTERPRET:
        return tl.math.div_rn(x, d)
    else:
        q = x * inv
        return tl.fma(tl.fma(-q, d, x), inv, q)


# --------------------------------------------------------------------------- launchers
def row_kernel_launch_params(k: int) -> tuple[int, bool, int]:
    """(BLOCK, ONE_PASS, num_warps) for a one-program-per-row kernel over rows of length k:
    rows up to 16384 stay in registers (one read); longer rows are read twice, the second
    time mostly from L2. Four warps: more programs per SM beat wider ones (H200,
    benchmarks/tune_quant.py, M = 4096: K = 4096 13.9 / 12.8 us int8 / fp8 at 4 warps vs 15.1 /
    13.7 at 8; K = 14336 58.9 / 50.2 vs 83.3 / 73.2 at the 16 used before; M = 64 equal)."""
    block = pow2(k)
    if block <= 16384:
        return block, True, 4
    return 4096, False, 8


def scaled_mm_triton(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype, config: GemmConfig,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the scaled-matmul kernel: a [M, K] @ b [N, K]^T, scaled, cast to out_dtype.

    a and b are int8 (int32 accumulate) or float8 (fp32 accumulate) with unit stride along K;
    a_scale is [M] / [M, 1] or one element, b_scale [N] / [N, 1] or one element (float32,
    contiguous); bias [N] or None; out, if given, a row-major [M, N] buffer of out_dtype.
    No argument checks: callers validate.
    """
    m, k = a.shape
    n = b.shape[0]
    if out is None:
        out = torch.empty((m, n), device=a.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    cfg = config
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n), 1, 1)
    has_bias = bias is not None
    if bias is None:
        bias = out
    constexprs = dict(
        A_SCALE_ROWS=a_scale.numel() != 1, B_SCALE_ROWS=b_scale.numel() != 1, HAS_BIAS=has_bias,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SWAP_AB=cfg.swap_ab, EVEN_K=k % cfg.block_k == 0,
        ACC_DTYPE=tl.int32 if a.dtype == torch.int8 else tl.float32,
        IMPRECISE_ACC=None if cfg.fast_accum or a.dtype == torch.int8 else cfg.block_k)
    args = (a, b, out, a_scale, b_scale, bias, m, n, k, a.stride(0), b.stride(0), out.stride(0))
    key = (n, k, args[9], args[10], args[11], a.dtype, b.dtype, out.dtype, bias.dtype, constexprs["A_SCALE_ROWS"],
           constexprs["B_SCALE_ROWS"], has_bias, cfg)
    _SCALED_MM(key, grid, args, constexprs, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return out


def register_gemm_op(name: str, configs: dict, default_config):
    """Register the scaled GEMM as custom op ``optllm::<name>`` (with its fake) over a family's
    config table ``configs`` ((m_bucket, N, K) -> GemmConfig) and heuristic
    ``default_config(bucket, n, k)``. Returns ``gemm(xq, x_scale, w, w_scale, bias, out_dtype)``,
    which goes through the op only while torch.compile traces: eager calls skip the
    dispatcher (~10 us each)."""

    def impl(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        bucket, n, k = m_bucket(xq.shape[0]), w.shape[0], xq.shape[1]
        cfg = configs.get((bucket, n, k)) or default_config(bucket, n, k)
        return scaled_mm_triton(xq, x_scale, w, w_scale, bias, out_dtype, cfg)

    custom = torch.library.custom_op(f"optllm::{name}", impl, mutates_args=())

    @custom.register_fake
    def _(xq, x_scale, w, w_scale, bias, out_dtype):
        return xq.new_empty((xq.shape[0], w.shape[0]), dtype=out_dtype)

    def gemm(xq, x_scale, w, w_scale, bias, out_dtype):
        return (custom if torch.compiler.is_compiling() else impl)(xq, x_scale, w, w_scale, bias, out_dtype)

    return gemm


# --------------------------------------------------------------------------- argument checks
def check_activation(x: torch.Tensor, k: int | None = None) -> None:
    """ValueError unless x is a floating [.., K] tensor of an allowed dtype (K == k if given)."""
    if x.dtype not in IN_DTYPES:
        raise ValueError(f"x.dtype={x.dtype} is not supported; allowed: {IN_DTYPES}")
    if x.dim() < 1 or (k is not None and x.shape[-1] != k):
        raise ValueError(f"x.shape={tuple(x.shape)} must end in in_features={k}")


def check_gemm_shapes(xq, x_scale, w, w_scale, bias, out_dtype, scalar_scales: bool = False) -> None:
    """ValueError for inconsistent scaled-gemm arguments (int8 and fp8 alike);
    ``scalar_scales`` also allows one-element x_scale / w_scale (per-tensor)."""
    if xq.dim() != 2 or w.dim() != 2 or xq.shape[1] != w.shape[1] or xq.shape[1] == 0:
        raise ValueError(f"xq.shape={tuple(xq.shape)}, w.shape={tuple(w.shape)}: need [M, K] and [N, K], K > 0")
    m, n = xq.shape[0], w.shape[0]
    for name, s, rows in (("x_scale", x_scale, m), ("w_scale", w_scale, n)):
        if s.dtype != torch.float32:
            raise ValueError(f"{name}.dtype={s.dtype} must be torch.float32")
        if s.numel() != rows and not (scalar_scales and s.numel() == 1):
            raise ValueError(f"{name} has {s.numel()} elements; expected {rows}"
                             + (" or 1 (per-tensor)" if scalar_scales else ""))
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias.shape={tuple(bias.shape)} must be ({n},)")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} is not supported; allowed: {OUT_DTYPES}")


def scaled_mm_ref(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                  compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Torch reference of the scaled matmul, int8 or fp8 operands alike:
    (xq * x_scale) @ (w * w_scale)^T (+ bias) in compute_dtype, cast to out_dtype."""
    xd = xq.to(compute_dtype) * x_scale.reshape(-1, 1).to(compute_dtype)
    wd = w.to(compute_dtype) * w_scale.reshape(-1, 1).to(compute_dtype)
    y = xd @ wd.t()
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.to(out_dtype)
