"""W8A8-INT8 GEMM: int8 activations with per-token scales times int8 weights with
per-channel scales, int32 accumulation.

    y[m, n] = x_scale[m] * w_scale[n] * sum_k xq[m, k] * w[n, k]  (+ bias[n])

Here: the per-token int8 quantize kernel, the INT8 config table and its heuristic, the
public int8 ops (registered as torch custom ops), W8A8Weight and the torch references.
The matmul itself is the scaled-matmul kernel of kernels/scaled_mm.py, shared with
kernels/fp8.py; its module docstring says why the weight stays [N, K] row-major.

Asymmetric activations (``w8a8_int8_azp_linear``): per token, over [min(min, 0), max(max, 0)],
scale = range / 255 and a zero point azp = round(-128 - min / scale), xq = sat(round(x / scale)
+ azp) (compressed-tensors' asymmetric grid; vLLM's azp quantizer takes the same from the row's
own range); the int32 products then carry azp * sum_k w[n, k], which the
epilogue subtracts with the weight's per-channel code sums (``int8_code_sums``, taken once):

    y[m, n] = x_scale[m] * w_scale[n] * (sum_k xq[m, k] * w[n, k] - azp[m] * sum_k w[n, k])

Rows with outliers (a few channels far larger than the rest, as in small LLMs' norm outputs)
keep about twice the resolution a symmetric grid leaves them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# IN_DTYPES, OUT_DTYPES, M_BUCKETS, m_bucket and scaled_mm_triton are unused here,
# re-exported because they were defined in this module before the shared kernel moved to
# scaled_mm.py.
from optllm.kernels.common import BACKENDS, CompiledLaunch, use_triton  # noqa: F401
from optllm.kernels.scaled_mm import (  # noqa: F401
    IN_DTYPES,
    M_BUCKETS,
    OUT_DTYPES,
    SCALE_EPS,
    GemmConfig,
    check_activation,
    check_gemm_shapes,
    div_rn,
    m_bucket,
    register_gemm_op,
    row_kernel_launch_params,
    scaled_mm_ref,
    scaled_mm_triton,
)


# --------------------------------------------------------------------------- configs
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
    # benchmarks/tune_scaled_mm.py, 2026-11-30: GEMM alone 1.14x / 1.19x / 1.27x _int_mm
    (64, 6144, 4096): GemmConfig(64, 64, 256, 8, 4, 5),
    (64, 4096, 4096): GemmConfig(64, 64, 256, 8, 4, 5),
    (256, 4096, 4096): GemmConfig(64, 128, 128, 8, 4, 4),
    (64, 28672, 4096): GemmConfig(64, 128, 128, 8, 4, 4),
    (128, 28672, 4096): GemmConfig(64, 128, 128, 8, 4, 4),
    (256, 28672, 4096): GemmConfig(128, 256, 128, 8, 8, 3),
    (1024, 28672, 4096): GemmConfig(256, 128, 128, 8, 8, 3),
}


# --------------------------------------------------------------------------- kernel
@triton.jit
def _quant_int8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                       EPS: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                       INTERPRET: tl.constexpr):
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
    inv = tl.math.div_rn(1.0, scale)
    # Adding then subtracting 1.5 * 2**23 rounds |v| < 2**22 to the nearest integer, ties to
    # even, as torch.round does; libdevice.rint has no CPU-interpreter counterpart.
    if ONE_PASS:
        v = tl.clamp(div_rn(x, scale, inv, INTERPRET), -127.0, 127.0)
        v = (v + 12582912.0) - 12582912.0
        tl.store(q_row + offs, v.to(tl.int8), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK):
            xk = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            v = tl.clamp(div_rn(xk, scale, inv, INTERPRET), -127.0, 127.0)
            v = (v + 12582912.0) - 12582912.0
            tl.store(q_row + k0 + offs, v.to(tl.int8), mask=k0 + offs < K)


_QUANT_INT8 = CompiledLaunch(_quant_int8_kernel, pointers=3)


# --------------------------------------------------------------------------- launchers
def launch_quantize_int8(x: torch.Tensor, xq: torch.Tensor, scale: torch.Tensor) -> None:
    """Run the per-token int8 quantize kernel on x [M, K] (unit stride along K) into the
    given buffers xq int8 [M, K] and scale float32 [M, 1]. No argument checks."""
    m, k = x.shape
    if m:
        block, one_pass, warps = row_kernel_launch_params(k)
        args = (x, xq, scale, k, x.stride(0), xq.stride(0))
        # (Triton runs CPU tensors only in its interpreter)
        _QUANT_INT8((k, args[4], args[5], x.dtype), (m, 1, 1), args,
                    dict(EPS=SCALE_EPS, BLOCK=block, ONE_PASS=one_pass, INTERPRET=not x.is_cuda), dict(num_warps=warps))


def _quantize_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq = torch.empty(x.shape, device=x.device, dtype=torch.int8)
    scale = torch.empty((x.shape[0], 1), device=x.device, dtype=torch.float32)
    launch_quantize_int8(x, xq, scale)
    return xq, scale


# Registered so torch.compile sees through them; eager calls skip the dispatcher (~10 us each).
_quantize_custom = torch.library.custom_op("optllm::quantize_per_token_int8", _quantize_impl, mutates_args=())


@_quantize_custom.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], 1), dtype=torch.float32)


def _quantize_op(x):
    return (_quantize_custom if torch.compiler.is_compiling() else _quantize_impl)(x)


_gemm_op = register_gemm_op("w8a8_int8_gemm", INT8_CONFIGS, default_int8_config)


# --------------------------------------------------------------------------- public API
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


def int8_code_sums(weight: W8A8Weight) -> torch.Tensor:
    """w_scale[n] * sum_k w[n, k] in float32 [N] (the sum exact in int32): the asymmetric
    activations' correction, taken once per weight."""
    return weight.weight.sum(dim=1, dtype=torch.int32).float() * weight.scale


