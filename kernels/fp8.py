"""FP8 (E4M3) GEMM: float8_e4m3fn weights [N, K] with a per-tensor or per-channel float32
scale, activations quantized to E4M3 statically (a given per-tensor input scale) or
dynamically (per token, scale = row absmax / 448); fp32 accumulation on fp8 tensor cores.

    y[m, n] = x_scale[m or 0] * w_scale[n or 0] * sum_k xq[m, k] * w[n, k]  (+ bias[n])

The weight stays [N, K] row-major for the reason given in kernels/scaled_mm.py (Hopper's fp8
wgmma takes K-major operands only); the matmul kernel itself is the shared one there, and this
file holds the E4M3 activation quantizer, the FP8 config table, the fp8 ops and references.
Hopper's fp8 tensor cores accumulate with fewer mantissa bits than fp32. Below M = 256 every
config promotes partial sums to fp32 every block_k (as torch._scaled_mm does by default); from
M = 256 up, where the gemm is compute-bound, the tiles use fast_accum (sums over all of K stay
in the tensor core), as vLLM's CUTLASS FP8 kernels do. The trade, measured on the H200
(docs/BENCHMARKS.md, eleventh session): fast_accum is 1.3-1.5x faster at M = 256 / 4096
(0.95-0.99x torch._scaled_mm against 0.66-0.78x promoted) and its relative error is 1.3e-3
(K=4096) to 2.9e-3 (K=14336) on random data and 6.8e-3 on SmolLM2's real down_proj inputs,
against 2e-4 / 4e-4 promoted; SmolLM2's perplexity through either stays within the spread
float rounding alone gives an FP8 model (benchmarks/ref_noise_floor.py).
OPTLLM_FP8_FAST_ACCUM=0 (read at import) promotes at every M.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from optllm.kernels.common import CompiledLaunch, use_triton
from optllm.kernels.scaled_mm import (
    SCALE_EPS,
    GemmConfig,
    check_activation,
    check_gemm_shapes,
    div_rn,
    register_gemm_op,
    row_kernel_launch_params,
    scaled_mm_ref,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 (fn) value


FAST_ACCUM = os.environ.get("OPTLLM_FP8_FAST_ACCUM", "1") != "0"


def default_fp8_config(bucket: int, n: int, k: int, fast: bool | None = None) -> GemmConfig:
    """Heuristic config for shapes absent from FP8_CONFIGS (the H200 sweep's usual winners).
    fast (None: FAST_ACCUM): fast_accum tiles from M = 256 up; else tiles that promote, at
    most 128 x 128 there (promotion takes a second accumulator: a 128 x 256 tile's two would
    not fit in the registers)."""
    fast = FAST_ACCUM if fast is None else fast
    if bucket == 16:
        return GemmConfig(16, 64, 512, 1, 4, 4, swap_ab=True)
    if bucket == 32:
        return GemmConfig(32, 64, 256, 1, 4, 4, swap_ab=True)
    if bucket == 64:
        return GemmConfig(64, 32, 256, 8, 4, 5)
    if bucket == 128:
        return GemmConfig(64, 64, 256, 8, 4, 4)
    if fast:
        return (GemmConfig(64, 128, 128, 8, 4, 4, fast_accum=True) if bucket <= 512
                else GemmConfig(128, 256, 128, 8, 8, 3, fast_accum=True))
    return GemmConfig(64, 128, 128, 8, 4, 4) if bucket <= 512 else GemmConfig(128, 128, 128, 8, 8, 3)


def fp8_configs(fast: bool) -> dict[tuple[int, int, int], GemmConfig]:
    """The H200 sweep's winners (triton 3.6, CUDA-graph timing, 4 weight copies rotated) at
    Llama-3-8B shapes where they differ from the heuristic; keys are (m_bucket(M), N, K). The
    M >= 256 winners are fast_accum tiles: without fast, the heuristic's promoting tiles."""
    table = {
        (16, 28672, 4096): GemmConfig(16, 128, 256, 1, 4, 3, swap_ab=True),
        (64, 6144, 4096): GemmConfig(64, 64, 256, 1, 4, 5, swap_ab=True),
        (64, 28672, 4096): GemmConfig(64, 128, 128, 8, 4, 4),
    }
    if fast:
        table[(256, 28672, 4096)] = GemmConfig(128, 256, 128, 8, 8, 3, fast_accum=True)
        table[(1024, 28672, 4096)] = GemmConfig(128, 256, 128, 8, 8, 4, fast_accum=True)
    return table


FP8_CONFIGS = fp8_configs(FAST_ACCUM)


@triton.jit
def _to_e4m3(v, INTERPRET: tl.constexpr):
    """v (fp32) clamped to +-448 and rounded to E4M3, nearest even. The GPU's conversion
    (cvt.rn.satfinite) rounds so; Triton's CPU interpreter casts without carrying into the
    exponent, so there we round on the E4M3 grid in fp32 arithmetic first."""
    v = tl.clamp(v, -448.0, 448.0)
    if not INTERPRET:
        return v.to(tl.float8e4nv)
    e = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    qe = tl.maximum(e, 127 - 6) - 3  # biased exponent of one unit in the last of 3 mantissa bits
    quantum = (qe << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((254 - qe) << 23).to(tl.float32, bitcast=True)
    t = v * inv_quantum
    t = (t + 12582912.0) - 12582912.0  # 1.5 * 2**23: round |t| < 2**22 to an integer, ties even
    # put back the sign that the rounding drops from negatives going to zero (-0, as torch)
    sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
    return ((t * quantum).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, EPS: tl.constexpr,
                      STATIC: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                      INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(s_ptr)
    else:
        if ONE_PASS:
            amax = tl.max(tl.abs(x), axis=0)
        else:
            run = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                xk = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                run = tl.maximum(run, tl.abs(xk))
            amax = tl.max(run, axis=0)
        scale = tl.maximum(tl.math.div_rn(amax, 448.0), EPS)
        tl.store(s_ptr + row, scale)
    inv = tl.math.div_rn(1.0, scale)
    if ONE_PASS:
        tl.store(q_row + offs, _to_e4m3(div_rn(x, scale, inv, INTERPRET), INTERPRET), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK):
            xk = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _to_e4m3(div_rn(xk, scale, inv, INTERPRET), INTERPRET),
                     mask=k0 + offs < K)


_QUANT_FP8 = CompiledLaunch(_quant_fp8_kernel, pointers=3)


def launch_quantize_fp8(x: torch.Tensor, xq: torch.Tensor, scale: torch.Tensor, static: bool) -> torch.Tensor:
    """Run the fp8 quantize kernel on x [M, K] (unit stride along K) into xq fp8 [M, K]:
    static reads the one-element float32 ``scale``, dynamic writes ``scale`` [M, 1]."""
    m, k = x.shape
    if m:
        block, one_pass, warps = row_kernel_launch_params(k)
        args = (x, xq, scale, k, x.stride(0), xq.stride(0))
        # (Triton runs CPU tensors only in its interpreter)
        _QUANT_FP8((k, args[4], args[5], x.dtype, static), (m, 1, 1), args,
                   dict(EPS=SCALE_EPS, STATIC=static, BLOCK=block, ONE_PASS=one_pass, INTERPRET=not x.is_cuda),
                   dict(num_warps=warps))
    return xq


def _new_xq(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, device=x.device, dtype=FP8_DTYPE)


def _quantize_dynamic_impl(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.empty((x.shape[0], 1), device=x.device, dtype=torch.float32)
    return launch_quantize_fp8(x, _new_xq(x), scale, False), scale


def _quantize_static_impl(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return launch_quantize_fp8(x, _new_xq(x), scale, True)


# Registered so torch.compile sees through them; eager calls skip the dispatcher (~10 us each).
# Two quantize ops because a custom op may not return its input: the static one returns xq alone.
_dynamic_custom = torch.library.custom_op("optllm::quantize_fp8_dynamic", _quantize_dynamic_impl, mutates_args=())
_static_custom = torch.library.custom_op("optllm::quantize_fp8_static", _quantize_static_impl, mutates_args=())


@_dynamic_custom.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@_static_custom.register_fake
def _(x, scale):
    return x.new_empty(x.shape, dtype=FP8_DTYPE)


def _quantize_op(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    compiling = torch.compiler.is_compiling()
    if scale is None:
        return (_dynamic_custom if compiling else _quantize_dynamic_impl)(x)
    return (_static_custom if compiling else _quantize_static_impl)(x, scale), scale


_gemm_op = register_gemm_op("fp8_gemm", FP8_CONFIGS, default_fp8_config)


# --------------------------------------------------------------------------- public API
def _static_scale(scale: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor([float(scale)], device=like.device)
    if scale.numel() != 1 or not scale.is_floating_point():
        raise ValueError(f"input scale must be one floating value (per-tensor); got {scale.dtype} {tuple(scale.shape)}")
    return scale.reshape(1).to(device=like.device, dtype=torch.float32)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float | None = None,
                 backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x [M, K] (bf16/fp16/fp32) to float8_e4m3fn.

    scale None: dynamic per token, x_scale = max(row absmax / 448, SCALE_EPS), float32 [M, 1].
    scale given (one value, per tensor): static, x_scale is that value as float32 [1].
    xq = clamp(x / x_scale, -448, 448) rounded to nearest E4M3 (ties to even).
    """
    check_activation(x)
    if x.dim() != 2:
        raise ValueError(f"x.shape={tuple(x.shape)} must be 2-D [M, K]")
    s = None if scale is None else _static_scale(scale, x)
    if not use_triton(backend, x):
        return quantize_fp8_ref(x, s)
    return _quantize_op(x if x.stride(-1) == 1 else x.contiguous(), s)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             backend: str = "auto") -> torch.Tensor:
    """y [M, N] = (xq [M, K] @ w [N, K]^T) * x_scale * w_scale (+ bias [N]), in out_dtype.

    xq, w: float8_e4m3fn. x_scale float32 [M, 1] (per token) or one element (per tensor);
    w_scale float32 [N] / [N, 1] (per channel) or one element (per tensor).
    """
    if xq.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        raise ValueError(f"xq.dtype={xq.dtype}, w.dtype={w.dtype}: both must be {FP8_DTYPE}")
    check_gemm_shapes(xq, x_scale, w, w_scale, bias, out_dtype, scalar_scales=True)
    if not use_triton(backend, xq):
        return fp8_gemm_ref(xq, x_scale, w, w_scale, bias, out_dtype)
    return _gemm_op(xq.contiguous(), x_scale.contiguous(), w.contiguous(), w_scale.reshape(-1).contiguous(),
                    bias, out_dtype)


@dataclass(frozen=True)
class FP8Weight:
    """A linear layer's E4M3 weight, packed once for fp8_linear.

    weight: float8_e4m3fn [N, K] contiguous; scale: float32 [N] (per channel) or [1] (per tensor).
    """

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def per_channel(self) -> bool:
        return self.scale.numel() != 1 or self.weight.shape[0] == 1

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


def prepack_fp8(w_fp8: torch.Tensor, w_scale: torch.Tensor | float) -> FP8Weight:
    """Validate and pack an E4M3 weight [N, K] with a per-tensor (one value) or per-channel
    ([N] / [N, 1]) scale."""
    if w_fp8.dtype != FP8_DTYPE or w_fp8.dim() != 2:
        raise ValueError(f"w_fp8 must be a 2-D {FP8_DTYPE} tensor [N, K]; got {w_fp8.dtype} {tuple(w_fp8.shape)}")
    if not isinstance(w_scale, torch.Tensor):
        w_scale = torch.tensor([float(w_scale)], device=w_fp8.device)
    if not w_scale.is_floating_point() or w_scale.numel() not in (1, w_fp8.shape[0]):
        raise ValueError(f"w_scale must be floating with 1 or N={w_fp8.shape[0]} elements; "
                         f"got {w_scale.dtype} {tuple(w_scale.shape)}")
    return FP8Weight(w_fp8.contiguous(), w_scale.detach().reshape(-1).to(torch.float32).contiguous())


def fp8_linear(x: torch.Tensor, weight: FP8Weight, input_scale: torch.Tensor | float | None = None,
               bias: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (+ bias), x quantized to E4M3 on the fly: with
    ``input_scale`` (static, per tensor) or per token (dynamic) when it is None.

    Output dtype is x's dtype. backend: "auto" (Triton on CUDA or under TRITON_INTERPRET,
    else the torch reference), "triton" or "torch".
    """
    k = weight.weight.shape[1]
    check_activation(x, k)
    if bias is not None and tuple(bias.shape) != (weight.weight.shape[0],):
        raise ValueError(f"bias.shape={tuple(bias.shape)} must be ({weight.weight.shape[0]},)")
    s = None if input_scale is None else _static_scale(input_scale, x)
    if not use_triton(backend, x):
        return fp8_linear_ref(x, weight, s, bias)
    x2 = x.reshape(-1, k)
    xq, xs = _quantize_op(x2 if x2.stride(-1) == 1 else x2.contiguous(), s)
    y = _gemm_op(xq, xs, weight.weight, weight.scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.weight.shape[0])


# --------------------------------------------------------------------------- references
def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of quantize_fp8 (bit-identical outputs); scale: None or float32 [1]."""
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True)
        # a tensor divisor: CUDA torch turns division by a Python scalar into a reciprocal multiply
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=SCALE_EPS)
    else:
        scale = scale.reshape(1).to(torch.float32)
    xq = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


fp8_gemm_ref = scaled_mm_ref  # one reference serves int8 and fp8


def fp8_linear_ref(x: torch.Tensor, weight: FP8Weight, input_scale: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole pipeline in torch: quantize x [..., K] (static or per token), then the gemm."""
    k = weight.weight.shape[1]
    xq, xs = quantize_fp8_ref(x.reshape(-1, k), input_scale)
    y = fp8_gemm_ref(xq, xs, weight.weight, weight.scale, bias, x.dtype, compute_dtype)
    return y.reshape(*x.shape[:-1], weight.weight.shape[0])
