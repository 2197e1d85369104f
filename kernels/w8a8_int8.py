"""W8A8-INT8 GEMM: int8 activations with per-token scales times int8 weights with
per-channel scales, int32 accumulation.

    y[m, n] = x_scale[m] * w_scale[n] * sum_k xq[m, k] * w[n, k]  (+ bias[n])

Weight layout: kept as the checkpoint's [N, K] row-major, never transposed. Hopper's 8-bit
tensor-core MMA (wgmma) takes both operands K-major only, and a [N, K] row-major weight
tile is K-major as loaded; a [K, N] copy would cost a shared-memory transpose per tile. The
peer ``torch._int_mm(A [M, K], B [K, N])`` is called with ``B = w.t()``, a column-major view
of the same storage (cuBLASLt's int8 "TN" form), so both read the same bytes.

The scaled-matmul Triton kernel here is shared with kernels/fp8.py: the two families differ
only in operand dtype, accumulator dtype and whether each scale is a scalar or a vector.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BACKENDS = ("auto", "triton", "torch")
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


def default_int8_config(bucket: int, n: int, k: int) -> GemmConfig:
    """Heuristic config for shapes absent from INT8_CONFIGS (the H200 sweep's usual winners)."""
    if bucket <= 32:
        return GemmConfig(bucket, 64, 256, 1, 4, 6 if bucket == 16 else 4, swap_ab=True)
    if bucket <= 128:
        return GemmConfig(64, 64, 256, 8, 4, 4)
    if bucket == 256:
        return GemmConfig(128, 128, 128, 8, 4, 4)
    return GemmConfig(128, 256, 128, 8, 8, 3)


# H200 sweep (triton 3.6, CUDA-graph timing, 4 weight copies rotated) at Llama-3-8B shapes,
# where the winner differs from the heuristic; keys are (m_bucket(M), N, K).
INT8_CONFIGS: dict[tuple[int, int, int], GemmConfig] = {
    (16, 28672, 4096): GemmConfig(16, 128, 256, 1, 4, 3, swap_ab=True),
    (64, 28672, 4096): GemmConfig(64, 128, 128, 8, 4, 4),
    (128, 28672, 4096): GemmConfig(64, 128, 128, 8, 4, 4),
    (256, 28672, 4096): GemmConfig(128, 256, 128, 8, 8, 3),
    (1024, 28672, 4096): GemmConfig(256, 128, 128, 8, 8, 3),
}


# --------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["M"])
def _scaled_mm_kernel(
    a_ptr, b_ptr, out_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    M, N, K, stride_am, stride_bn, stride_om,
    A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr,
    ACC_DTYPE: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
):
    # Grouped program order: GROUP_M row-tiles share each weight column-tile while it is in L2.
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

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


@triton.jit
def _quant_int8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                       EPS: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
    else:
        run = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            xk = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            run = tl.maximum(run, tl.abs(xk))
        amax = tl.max(run, axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, 127.0), EPS)
    tl.store(s_ptr + row, scale)
    # Adding then subtracting 1.5 * 2**23 rounds |v| < 2**22 to the nearest integer, ties to
    # even, as torch.round does; libdevice.rint has no CPU-interpreter counterpart.
    if ONE_PASS:
        v = tl.clamp(tl.math.div_rn(x, scale), -127.0, 127.0)
        v = (v + 12582912.0) - 12582912.0
        tl.store(q_row + offs, v.to(tl.int8), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK):
            xk = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            v = tl.clamp(tl.math.div_rn(xk, scale), -127.0, 127.0)
            v = (v + 12582912.0) - 12582912.0
            tl.store(q_row + k0 + offs, v.to(tl.int8), mask=k0 + offs < K)