def w8a8_int8_azp_linear(x: torch.Tensor, weight: W8A8Weight, code_sums: torch.Tensor,
                         bias: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (+ bias), x quantized per token to int8 with a zero point
    (module docstring); code_sums = int8_code_sums(weight). The activation quantizer is torch
    ops (bit-identical to the reference on every device); the int8 GEMM is the Triton one
    (backend as w8a8_int8_linear's), in float32, then the zero points' rank-one correction.
    Output dtype is x's dtype."""
    k, n = weight.weight.shape[1], weight.weight.shape[0]
    check_activation(x, k)
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias.shape={tuple(bias.shape)} must be ({n},)")
    if tuple(code_sums.shape) != (n,) or code_sums.dtype != torch.float32:
        raise ValueError(f"code_sums must be float32 [{n}] (int8_code_sums); got {code_sums.dtype} "
                         f"{tuple(code_sums.shape)}")
    if not use_triton(backend, x):
        return w8a8_int8_azp_linear_ref(x, weight, bias)
    xq, xs, azp = quantize_per_token_int8_azp_ref(x.reshape(-1, k))
    y = _gemm_op(xq, xs, weight.weight, weight.scale, None, torch.float32)
    y = y - (xs * azp) * code_sums
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# --------------------------------------------------------------------------- references
def quantize_per_token_int8_azp_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq int8 [M, K], scale float32 [M, 1], azp float32 [M, 1], integer-valued):
    per row, over the range [min(min, 0), max(max, 0)] (compressed-tensors' calculate_qparams:
    zero stays exact, and a constant row cannot blow up), scale = range / 255, azp =
    round(-128 - min / scale), xq = clamp(round(x / scale) + azp, -128, 127), in float32 (vLLM's
    dynamic_scaled_int8_azp_quant computes the same from the row's own min and max); an
    all-zero row gets the smallest scale. x ~ (xq - azp) * scale."""
    xf = x.float()
    lo, hi = xf.amin(dim=-1, keepdim=True).clamp(max=0), xf.amax(dim=-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / torch.full_like(hi, 255.0)).clamp(min=SCALE_EPS)
    azp = torch.round(-128.0 - lo / scale)
    xq = (torch.round(xf / scale) + azp).clamp(-128, 127).to(torch.int8)
    return xq, scale, azp


def w8a8_int8_azp_linear_ref(x: torch.Tensor, weight: W8A8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of w8a8_int8_azp_linear: the dequantized activations (xq - azp) * scale
    times the dequantized weight, in float32."""
    k, n = weight.weight.shape[1], weight.weight.shape[0]
    xq, xs, azp = quantize_per_token_int8_azp_ref(x.reshape(-1, k))
    y = ((xq.float() - azp) * xs) @ (weight.weight.float() * weight.scale[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def quantize_per_token_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of quantize_per_token_int8 (bit-identical outputs)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # a tensor divisor: CUDA torch turns division by a Python scalar into a reciprocal multiply
    scale = (amax / torch.full_like(amax, 127.0)).clamp(min=SCALE_EPS)
    xq = torch.round(xf / scale).clamp(-127, 127).to(torch.int8)
    return xq, scale


w8a8_int8_gemm_ref = scaled_mm_ref  # one reference serves int8 and fp8


def w8a8_int8_linear_ref(x: torch.Tensor, weight: W8A8Weight, bias: torch.Tensor | None = None,
                         compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole pipeline in torch: per-token quantize x [..., K], then the dequantized gemm."""
    k = weight.weight.shape[1]
    xq, xs = quantize_per_token_int8_ref(x.reshape(-1, k))
    y = w8a8_int8_gemm_ref(xq, xs, weight.weight, weight.scale, bias, x.dtype, compute_dtype)
    return y.reshape(*x.shape[:-1], weight.weight.shape[0])
