"""NVFP4 format (compressed-tensors `nvfp4-pack-quantized`) in torch: quantize, dequantize,
the activation quantizer and the W4A4 reference; the GEMM that consumes it is in kernels/nvfp4.py.

Format, as compressed-tensors 0.20 writes and reads it, for W [N, K] (out, in):
- ``weight_packed`` uint8 [N, K/2]: element k of a row sits in byte k // 2, even k in the
  low nibble, odd k in the high nibble. A nibble is the E2M1 bit pattern itself
  (sign << 3 | exponent << 1 | mantissa): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0-7.
- ``weight_scale`` float8_e4m3fn [N, K/16]: one scale per 16 consecutive values along K.
- ``weight_global_scale`` float32 [1]: global = 448 * 6 / amax(|W|), so that the largest group
  scale lands on the top of the E4M3 range.
- dequant: w = fp4 * (scale / global_scale); group scale = fp8(global * group_amax / 6), a
  scale that rounds to 0 becomes 0.125 (E4M3 eps). Rounding onto E2M1 is nearest-even.
- ``input_global_scale`` (W4A4 checkpoints): the same 448 * 6 / amax convention over
  calibrated activations; the per-16 activation scales are computed on the fly.
``nvfp4_w4a4_linear_ref`` keeps the W4A4 numerics a Blackwell FP4 GEMM would compute.
"""

from typing import Optional

import torch

