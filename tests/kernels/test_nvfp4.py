"""NVFP4 format (bit-exact vs compressed-tensors), weight-only Triton GEMM, W4A4 reference."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from optllm.kernels import nvfp4 as F

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
# Output rounding bound, relative: bf16 gets one ulp (2^-7) because the interpreter truncates
# fp32 -> bf16 instead of rounding; fp16 gets two half-ulps (2^-10).
REL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
ACC = 1e-4  # fp32 accumulation-order slack, times sum_k |x| |w|


def _weight(n, k, gen):
    # rows of very different magnitude so group scales span much of the E4M3 range
    row_mag = torch.logspace(-3, 1, n, dtype=torch.float64).float()
    return (torch.randn(n, k, generator=gen) * row_mag[:, None]).to(DEV)


def _eff_scale(scales, g):
    return (scales.double() / g.double()).repeat_interleave(16, dim=-1)


# ------------------------------------------------------------------------------------ format
def test_e2m1_rounding_is_nearest_even_with_saturation():
    # every group's max is 6 and the tensor max is 6 -> global 448, scale 448: unit step
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 2.49, 2.51, 4.99, 5.01, 0.0, 1.5]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 2.0, 3.0, 4.0, 6.0, 0.0, 1.5]
    w = torch.tensor([vals, [-v for v in vals]], device=DEV)
    packed, scales, g = F.quantize_nvfp4(w)
    assert g.item() == 448.0 and torch.all(scales.float() == 448.0)
    deq = F.dequantize_nvfp4(packed, scales, g, torch.float32)
    expect = torch.tensor([want, [-v for v in want]], device=DEV)
    assert torch.equal(deq, expect)


def test_nibble_order_and_sign_bit():
    # element 2j in the low nibble, 2j+1 in the high nibble; nibble = sign<<3 | E2M1 magnitude code
    w = torch.tensor([[6.0, -0.5, 1.0, -6.0] + [0.0] * 12], device=DEV)
    packed, _, _ = F.quantize_nvfp4(w)
    assert packed[0, 0].item() == (0x9 << 4) | 0x7
    assert packed[0, 1].item() == (0xF << 4) | 0x2
    assert torch.all(packed[0, 2:] == 0)


def test_quantize_dequantize_on_grid_and_bounded():
    gen = torch.Generator().manual_seed(1)
    w = _weight(24, 96, gen)
    packed, scales, g = F.quantize_nvfp4(w)
    assert packed.shape == (24, 48) and packed.dtype == torch.uint8
    assert scales.shape == (24, 6) and scales.dtype == torch.float8_e4m3fn
    assert g.shape == (1,) and g.dtype == torch.float32
    deq32 = F.dequantize_nvfp4(packed, scales, g, torch.float32)
    # on the grid: |deq| is exactly e2m1 * (scale / global) for one E2M1 value (float32 maths)
    eff32 = (scales.float() / g).repeat_interleave(16, dim=-1)
    assert torch.all((deq32.abs()[..., None] == GRID.float().to(DEV) * eff32[..., None]).any(-1))
    deq, eff = deq32.double(), _eff_scale(scales, g)
    # bound: |w - deq| <= scale/global everywhere (half the widest E2M1 step plus E4M3 scale
    # rounding), and <= 0.25 * scale/global where |w| <= 1.75 * scale/global (step 0.5 there)
    err = (w.double() - deq).abs()
    assert torch.all(err <= eff * (1 + 1e-6))
    small = w.double().abs() <= 1.75 * eff
    assert torch.all(err[small] <= 0.25 * eff[small] * (1 + 1e-6))
    # on Gaussian data the relative Frobenius error of NVFP4 is ~0.1; 0.15 catches a broken grid
    assert ((w.double() - deq).norm() / w.double().norm()).item() < 0.15
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(F.dequantize_nvfp4(packed, scales, g, dtype), deq.float().to(dtype))
    # prepack only transposes: the checkpoint tensors come back bit for bit
    p2, s2, g2 = F.prepack_nvfp4(packed, scales, g).checkpoint_tensors()
    assert torch.equal(p2, packed) and torch.equal(s2.view(torch.uint8), scales.view(torch.uint8))
    assert torch.equal(g2, g)


def test_zero_group_and_zero_tensor():
    w = torch.randn(4, 32, device=DEV)
    w[1, 16:] = 0.0
    packed, scales, g = F.quantize_nvfp4(w)
    assert scales[1, 1].float().item() == 0.125  # compressed-tensors' eps for an all-zero group
    assert torch.all(F.dequantize_nvfp4(packed, scales, g, torch.float32)[1, 16:] == 0)
    packed, scales, g = F.quantize_nvfp4(torch.zeros(2, 16, device=DEV))
    assert g.item() == 1.0 and torch.all(F.dequantize_nvfp4(packed, scales, g, torch.float32) == 0)


def test_matches_compressed_tensors_bit_for_bit():
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    del ct
    gen = torch.Generator().manual_seed(2)
    w = _weight(16, 64, gen).cpu()
    packed, scales, g = F.quantize_nvfp4(w)
    args = NVFP4A16["weights"]
    g_ct = generate_gparam(w.min(), w.max())
    wg = w.unflatten(-1, (-1, 16))
    s_ct, _ = calculate_qparams(wg.amin(-1), wg.amax(-1), args, global_scale=g_ct)
    assert torch.equal(g, g_ct)
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    state = {"weight": w, "weight_scale": s_ct, "weight_global_scale": g_ct}
    sd = NVFP4PackedCompressor.compress(state, scheme)
    assert torch.equal(scales.view(torch.uint8), sd["weight_scale"].view(torch.uint8))
    assert torch.equal(packed, sd["weight_packed"])
    out = NVFP4PackedCompressor.decompress(sd, scheme)  # bf16
    assert torch.equal(F.dequantize_nvfp4(packed, scales, g, torch.bfloat16), out["weight"])
    # bf16 weights: same scales in, same bytes out
    wb = w.to(torch.bfloat16)
    pb, sb, gb = F.quantize_nvfp4(wb)
    assert torch.equal(pb, quantize_and_pack_fp4(wb, sb.float(), global_scale=gb, group_size=16))


# ------------------------------------------------------------------------------------ GEMM
@triton.jit
def _decode_kernel(b_ptr, e4m3_ptr, e2m1_ptr):
    b = tl.load(b_ptr + tl.arange(0, 256)).to(tl.int32)
    tl.store(e4m3_ptr + tl.arange(0, 256), F._e4m3_to_f32(b))
    tl.store(e2m1_ptr + tl.arange(0, 256), F._e2m1_to_f32(b & 15))


def test_in_kernel_decoders_are_exact_for_every_code():
    b = torch.arange(256, device=DEV).to(torch.uint8)
    e4m3, e2m1 = torch.full((2, 256), float("nan"), device=DEV).unbind(0)
    _decode_kernel[(1,)](b, e4m3, e2m1)
    fin = (b & 0x7F) != 0x7F  # E4M3FN NaN codes are never written as scales
    assert torch.equal(e4m3[fin], b.view(torch.float8_e4m3fn).float()[fin])
    lut = torch.cat([GRID, -GRID]).float().to(DEV)
    assert torch.equal(e2m1, lut[(b & 15).long()])


def test_triton_gemm_subnormal_and_eps_scales():
    # rows ~1e5 times below the tensor max give E4M3-subnormal scales; a zero group gets 0.125
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(32, 64, generator=gen) * torch.tensor([1.0] + [1e-5] * 31)[:, None]
    w[5, 16:32] = 0.0
    packed, scales, g = F.quantize_nvfp4(w.to(DEV))
    assert (scales.float()[1:] < 2.0**-6).float().mean() > 0.5 and (scales.float() > 0).all()
    assert scales[5, 1].float() == 0.125
    weight = F.prepack_nvfp4(packed, scales, g)
    x = torch.randn(4, 64, generator=gen).to(DEV, torch.float16)
    wd = F.dequantize_nvfp4(packed, scales, g, torch.float32)
    y = F.nvfp4_linear(x, weight, backend="triton", config=F.NVFP4GemmConfig(16, 32, 32))
    _check(y[:, 1:], (x.float() @ wd.T)[:, 1:], (x.float().abs() @ wd.abs().T)[:, 1:], torch.float16)


def _case(m, n, k, dtype, gen, bias=True):
    w = (torch.randn(n, k, generator=gen) * 0.05).to(DEV)
    packed, scales, g = F.quantize_nvfp4(w)
    weight = F.prepack_nvfp4(packed, scales, g)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
    wd = F.dequantize_nvfp4(packed, scales, g, torch.float32)
    ref = x.float() @ wd.T + (b.float() if bias else 0.0)
    scale = x.float().abs() @ wd.abs().T
    return weight, x, b, ref, scale


def _check(y, ref, scale, dtype, weight_rounded=False):
    """weight_rounded: the dequantize + cuBLAS path rounds each weight to dtype first (as the
    torch backend does), one more relative REL per product."""
    assert y.dtype == dtype and y.shape == ref.shape
    assert torch.isfinite(y).all()
    err = (y.float() - ref).abs()
    bound = REL[dtype] * ref.abs() + (ACC + (REL[dtype] if weight_rounded else 0.0)) * scale
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(48, 96), (72, 80), (64, 128)])
@pytest.mark.parametrize("m", [1, 3, 16, 33, 128])
def test_triton_gemm_matches_dequant_reference(m, n, k, dtype):
    gen = torch.Generator().manual_seed(1000 * m + n + k)
    weight, x, b, ref, scale = _case(m, n, k, dtype, gen)
    cfg = F.fused_config(F.m_bucket(m), n, k)
    assert cfg.split_k == 1 or m <= 16  # split-K only on the small-M path
    cfgs = [F.select_config(m, n, k), cfg] + ([dataclasses.replace(cfg, split_k=3)] if m <= 16 else [])
    ys = []
    for c in cfgs:
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
        ws = torch.full((c.split_k, m, n), float("nan"), device=DEV)
        ys.append(F._launch(x, weight.packed_t, weight.scales_t, weight.global_scale, b, out, ws, c))
        _check(ys[-1], ref, scale, dtype, weight_rounded=c.dequant)
    # the public entry (custom op, default config) gives the same bits
    assert torch.equal(F.nvfp4_linear(x, weight, b, backend="triton"), ys[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_dequant_matches_reference(dtype):
    # subnormal and zero-group scales included (rows 1e-5 below the tensor max)
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(40, 96, generator=gen) * torch.tensor([1.0] + [1e-5] * 19 + [3.0] * 20)[:, None]
    w[5, 16:32] = 0.0
    weight = F.prepack_nvfp4(*F.quantize_nvfp4(w.to(DEV)))
    got = F.dequantize_nvfp4_triton(weight, dtype)
    ref32 = F.dequantize_nvfp4(*weight.checkpoint_tensors(), torch.float32).T
    assert got.shape == (96, 40) and got.dtype == dtype
    if dtype == torch.float32 or DEV == "cuda":  # bit for bit (the interpreter truncates 16-bit casts)
        assert torch.equal(got, F.dequantize_nvfp4(*weight.checkpoint_tensors(), dtype).T)
    else:
        sub = 2 * REL[dtype] * torch.finfo(dtype).smallest_normal  # fp16 subnormal spacing
        assert torch.all((got.float() - ref32).abs() <= REL[dtype] * ref32.abs() + sub)


def test_config_selection_is_data_keyed_on_m_bucket(monkeypatch):
    assert [F.m_bucket(m) for m in (1, 3, 16, 17, 100, 5000)] == [1, 4, 16, 32, 128, 256]
    assert F.select_config(1, 4096, 14336) is F.DEQUANT  # nothing tabled: decode + cuBLAS
    tuned = F.NVFP4GemmConfig(16, 64, 128, 8)
    monkeypatch.setattr(F, "TUNED_CONFIGS", {(16, 4096, 14336): tuned})
    assert F.select_config(9, 4096, 14336) is tuned and F.select_config(17, 4096, 14336) is F.DEQUANT
    assert F.fused_config(4, 4096, 14336).split_k > 1  # small M, long K: split-K path
    assert F.fused_config(4, 4096, 4096).split_k == 1  # short K: the reduction is not worth it
    assert F.fused_config(32, 4096, 14336).split_k == 1  # tiled path


@pytest.mark.parametrize("cfg", [
    F.NVFP4GemmConfig(16, 16, 16, split_k=3),  # 5 K tiles over 3 splits: 2 + 2 + 1
    F.NVFP4GemmConfig(16, 32, 32, split_k=8),  # more splits than K tiles: trimmed, none empty
    F.NVFP4GemmConfig(16, 16, 32, group_m=2),  # 3 x 5 tiles, grouped order with a ragged group
    F.NVFP4GemmConfig(32, 64, 64, split_k=2),
    F.DEQUANT,
], ids=["split3", "split_surplus", "grouped", "split2", "dequant"])
def test_triton_gemm_configs(cfg):
    gen = torch.Generator().manual_seed(7)
    n, k = 72, 80
    x3 = torch.randn(3, 11, k, generator=gen).to(DEV, torch.bfloat16)  # [..., K] input, M = 33
    weight, _, _, _, _ = _case(1, n, k, torch.bfloat16, gen)
    wd = F.dequantize_nvfp4(*weight.checkpoint_tensors(), torch.float32)
    y = F.nvfp4_linear(x3, weight, None, backend="triton", config=cfg)
    assert y.shape == (3, 11, n)
    _check(y.reshape(-1, n), x3.reshape(-1, k).float() @ wd.T, x3.reshape(-1, k).float().abs() @ wd.abs().T,
           torch.bfloat16, weight_rounded=cfg.dequant)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_backend_and_auto_fallback(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    weight, x, b, ref, scale = _case(5, 40, 64, torch.float32, gen)
    x, b = x.to(dtype), b.to(dtype)
    y = F.nvfp4_linear(x, weight, b, backend="torch")
    # torch backend rounds the dequantized weight to x.dtype: one more rounding per weight
    rel = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    err = (y.float() - (x.float() @ F.dequantize_nvfp4(*weight.checkpoint_tensors(), torch.float32).T
                        + b.float())).abs()
    assert torch.all(err <= rel * ref.abs() + (rel + ACC) * scale)
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert torch.equal(F.nvfp4_linear(x, weight, b), y)  # auto -> torch on plain CPU
        with pytest.raises(ValueError, match="backend"):
            F.nvfp4_linear(x, weight, b, backend="triton")


def test_custom_op_opcheck():
    gen = torch.Generator().manual_seed(4)
    weight, x, b, _, _ = _case(3, 32, 48, torch.bfloat16, gen)
    cfg = F.NVFP4GemmConfig(16, 32, 16, split_k=2)  # the split path allocates a workspace too
    for dequant in (False, True):
        args = (x, weight.packed_t, weight.scales_t, weight.global_scale, b, cfg.block_m, cfg.block_n,
                cfg.block_k, cfg.split_k, cfg.group_m, cfg.num_warps, cfg.num_stages, dequant)
        torch.library.opcheck(torch.ops.optllm.nvfp4_gemm.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# ------------------------------------------------------------------------------------ W4A4
def test_w4a4_reference_matches_compressed_tensors_fake_quant():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp, generate_gparam

    gen = torch.Generator().manual_seed(5)
    weight, x, b, ref16, _ = _case(9, 40, 64, torch.float32, gen)
    x = x.cpu() * torch.logspace(-2, 1, 9)[:, None]  # tokens of different magnitude
    w = dict(zip(("packed", "scales", "global_scale"), (t.cpu() for t in weight.checkpoint_tensors())))
    gx = F.nvfp4_global_scale(x.abs().amax())
    assert torch.equal(gx, generate_gparam(x.min(), x.max()))
    y = F.nvfp4_w4a4_linear_ref(x, w["packed"], w["scales"], w["global_scale"], gx, b.cpu())
    args = NVFP4["input_activations"]
    sx, _ = compute_dynamic_scales_and_zp(x, args, module=None, global_scale=gx)
    xq = fake_quantize(x, sx, None, args, global_scale=gx)
    wd = F.dequantize_nvfp4(w["packed"], w["scales"], w["global_scale"], torch.float32)
    y_ct = xq @ wd.T + b.cpu()
    assert torch.all((y - y_ct).abs() <= 1e-5 * (xq.abs() @ wd.abs().T) + 1e-6 * y_ct.abs())
    # activation quantization costs accuracy against the weight-only product, but boundedly
    y16 = x @ wd.T + b.cpu()
    assert ((y - y16).norm() / y16.norm()).item() < 0.15


# ------------------------------------------------------------------------------------ errors
def test_bad_inputs_raise_value_error():
    w = torch.randn(8, 32, device=DEV)
    packed, scales, g = F.quantize_nvfp4(w)
    weight = F.prepack_nvfp4(packed, scales, g)
    x = torch.randn(2, 32, device=DEV, dtype=torch.bfloat16)
    cases = [
        lambda: F.quantize_nvfp4(torch.randn(8, 40)),  # K % 16 != 0
        lambda: F.quantize_nvfp4(torch.randint(0, 3, (8, 32))),  # integer weight
        lambda: F.quantize_nvfp4(torch.randn(32)),  # not 2-D
        lambda: F.quantize_nvfp4(torch.full((2, 16), float("nan"))),
        lambda: F.prepack_nvfp4(packed.to(torch.int32), scales, g),
        lambda: F.prepack_nvfp4(packed, scales.float(), g),
        lambda: F.prepack_nvfp4(packed, scales, g.to(torch.bfloat16)),
        lambda: F.prepack_nvfp4(packed[:, :12], scales[:, :1], g),  # K = 24
        lambda: F.dequantize_nvfp4(packed, scales[:, :1], g),
        lambda: F.nvfp4_linear(x.to(torch.int32), weight),
        lambda: F.nvfp4_linear(torch.randn(2, 48, device=DEV, dtype=torch.bfloat16), weight),
        lambda: F.nvfp4_linear(x, weight, torch.randn(3, device=DEV)),
        lambda: F.nvfp4_linear(x, weight, backend="cuda"),
        lambda: F.nvfp4_linear(x, (packed, scales, g)),
        lambda: F.NVFP4GemmConfig(16, 48, 64),
        lambda: F.NVFP4GemmConfig(16, 64, 8),
        lambda: F.NVFP4GemmConfig(16, 64, 64, split_k=0),
    ]
    for i, case in enumerate(cases):
        with pytest.raises(ValueError):
            case()
            pytest.fail(f"case {i} did not raise")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_gpu_model_shapes(m):
    gen = torch.Generator().manual_seed(m)
    for n, k in [(4096, 4096), (1536, 576)]:
        weight, x, b, ref, scale = _case(m, n, k, torch.bfloat16, gen)
        _check(F.nvfp4_linear(x, weight, b), ref, scale, torch.bfloat16,
               weight_rounded=F.select_config(m, n, k).dequant)
