"""NVFP4 GEMM: a weight-only Triton kernel over NVFP4 weights, their runtime layout
(NVFP4Weight, prepack_nvfp4), its launch configs and the ``nvfp4_linear`` entry point.
The format itself (E2M1 codes, E4M3 group scales, global scale) and its torch quantize /
dequantize / W4A4 reference are in kernels/nvfp4_format.py, re-exported here.

Hopper has no FP4 tensor cores, so the kernel here is weight-only: it decodes the E2M1
nibbles and E4M3 scales with integer bit operations in registers (one code path on the GPU
and the interpreter, which cannot bitcast to fp8), multiplies them, and feeds a bf16/fp16
``tl.dot`` with fp32 accumulation; 1 / global_scale is applied once to the accumulator.
fp4 * E4M3 has at most 6 significant bits, so the in-register weight is exact in bf16 and
fp16. Its configs: block_m 16 with split-K over long K (fp32 partials summed after) for
decode sizes, a tiled grid with grouped tile order above (``fused_config``).

The other path decodes the whole weight to x's dtype with a Triton pass over the packed
bytes (``dequantize_nvfp4_triton``, bit-equal to ``dequantize_nvfp4``) and calls cuBLAS.
Dispatch is data (``TUNED_CONFIGS``, keyed on (M bucket, N, K); ``select_config``). Measured on
an H200 (docs/BENCHMARKS.md) the decode-and-cuBLAS path is faster at every M from 1 to 4096
(the fused kernel decodes E2M1 and E4M3 with ~10 integer/float operations per weight and is
instruction-bound), so it is the default; both are tested against the torch reference.
"""

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

import torch
import triton
import triton.language as tl

from optllm.kernels.common import grouped_tile, interpreting

# GROUP, FP4_MAX, FP8_MAX, nvfp4_global_scale, quantize_nvfp4 and nvfp4_w4a4_linear_ref are
# unused here, re-exported so the format's public API stays importable from this module.
from optllm.kernels.nvfp4_format import (  # noqa: F401
    FLOAT_DTYPES,
    FP4_MAX,
    FP8_MAX,
    GROUP,
    check_nvfp4_tensors,
    dequantize_nvfp4,
    nvfp4_global_scale,
    nvfp4_w4a4_linear_ref,
    quantize_nvfp4,
)

_BACKENDS = ("auto", "triton", "torch")


