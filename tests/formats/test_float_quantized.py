"""float-quantized (FP8 E4M3): the encoding against hand-computed values (saturation at 448,
subnormals, ties to even), the weight round trip's error bound, the codec's tensors bit for
bit, its config group against compressed-tensors' FP8 presets, and one clear error for
arguments it cannot hold."""

from __future__ import annotations

import pytest
import torch

from optllm.formats.args import QuantArgs
from optllm.formats.codec import get_codec
from optllm.formats.compressed_tensors import quantization_config
from optllm.formats.float_quantized import E4M3, FloatQuantizedWeight, to_e4m3
from optllm.kernels.fp8 import quantize_fp8_ref
from optllm.quant.fp8 import fp8_quantize_weight

W = QuantArgs(8, None, type="float", strategy="channel")
STATIC = QuantArgs(8, None, type="float", strategy="tensor")
DYNAMIC = QuantArgs(8, None, type="float", strategy="token", dynamic=True)

# (input, E4M3 value, its bits): 1 sign, 4 exponent (bias 7), 3 mantissa bits
E4M3_CASES = [
    (448.0, 448.0, 0x7E),  # the largest finite value, 1.75 * 2^8
    (1e4, 448.0, 0x7E),  # saturates, never NaN (0x7F)
    (float("inf"), 448.0, 0x7E),
    (-464.0, -448.0, 0xFE),  # the midpoint to the next (non-existent) step saturates too
    (2.0 ** -9, 2.0 ** -9, 0x01),  # the smallest subnormal
    (7 * 2.0 ** -9, 7 * 2.0 ** -9, 0x07),  # the largest subnormal
    (2.0 ** -6, 2.0 ** -6, 0x08),  # the smallest normal
    (2.0 ** -10, 0.0, 0x00),  # half the smallest subnormal: tie, to even (0)
    (3 * 2.0 ** -10, 2 * 2.0 ** -9, 0x02),  # 1.5 subnormal steps: tie, to even (2)
    (1.0625, 1.0, 0x38),  # halfway 1.0 (mantissa 000) / 1.125 (001): to even
    (1.1875, 1.25, 0x3A),  # halfway 1.125 (001) / 1.25 (010): to even
    (17.0, 16.0, 0x58),  # halfway 16 / 18
    (19.0, 20.0, 0x5A),  # halfway 18 / 20
    (-0.3, -0.3125, 0xAA),  # nearest: 1.25 * 2^-2
]


@pytest.mark.parametrize("x, value, bits", E4M3_CASES, ids=[f"{c[0]:g}" for c in E4M3_CASES])
def test_e4m3_encoding_matches_hand_computed_values(x, value, bits):
    q = to_e4m3(torch.tensor([x]))
    assert q.dtype == E4M3 and q.float().item() == value and q.view(torch.uint8).item() == bits
    # the kernels' activation quantizer (scale 1) encodes the same way
    xq, _ = quantize_fp8_ref(torch.tensor([[x]]), torch.ones(1))
    assert xq.view(torch.uint8).item() == bits