# --------------------------------------------------------------------------- launchers
def row_kernel_launch_params(k: int) -> tuple[int, bool, int]:
    """(BLOCK, ONE_PASS, num_warps) for a one-program-per-row kernel over rows of length k:
    rows up to 16384 stay in registers (one read); longer rows are read twice, the second
    time mostly from L2."""
    block = triton.next_power_of_2(k)
    if block <= 16384:
        return block, True, 4 if block <= 1024 else (8 if block <= 4096 else 16)
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
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _scaled_mm_kernel[grid](
        a, b, out, a_scale, b_scale, out if bias is None else bias,
        m, n, k, a.stride(0), b.stride(0), out.stride(0),
        A_SCALE_ROWS=a_scale.numel() != 1, B_SCALE_ROWS=b_scale.numel() != 1, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        SWAP_AB=cfg.swap_ab, EVEN_K=k % cfg.block_k == 0,
        ACC_DTYPE=tl.int32 if a.dtype == torch.int8 else tl.float32,
        IMPRECISE_ACC=None if cfg.fast_accum or a.dtype == torch.int8 else cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def launch_quantize_int8(x: torch.Tensor, xq: torch.Tensor, scale: torch.Tensor) -> None:
    """Run the per-token int8 quantize kernel on x [M, K] (unit stride along K) into the
    given buffers xq int8 [M, K] and scale float32 [M, 1]. No argument checks."""
    m, k = x.shape
    if m:
        block, one_pass, warps = row_kernel_launch_params(k)
        _quant_int8_kernel[(m,)](x, xq, scale, k, x.stride(0), xq.stride(0), EPS=SCALE_EPS,
                                 BLOCK=block, ONE_PASS=one_pass, num_warps=warps)


def _quantize_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq = torch.empty(x.shape, device=x.device, dtype=torch.int8)
    scale = torch.empty((x.shape[0], 1), device=x.device, dtype=torch.float32)
    launch_quantize_int8(x, xq, scale)
    return xq, scale


def _gemm_impl(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    m, k = xq.shape
    n = w.shape[0]
    cfg = INT8_CONFIGS.get((m_bucket(m), n, k)) or default_int8_config(m_bucket(m), n, k)
    return scaled_mm_triton(xq, x_scale, w, w_scale, bias, out_dtype, cfg)


# Registered so torch.compile sees through them; eager calls skip the dispatcher (~10 us each).
_quantize_custom = torch.library.custom_op("optllm::quantize_per_token_int8", _quantize_impl, mutates_args=())
_gemm_custom = torch.library.custom_op("optllm::w8a8_int8_gemm", _gemm_impl, mutates_args=())


@_quantize_custom.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@_gemm_custom.register_fake
def _(xq, x_scale, w, w_scale, bias, out_dtype):
    return xq.new_empty((xq.shape[0], w.shape[0]), dtype=out_dtype)


def _quantize_op(x):
    return (_quantize_custom if torch.compiler.is_compiling() else _quantize_impl)(x)


def _gemm_op(xq, x_scale, w, w_scale, bias, out_dtype):
    return (_gemm_custom if torch.compiler.is_compiling() else _gemm_impl)(xq, x_scale, w, w_scale, bias, out_dtype)


# --------------------------------------------------------------------------- public API
def use_triton(backend: str, t: torch.Tensor) -> bool:
    """Resolve ``backend`` ("auto" | "triton" | "torch") for tensor ``t``: "auto" takes Triton
    on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1, else the torch reference."""
    if backend == "auto":
        return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton":
        if not (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 for CPU tensors")
        return True
    if backend == "torch":
        return False
    raise ValueError(f"backend={backend!r} is not supported; allowed: {BACKENDS}")


def check_activation(x: torch.Tensor, k: int | None = None) -> None:
    """ValueError unless x is a floating [.., K] tensor of an allowed dtype (K == k if given)."""
    if x.dtype not in IN_DTYPES:
        raise ValueError(f"x.dtype={x.dtype} is not supported; allowed: {IN_DTYPES}")
    if x.dim() < 1 or (k is not None and x.shape[-1] != k):
        raise ValueError(f"x.shape={tuple(x.shape)} must end in in_features={k}")


def quantize_per_token_int8(x: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-token int8 quantization of x [M, K] (bf16/fp16/fp32).

    Returns xq int8 [M, K] and x_scale float32 [M, 1] with x ~= xq * x_scale;
    scale = max(row absmax / 127, SCALE_EPS), xq = clamp(round_half_even(x / scale), -127, 127).
    """
    check_activation(x)
    if x.dim() != 2:
        raise ValueError(f"x.shape={tuple(x.shape)} must be 2-D [M, K]")
    if not use_triton(backend, x):
        return quantize_per_token_int8_ref(x)
    return _quantize_op(x if x.stride(-1) == 1 else x.contiguous())


def w8a8_int8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                   backend: str = "auto") -> torch.Tensor:
    """y [M, N] = (xq [M, K] @ w [N, K]^T) * x_scale [M, 1] * w_scale [N] (+ bias [N]), in out_dtype.

    xq and w are int8, the product accumulates exactly in int32; scales are float32
    (w_scale may be [N] or [N, 1]).
    """
    if xq.dtype != torch.int8 or w.dtype != torch.int8:
        raise ValueError(f"xq.dtype={xq.dtype}, w.dtype={w.dtype}: both must be torch.int8")
    check_gemm_shapes(xq, x_scale, w, w_scale, bias, out_dtype)
    if not use_triton(backend, xq):
        return w8a8_int8_gemm_ref(xq, x_scale, w, w_scale, bias, out_dtype)
    return _gemm_op(xq.contiguous(), x_scale.contiguous(), w.contiguous(), w_scale.reshape(-1).contiguous(),
                    bias, out_dtype)


def check_gemm_shapes(xq, x_scale, w, w_scale, bias, out_dtype, scalar_scales: bool = False) -> None:
    """ValueError for inconsistent scaled-gemm arguments (shared with kernels/fp8.py);
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


@dataclass(frozen=True)
class W8A8Weight:
    """A linear layer's int8 weight, packed once for w8a8_int8_linear.

    weight: int8 [N, K] contiguous (kept [N, K], see the module docstring);
    scale: float32 [N] (per output channel).
    """

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


def prepack_w8a8(w_int8: torch.Tensor, w_scale: torch.Tensor) -> W8A8Weight:
    """Validate and pack an int8 weight [N, K] with per-channel scales [N] or [N, 1]."""
    if w_int8.dtype != torch.int8 or w_int8.dim() != 2:
        raise ValueError(f"w_int8 must be a 2-D torch.int8 tensor [N, K]; got {w_int8.dtype} {tuple(w_int8.shape)}")
    if not w_scale.is_floating_point() or w_scale.numel() != w_int8.shape[0]:
        raise ValueError(f"w_scale must be floating with N={w_int8.shape[0]} elements; "
                         f"got {w_scale.dtype} {tuple(w_scale.shape)}")
    return W8A8Weight(w_int8.contiguous(), w_scale.detach().reshape(-1).to(torch.float32).contiguous())


def w8a8_int8_linear(x: torch.Tensor, weight: W8A8Weight, bias: torch.Tensor | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (+ bias), with x quantized per token to int8 on the fly.

    Output dtype is x's dtype. backend: "auto" (Triton on CUDA or under TRITON_INTERPRET,
    else the torch reference), "triton" or "torch".
    """
    k = weight.weight.shape[1]
    check_activation(x, k)
    if bias is not None and tuple(bias.shape) != (weight.weight.shape[0],):
        raise ValueError(f"bias.shape={tuple(bias.shape)} must be ({weight.weight.shape[0]},)")
    if not use_triton(backend, x):
        return w8a8_int8_linear_ref(x, weight, bias)
    x2 = x.reshape(-1, k)
    xq, xs = _quantize_op(x2 if x2.stride(-1) == 1 else x2.contiguous())
    y = _gemm_op(xq, xs, weight.weight, weight.scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.weight.shape[0])


# --------------------------------------------------------------------------- references
def quantize_per_token_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of quantize_per_token_int8 (bit-identical outputs)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # a tensor divisor: CUDA torch turns division by a Python scalar into a reciprocal multiply
    scale = (amax / torch.full_like(amax, 127.0)).clamp(min=SCALE_EPS)
    xq = torch.round(xf / scale).clamp(-127, 127).to(torch.int8)
    return xq, scale


def w8a8_int8_gemm_ref(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                       compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantized math: (xq * x_scale) @ (w * w_scale)^T (+ bias) in compute_dtype, cast to out_dtype."""
    xd = xq.to(compute_dtype) * x_scale.reshape(-1, 1).to(compute_dtype)
    wd = w.to(compute_dtype) * w_scale.reshape(-1, 1).to(compute_dtype)
    y = xd @ wd.t()
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.to(out_dtype)


def w8a8_int8_linear_ref(x: torch.Tensor, weight: W8A8Weight, bias: torch.Tensor | None = None,
                         compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole pipeline in torch: per-token quantize x [..., K], then the dequantized gemm."""
    k = weight.weight.shape[1]
    xq, xs = quantize_per_token_int8_ref(x.reshape(-1, k))
    y = w8a8_int8_gemm_ref(xq, xs, weight.weight, weight.scale, bias, x.dtype, compute_dtype)
    return y.reshape(*x.shape[:-1], weight.weight.shape[0])