# ---------------------------------------------------------------------------- runtime weight
@dataclass(frozen=True, eq=False)
class NVFP4Weight:
    """A linear's NVFP4 weight in the kernel's layout (build it with ``prepack_nvfp4``):
    packed_t uint8 [K/2, N] (byte j of column n holds k = 2j low, 2j + 1 high), scales_t uint8
    [K/16, N] (E4M3 bits), global_scale float32 [1]; contiguous, on one device."""

    packed_t: torch.Tensor
    scales_t: torch.Tensor
    global_scale: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.packed_t.shape[1]

    @property
    def in_features(self) -> int:
        return self.packed_t.shape[0] * 2

    def checkpoint_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(packed uint8 [N, K/2], scales float8_e4m3fn [N, K/16], global_scale [1]) as views."""
        return self.packed_t.T, self.scales_t.T.view(torch.float8_e4m3fn), self.global_scale


def prepack_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> NVFP4Weight:
    """Validate checkpoint tensors and transpose them to the kernel's N-contiguous layout.

    Why transpose: the kernel builds [BLOCK_K, BLOCK_N] weight tiles for ``tl.dot`` and reads
    byte k // 2 for element k. With N contiguous every tile row is one coalesced, vectorised
    run of bytes (and of scale bytes); in the checkpoint's [N, K/2] layout a tile row is strided
    by K/2 bytes and nothing vectorises (H200, M = 1, N = K = 4096, same config: 237 us before
    the transpose, 159 us after).
    The bytes are unchanged, so ``checkpoint_tensors`` gives the checkpoint tensors back.
    """
    check_nvfp4_tensors(packed, scales, global_scale)
    return NVFP4Weight(packed.T.contiguous(), scales.view(torch.uint8).T.contiguous(),
                       global_scale.float().reshape(1).contiguous())


# ---------------------------------------------------------------------------- configs (data)
def _pow2_ceil(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


@dataclass(frozen=True)
class NVFP4GemmConfig:
    """Launch parameters of the GEMM kernel. block_* are powers of two (block_m, block_n >= 16,
    block_k >= 16 so every K tile covers whole scale groups); split_k >= 1 splits K (M <= 16).
    dequant: instead, decode the weight to x's dtype once (a Triton pass over the packed
    bytes) and call cuBLAS; the other fields are then unused."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    dequant: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}: must be a power of two >= 16, got {v}")
        for name in ("split_k", "group_m", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


# Keyed on (M bucket, N, K); M bucket = M rounded up to a power of two, capped at 256.
# Empty: on the H200 (benchmarks/bench_nvfp4.py, docs/bench/bench_nvfp4_h200.json, CUDA-graph
# replay at the four Llama-3-8B shapes) dequantize + cuBLAS beat the fused kernel at every M
# from 1 to 4096, 1.1-3.2x at M <= 64 and 7-15x above. Fused entries go here where a tuned
# fused config wins.
TUNED_CONFIGS: "MappingProxyType[tuple[int, int, int], NVFP4GemmConfig]" = MappingProxyType({})
_SM_COUNT = 132  # H100 / H200


def m_bucket(m: int) -> int:
    return min(_pow2_ceil(m), 256)


DEQUANT = NVFP4GemmConfig(16, 16, 16, dequant=True)


def fused_config(bucket: int, n: int, k: int) -> NVFP4GemmConfig:
    """Heuristic launch config of the fused kernel (for M buckets up to 64)."""
    bk_cap = max(16, min(256, 1 << (k.bit_length() - 1)))  # largest power of two <= K
    bn = min(64, max(16, _pow2_ceil(n)))
    if bucket <= 16:
        bk = min(128, bk_cap)
        k_tiles = math.ceil(k / bk)
        # split only long K (the reduction costs launches) and only up to ~2 programs per SM
        want = math.ceil(2 * _SM_COUNT / math.ceil(n / bn))
        split = 1 if k_tiles < 64 else max(1, min(8, k_tiles // 16, want))
        return NVFP4GemmConfig(16, bn, bk, split, num_warps=4, num_stages=4)
    return NVFP4GemmConfig(32, bn, min(128, bk_cap), num_warps=4, num_stages=4)


def select_config(m: int, n: int, k: int) -> NVFP4GemmConfig:
    """Tuned config for (M bucket, N, K) if listed, else dequantize + cuBLAS (the faster path
    at every size measured, see TUNED_CONFIGS)."""
    return TUNED_CONFIGS.get((m_bucket(m), n, k)) or DEQUANT


# ---------------------------------------------------------------------------- Triton kernel
@triton.jit
def _e2m1_to_f32(code):
    """int32 codes 0..15 -> float32 (E2M1: sign, 2 exponent bits with bias 1, 1 mantissa bit)."""
    e = (code >> 1) & 3
    m = code & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def _e4m3_to_f32(b):
    """int32 bytes 0..255 -> float32 (E4M3FN, bias 7; subnormals m * 2^-9; no NaN expected)."""
    e = (b >> 3) & 15
    # Exponent field e + 120 rebiases 7 -> 127; explicit subnormal branch so FTZ cannot bite.
    normal = (((b & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, (b & 7).to(tl.float32) * 0.001953125, normal)
    return tl.where((b & 0x80) != 0, -val, val)


# sizes that change from step to step are not specialized on (== 1, % 16): no compile mid-serving
@triton.jit(do_not_specialize=["M"])
def _nvfp4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wk, stride_sk, stride_os, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt_lo = pid_k * per_split
    kt_hi = tl.minimum(kt_lo + per_split, k_tiles)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(kt_lo, kt_hi):
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        byte = tl.load(w_ptr + (offs_k[:, None] // 2) * stride_wk + offs_n[None, :],
                       mask=k_mask[:, None] & n_mask[None, :], other=0).to(tl.int32)
        code = (byte >> ((offs_k[:, None] & 1) * 4)) & 15
        # One scale per 16 k: decode [BLOCK_K/16, BLOCK_N] bytes, then broadcast along k.
        offs_g = kt * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        sb = tl.load(s_ptr + offs_g[:, None] * stride_sk + offs_n[None, :],
                     mask=(offs_g < K // 16)[:, None] & n_mask[None, :], other=0).to(tl.int32)
        s = _e4m3_to_f32(sb)
        s = tl.reshape(tl.broadcast_to(s[:, None, :], (BLOCK_K // 16, 16, BLOCK_N)), (BLOCK_K, BLOCK_N))
        w = (_e2m1_to_f32(code) * s).to(x_ptr.dtype.element_ty)  # exact: <= 6 significant bits
        if DOT_F32:
            # The interpreter multiplies bf16 as raw uint16; fp32 products of bf16/fp16 are exact.
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)

    acc = acc / tl.load(g_ptr)
    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc, mask=mask)  # fp32 partials; empty splits write zeros


@triton.jit
def _nvfp4_dequant_kernel(w_ptr, s_ptr, g_ptr, out_ptr, K, N,
                          BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [K, N] = e2m1 * (scale / global_scale), rounded once to out's dtype (what
    dequantize_nvfp4 computes), from packed_t [K/2, N] and scales_t [K/16, N]. A program
    covers BLOCK_G scale groups (16 k each) of BLOCK_N columns; every store row is
    contiguous along N."""
    offs_g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_g < K // 16)[:, None] & (offs_n < N)[None, :]
    sb = tl.load(s_ptr + offs_g[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.int32)
    eff = tl.math.div_rn(_e4m3_to_f32(sb), tl.load(g_ptr))  # once per group and column
    for r in tl.static_range(8):  # the group's 8 bytes: k = 16 g + 2 r (low nibble), + 1 (high)
        j = offs_g * 8 + r
        b = tl.load(w_ptr + j[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.int32)
        row = (2 * j).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out_ptr + row, (_e2m1_to_f32(b & 15) * eff).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + row + N, (_e2m1_to_f32(b >> 4) * eff).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_nvfp4_triton(weight: "NVFP4Weight", dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N] in dtype on the weight's device: the same numbers as
    ``dequantize_nvfp4(*weight.checkpoint_tensors(), dtype).T`` (bit for bit on the GPU; the
    CPU interpreter truncates, not rounds, to 16-bit floats)."""
    k, n = weight.in_features, weight.out_features
    out = torch.empty((k, n), device=weight.packed_t.device, dtype=dtype)
    grid = (triton.cdiv(k // 16, 8), triton.cdiv(n, 128))
    _nvfp4_dequant_kernel[grid](weight.packed_t, weight.scales_t, weight.global_scale, out, k, n,
                                BLOCK_G=8, BLOCK_N=128, num_warps=4)
    return out


def _launch(x: torch.Tensor, packed_t: torch.Tensor, scales_t: torch.Tensor, global_scale: torch.Tensor,
            bias: Optional[torch.Tensor], out: torch.Tensor, workspace: Optional[torch.Tensor],
            cfg: NVFP4GemmConfig) -> torch.Tensor:
    """Run the kernel on x [M, K] into out [M, N]; split_k > 1 needs fp32 workspace [split, M, N].
    cfg.dequant: decode the weight to x.dtype (dequantize_nvfp4_triton) and use cuBLAS."""
    m, k = x.shape
    n = packed_t.shape[1]
    if cfg.dequant:
        wt = dequantize_nvfp4_triton(NVFP4Weight(packed_t, scales_t, global_scale), x.dtype)
        return torch.addmm(bias, x, wt, out=out) if bias is not None else torch.mm(x, wt, out=out)
    k_tiles = math.ceil(k / cfg.block_k)
    split = math.ceil(k_tiles / math.ceil(k_tiles / cfg.split_k))  # drop splits left with no tile
    grid = (math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n), split)
    dst = out if split == 1 else workspace[:split]
    _nvfp4_gemm_kernel[grid](
        x, packed_t, scales_t, global_scale, bias if bias is not None else global_scale, dst,
        m, n, k,
        x.stride(0), x.stride(1), packed_t.stride(0), scales_t.stride(0),
        dst.stride(0) if split > 1 else 0, dst.stride(-2), dst.stride(-1),
        HAS_BIAS=bias is not None, SPLIT_K=split, DOT_F32=interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        y = dst.sum(0)
        if bias is not None:
            y += bias.float()
        out.copy_(y)
    return out


@torch.library.custom_op("optllm::nvfp4_gemm", mutates_args=())
def nvfp4_gemm(x: torch.Tensor, packed_t: torch.Tensor, scales_t: torch.Tensor, global_scale: torch.Tensor,
               bias: Optional[torch.Tensor], block_m: int, block_n: int, block_k: int, split_k: int,
               group_m: int, num_warps: int, num_stages: int, dequant: bool = False) -> torch.Tensor:
    """y [M, N] (x.dtype) = x [M, K] @ dequant(W).T + bias on the Triton kernel, with W in the
    ``NVFP4Weight`` layout (packed_t uint8 [K/2, N], scales_t uint8 [K/16, N])."""
    cfg = NVFP4GemmConfig(block_m, block_n, block_k, split_k, group_m, num_warps, num_stages, dequant)
    n = packed_t.shape[1]
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    ws = None
    if split_k > 1 and not dequant:
        ws = torch.empty((split_k, x.shape[0], n), dtype=torch.float32, device=x.device)
    return _launch(x, packed_t, scales_t, global_scale, bias, out, ws, cfg)


@nvfp4_gemm.register_fake
def _(x, packed_t, scales_t, global_scale, bias, *launch_params):
    return x.new_empty((x.shape[0], packed_t.shape[1]))


# ---------------------------------------------------------------------------- public wrapper
def nvfp4_linear(x: torch.Tensor, weight: NVFP4Weight, bias: Optional[torch.Tensor] = None,
                 backend: str = "auto", config: Optional[NVFP4GemmConfig] = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W.T + bias for an NVFP4 weight W [N, K], in x.dtype.

    backend: "triton" (weight-only kernel; x bf16/fp16 on CUDA, or any device under
    TRITON_INTERPRET=1), "torch" (dequantize to x.dtype + matmul; x may also be float32), or
    "auto" (triton where it can run, else torch). ``config`` overrides ``select_config``.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend: must be one of {_BACKENDS}, got {backend!r}")
    if not isinstance(weight, NVFP4Weight):
        raise ValueError(f"weight: must be an NVFP4Weight (see prepack_nvfp4), got {type(weight).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x: dtype must be bfloat16/float16 (float32 on the torch backend), got {x.dtype}")
    n, k = weight.out_features, weight.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x: last dim must be in_features = {k}, got {x.shape[-1]}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias: shape must be ({n},), got {tuple(bias.shape)}")
    if x.device != weight.packed_t.device:
        raise ValueError(f"x: on {x.device} but the weight is on {weight.packed_t.device}")
    can_triton = (x.is_cuda or interpreting()) and x.dtype in (torch.bfloat16, torch.float16)
    if backend == "auto":
        backend = "triton" if can_triton else "torch"
    if backend == "torch":
        w = dequantize_nvfp4(*weight.checkpoint_tensors(), x.dtype)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
    if not can_triton:
        raise ValueError("backend: 'triton' needs bf16/fp16 x on CUDA, or TRITON_INTERPRET=1")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], n))
    cfg = config or select_config(x2.shape[0], n, k)
    y = nvfp4_gemm(x2, weight.packed_t, weight.scales_t, weight.global_scale, bias, cfg.block_m,
                   cfg.block_n, cfg.block_k, cfg.split_k, cfg.group_m, cfg.num_warps, cfg.num_stages,
                   cfg.dequant)
    return y.reshape(*x.shape[:-1], n)