def test_weight_round_trip_is_within_half_a_step_and_saturates_exactly_at_the_row_max():
    """Per element: |w - q * s| <= 2^-4 |w| (3 mantissa bits, round to nearest) + 2^-10 s
    (half the smallest subnormal step); each row's absmax lands on exactly +-448 (the bf16
    scale is within 2^-9 of absmax / 448, so absmax / scale rounds or saturates to 448), and
    no value is NaN or inf."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * torch.logspace(-3, 1, 48).reshape(-1, 1)
    w[3, 7] = 80.0  # an outlier owns its row's scale
    w[5] = 0.0  # an all-zero row: a finite (eps) scale, all codes zero
    rows = torch.arange(48) != 5
    qw = fp8_quantize_weight(w, W, torch.bfloat16)
    assert qw.q.dtype == E4M3 and qw.scale.shape == (48, 1) and qw.scale.dtype == torch.bfloat16
    assert torch.isfinite(qw.q.float()).all() and qw.q[5].float().abs().max() == 0 and qw.scale[5] > 0
    assert (qw.q.float().abs().amax(1)[rows] == 448).all()
    assert torch.equal(qw.scale[rows], (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)[rows])
    s = qw.scale.float()
    err = (qw.q.float() * s - w).abs()
    assert (err <= 2.0 ** -4 * w.abs() + 2.0 ** -10 * s).all()  # measured: at most 0.94 of the bound
    rel = float((qw.dequantize(torch.float32) - w).norm() / w.norm())
    assert rel < 0.03, rel  # measured 0.024 (random normal rows, dequantized in bf16 as the checkpoint)


@pytest.mark.parametrize("acts", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_codec_tensors_are_compressed_tensors_and_read_back_exactly(acts):
    codec = get_codec("float-quantized")
    qw = fp8_quantize_weight(torch.randn(16, 64), W, torch.bfloat16)
    if not acts.dynamic:
        qw.input_scale = torch.tensor([0.02], dtype=torch.bfloat16)
    parts = codec.encode(qw)
    want = {"weight", "weight_scale"} | codec.activation_tensors(acts)
    assert set(parts) == want and want <= set(codec.tensor_names) and codec.tensor_names[0] == "weight_scale"
    assert parts["weight"].dtype == E4M3 and parts["weight_scale"].shape == (16, 1)
    back = codec.decode(parts, W)
    assert torch.equal(back.q.view(torch.uint8), qw.q.view(torch.uint8)) and torch.equal(back.scale, qw.scale)
    assert (back.input_scale is None) == acts.dynamic
    with pytest.raises(ValueError, match="weight_scale .* does not match a channel scale"):
        codec.decode({**parts, "weight_scale": qw.scale.reshape(-1)}, W)
    with pytest.raises(ValueError, match="lacks weight"):
        codec.decode({"weight_scale": qw.scale}, W)


def test_config_group_is_compressed_tensors_fp8_presets():
    """fp8-dynamic's group equals compressed-tensors' FP8_DYNAMIC preset field for field; fp8's
    inputs equal the FP8 preset's (static per tensor, observer static_minmax) and its weights
    FP8_DYNAMIC's per-channel ones."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.quant_scheme import FP8, FP8_DYNAMIC

    fields = ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size")

    def same(ours: dict, preset) -> bool:
        theirs = ct.QuantizationArgs.model_validate(ours)
        return all(getattr(theirs, f) == getattr(preset, f) for f in fields)

    dyn = quantization_config(W, ["Linear"], ["lm_head"], "float-quantized", DYNAMIC)
    g = dyn["config_groups"]["group_0"]
    assert dyn["format"] == g["format"] == "float-quantized"
    assert same(g["weights"], FP8_DYNAMIC["weights"]) and same(g["input_activations"], FP8_DYNAMIC["input_activations"])
    st = quantization_config(W, ["Linear"], ["lm_head"], "float-quantized", STATIC)["config_groups"]["group_0"]
    assert same(st["input_activations"], FP8["input_activations"]) and same(st["weights"], FP8_DYNAMIC["weights"])
    assert st["input_activations"]["observer"] == FP8["input_activations"].observer == "static_minmax"
    ct.QuantizationConfig.model_validate(dyn)  # the whole quantization_config parses


def test_arguments_float_quantized_cannot_hold_are_one_sentence():
    codec = get_codec("float-quantized")
    with pytest.raises(ValueError, match=r"^FP8 weight strategy 'group' \(group_size 64\) is not supported; allowed"):
        codec.check(QuantArgs(8, 64, type="float"), DYNAMIC)
    with pytest.raises(ValueError, match="weight type int 8-bit is not supported here"):
        codec.check(QuantArgs(8, None), DYNAMIC)
    with pytest.raises(ValueError, match="input_activations must be given"):
        codec.check(W, None)
    with pytest.raises(ValueError, match="strategy 'token' and dynamic False are not supported"):
        codec.check(W, QuantArgs(8, None, type="float", strategy="token"))
    assert codec.vllm_incompatibility(W, DYNAMIC) is None and codec.vllm_incompatibility(W, STATIC) is None
    assert "per tensor" in codec.vllm_incompatibility(W, QuantArgs(8, None, type="float", strategy="channel"))


def test_dequantize_is_in_the_scale_dtype_as_compressed_tensors():
    q = to_e4m3(torch.tensor([[1.5, -3.0], [0.25, 448.0]]))
    qw = FloatQuantizedWeight(q, torch.tensor([[0.1], [0.3]], dtype=torch.bfloat16), None, W)
    want = q.to(torch.bfloat16) * qw.scale
    assert qw.dequantize().dtype == torch.bfloat16 and torch.equal(qw.dequantize(), want)