GROUP = 16
FP4_MAX = 6.0
FP8_MAX = 448.0
_FP8_EPS = 0.125  # smallest scale compressed-tensors substitutes for a zero group
# Round-to-nearest-even decision points between consecutive E2M1 magnitudes: True means a tie
# rounds up (the upper neighbour has the even mantissa).
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                    (2.5, False), (3.5, True), (5.0, False))
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # accepted weight / activation dtypes


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """Global scale float32 [1] for a tensor whose largest magnitude is ``amax``: 448 * 6 / amax
    (1.0 where amax is 0 or non-finite, as compressed-tensors does)."""
    a = amax.detach().float().abs().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(FP8_MAX * FP4_MAX / a, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def _check_float_2d(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype must be one of float32/bfloat16/float16, got {t.dtype}")
    if t.ndim != 2 or t.shape[1] % GROUP != 0:
        raise ValueError(f"{name}: shape must be [rows, K] with K % {GROUP} == 0, got {tuple(t.shape)}")


def _group_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 scales [R, K/16] of float32 x [R, K]."""
    amax = x.abs().unflatten(-1, (-1, GROUP)).amax(-1)
    s = global_scale * (amax / FP4_MAX)  # same operation order as compressed-tensors: bit-equal
    s = s.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return torch.where(s == 0, _FP8_EPS, s).to(torch.float8_e4m3fn)


def _encode_e2m1(x: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [R, K] (0..15) of float32 x [R, K] under E4M3 scales [R, K/16]."""
    eff = (scales.float() / global_scale).repeat_interleave(GROUP, dim=-1)
    v = x / eff
    a = v.abs()
    code = torch.zeros_like(v, dtype=torch.uint8)
    for t, tie_up in _E2M1_THRESHOLDS:
        code += (a >= t) if tie_up else (a > t)
    # signbit (not v < 0) so negatives that round to zero keep their sign, as compressed-tensors'
    # packer does: the bytes then match bit for bit.
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def _decode_e2m1(code: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (0..15), by integer arithmetic rather than a lookup table:
    a table would be copied from the host on every call, which a CUDA graph cannot capture."""
    c = code.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << (e - 1).clamp(min=0)).float())  # 2^(e-1) (1 + m/2)
    return torch.where((c & 8) != 0, -mag, mag)


def _unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def quantize_nvfp4(w: torch.Tensor, global_scale: Optional[torch.Tensor] = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize W [N, K] (float32/bf16/fp16, K % 16 == 0, finite) to NVFP4.

    Returns (packed uint8 [N, K/2], scales float8_e4m3fn [N, K/16], global_scale float32 [1]),
    exactly the compressed-tensors tensors weight_packed / weight_scale / weight_global_scale.
    ``global_scale`` (one float): use it instead of W's own (``nvfp4_global_scale`` of its
    absmax), e.g. the one that linears fused into one GEMM share (vLLM keeps one per fused layer).
    Maths is float32; E2M1 rounding is nearest-even. Per element, |w - dequant| <= scale/global
    (half the widest E2M1 step), and <= 0.25 * scale/global where |w| <= 1.75 * scale/global.
    """
    _check_float_2d("w", w)
    x = w.detach().float()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("w: contains NaN or Inf")
    if global_scale is None:
        g = nvfp4_global_scale(x.abs().amax() if x.numel() else torch.zeros(()))
    else:
        g = global_scale.detach().float().reshape(1).to(x.device)
    scales = _group_scales(x, g)
    code = _encode_e2m1(x, scales, g)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), scales.contiguous(), g.to(w.device)


def check_nvfp4_tensors(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> None:
    """ValueError unless (packed uint8 [N, K/2], scales float8_e4m3fn [N, K/16], global_scale
    float32 with one element) are consistent NVFP4 tensors with K % 16 == 0, on one device."""
    if packed.dtype != torch.uint8 or packed.ndim != 2:
        raise ValueError(f"packed: must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 2
    if k % GROUP != 0:
        raise ValueError(f"packed: K = 2 * packed.shape[1] = {k} must be a multiple of {GROUP}")
    if scales.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (n, k // GROUP):
        raise ValueError(
            f"scales: must be float8_e4m3fn [{n}, {k // GROUP}], got {scales.dtype} {tuple(scales.shape)}")
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise ValueError(f"global_scale: must be one float32 value, got {global_scale.dtype} "
                         f"with {global_scale.numel()} elements")
    if packed.device != scales.device or packed.device != global_scale.device:
        raise ValueError("packed, scales, global_scale: must be on one device")


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W [N, K] in ``dtype`` from NVFP4 tensors: fp4 * (scale / global_scale), computed in
    float32 then cast once (bit-equal to compressed-tensors' decompression)."""
    check_nvfp4_tensors(packed, scales, global_scale)
    eff = (scales.float() / global_scale.float().reshape(1)).repeat_interleave(GROUP, dim=-1)
    return (_decode_e2m1(_unpack_codes(packed)) * eff).to(dtype)


def quantize_nvfp4_activations_ref(x: torch.Tensor, input_global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K % 16 == 0) quantized to NVFP4 along K, dynamic per-16 E4M3 scales under the
    static ``input_global_scale``, as float32 [..., K] E2M1 value * its E4M3 group scale, i.e.
    without the 1 / input_global_scale factor: at most 6 significant bits and |v| <= 2688, so
    exact in bf16 and fp16 too. The activation side of ``nvfp4_w4a4_linear_ref``; no host sync."""
    k = x.shape[-1]
    x2 = x.detach().reshape(-1, k).float()
    gx = input_global_scale.detach().float().reshape(1)
    xs = _group_scales(x2, gx)
    xq = _decode_e2m1(_encode_e2m1(x2, xs, gx)) * xs.float().repeat_interleave(GROUP, dim=-1)
    return xq.reshape(x.shape)


def nvfp4_w4a4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                          global_scale: torch.Tensor, input_global_scale: torch.Tensor,
                          bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 [..., N]: what a Blackwell FP4 tensor-core GEMM computes for x [..., K].

    x is quantized to NVFP4 along K (dynamic per-16 E4M3 scales under the static
    ``input_global_scale``), both operands' fp4 * scale products are summed in float32 and the
    sum is multiplied by 1 / (input_global_scale * global_scale).
    """
    check_nvfp4_tensors(packed, scales, global_scale)
    k = packed.shape[1] * 2
    if x.shape[-1] != k:
        raise ValueError(f"x: last dim must be K = {k}, got {x.shape[-1]}")
    gx = input_global_scale.detach().float().reshape(1)
    xq = quantize_nvfp4_activations_ref(x.reshape(-1, k), gx)
    wq = _decode_e2m1(_unpack_codes(packed)) * scales.float().repeat_interleave(GROUP, dim=-1)
    y = (xq @ wq.T) * (1.0 / (gx * global_scale.float().reshape(1)))
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], packed.shape[0])
