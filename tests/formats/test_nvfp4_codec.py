"""nvfp4-pack-quantized (NVFP4): E2M1 values and E4M3 group scales against hand-computed ones
(saturation, subnormals, ties to even, the eps of an all-zero group), the weight round trip's
error bound, the codec's tensors bit for bit, a round trip through the installed
compressed-tensors package's own NVFP4PackedCompressor (decompress gives our dequantized
weight, compress gives our bytes back), the config groups against its NVFP4 / NVFP4A16 presets,
and one clear error for arguments the format cannot hold."""

from __future__ import annotations

import json

import pytest
import torch

from optllm.formats.args import LOCAL, QuantArgs
from optllm.formats.codec import get_codec
from optllm.formats.compressed_tensors import quantization_config, read_quantization
from optllm.formats.nvfp4_quantized import NVFP4QuantizedWeight
from optllm.kernels.nvfp4_format import dequantize_nvfp4
from optllm.quant.nvfp4 import nvfp4_quantize_weight

W = QuantArgs(4, 16, type="float", strategy="tensor_group")
A = QuantArgs(4, 16, type="float", strategy="tensor_group", dynamic=LOCAL)
ONE = torch.ones(1)

# (value in units of the group's step scale / global, E2M1 value, its nibble: sign << 3 | exponent << 1 | mantissa)
E2M1_CASES = [
    (6.0, 6.0, 0x7),  # the largest: 1.5 * 2^2
    (0.5, 0.5, 0x1),  # the only subnormal: 0.5 * 2^0 (exponent 0)
    (0.25, 0.0, 0x0),  # halfway 0 / 0.5: to even (0)
    (0.75, 1.0, 0x2),  # halfway 0.5 (mantissa 1) / 1 (mantissa 0): to even
    (1.25, 1.0, 0x2),  # halfway 1 / 1.5: to even (1)
    (1.75, 2.0, 0x4),
    (2.5, 2.0, 0x4),  # halfway 2 / 3
    (3.5, 4.0, 0x6),  # halfway 3 / 4
    (5.0, 4.0, 0x6),  # halfway 4 / 6
    (5.01, 6.0, 0x7),
    (-1.5, -1.5, 0xB),
    (-0.2, -0.0, 0x8),  # rounds to zero, keeps its sign (as compressed-tensors' packer)
]


@pytest.mark.parametrize("x, value, nibble", E2M1_CASES, ids=[f"{c[0]:g}" for c in E2M1_CASES])
def test_e2m1_encoding_matches_hand_computed_values(x, value, nibble):
    # the group's absmax is 6 and the global scale 448: group scale 448, one unit per step
    w = torch.tensor([[6.0, x] + [0.0] * 14])
    qw = nvfp4_quantize_weight(w, W)
    assert qw.global_scale.item() == 448.0 and qw.scale.float().item() == 448.0
    assert (qw.q[0, 0].item() >> 4) == nibble  # element 1: the high nibble of byte 0
    got = qw.dequantize()[0, 1]
    assert got.item() == value and torch.signbit(got) == (nibble >= 8)


def test_e2m1_saturates_at_six_steps():
    """A group scale rounded down (E4M3) puts the group's absmax past 6 steps: it saturates to
    6, the largest E2M1 value, never past it."""
    w = torch.tensor([[6.2] + [0.0] * 15])  # scale = 6.2 / 6 rounds to 1.0: 6.2 steps
    qw = nvfp4_quantize_weight(w, W, global_scale=ONE)
    assert qw.scale.float().item() == 1.0 and qw.dequantize()[0, 0].item() == 6.0


# (group absmax / 6 = the unrounded scale under global scale 1, E4M3 scale, its bits)
E4M3_SCALE_CASES = [
    (448.0, 448.0, 0x7E),  # the largest finite E4M3
    (1000.0, 448.0, 0x7E),  # saturates, never NaN
    (2.0 ** -9, 2.0 ** -9, 0x01),  # the smallest subnormal
    (7 * 2.0 ** -9, 7 * 2.0 ** -9, 0x07),  # the largest subnormal
    (3 * 2.0 ** -10, 2 * 2.0 ** -9, 0x02),  # 1.5 subnormal steps: tie, to even
    (2.0 ** -10, 0.125, 0x20),  # half the smallest subnormal: tie to 0, then compressed-tensors' eps (2^-3)
    (1.0625, 1.0, 0x38),  # halfway 1.0 / 1.125: to even
    (1.1875, 1.25, 0x3A),  # halfway 1.125 / 1.25: to even
    (17.0, 16.0, 0x58),  # halfway 16 / 18
    (19.0, 20.0, 0x5A),  # halfway 18 / 20
]


@pytest.mark.parametrize("s, value, bits", E4M3_SCALE_CASES, ids=[f"{c[0]:g}" for c in E4M3_SCALE_CASES])
def test_e4m3_group_scale_matches_hand_computed_values(s, value, bits):
    w = torch.tensor([[6 * s] + [0.0] * 15])
    qw = nvfp4_quantize_weight(w, W, global_scale=ONE)
    assert qw.scale.dtype == torch.float8_e4m3fn and qw.scale.float().item() == value
    assert qw.scale.view(torch.uint8).item() == bits


def test_all_zero_group_gets_the_eps_scale_and_zero_codes():
    w = torch.randn(2, 32)
    w[1, 16:] = 0.0
    qw = nvfp4_quantize_weight(w, W)
    assert qw.scale[1, 1].float().item() == 0.125 and not qw.dequantize()[1, 16:].any()


def test_weight_round_trip_is_within_half_a_step():
    """Per element |w - deq| <= step (half the widest E2M1 step, 2 units, plus the E4M3 rounding
    of the scale; measured at most 0.997 steps), <= step / 4 where |w| <= 1.75 steps (steps of 0.5
    there); relative error of these Gaussian rows < 0.12 (measured 0.089)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * torch.logspace(-3, 1, 48).reshape(-1, 1)
    qw = nvfp4_quantize_weight(w, W)
    assert qw.q.shape == (48, 48) and qw.q.dtype == torch.uint8 and qw.shape == (48, 96)
    assert qw.scale.shape == (48, 6) and qw.global_scale.shape == (1,)
    assert qw.global_scale.item() == pytest.approx(448 * 6 / w.abs().max().item(), rel=1e-6)
    step = (qw.scale.float() / qw.global_scale).repeat_interleave(16, dim=1)
    err = (qw.dequantize() - w).abs()
    assert (err <= step * (1 + 1e-6)).all()
    small = w.abs() <= 1.75 * step
    assert (err[small] <= 0.25 * step[small] * (1 + 1e-6)).all()
    rel = float((qw.dequantize() - w).norm() / w.norm())
    assert rel < 0.12, rel
    assert torch.equal(qw.dequantize(torch.bfloat16), dequantize_nvfp4(qw.q, qw.scale, qw.global_scale))


@pytest.mark.parametrize("acts", [None, A], ids=["w4a16", "w4a4"])
def test_codec_tensors_read_back_exactly(acts):
    codec = get_codec("nvfp4-pack-quantized")
    qw = nvfp4_quantize_weight(torch.randn(16, 64), W)
    if acts is not None:
        qw.input_global_scale = torch.tensor([123.5])
    parts = codec.encode(qw)
    want = {"weight_packed", "weight_scale", "weight_global_scale"} | codec.activation_tensors(acts)
    assert set(parts) == want and want <= set(codec.tensor_names) and codec.tensor_names[0] == "weight_packed"
    assert ("input_global_scale" in want) == (acts is not None)
    assert parts["weight_packed"].dtype == torch.uint8 and parts["weight_scale"].dtype == torch.float8_e4m3fn
    assert parts["weight_global_scale"].dtype == torch.float32 and parts["weight_global_scale"].shape == (1,)
    back = codec.decode(parts, W)
    assert torch.equal(back.q, qw.q) and torch.equal(back.scale.view(torch.uint8), qw.scale.view(torch.uint8))
    assert torch.equal(back.global_scale, qw.global_scale) and back.zero is None
    assert (back.input_global_scale is None) == (acts is None)
    with pytest.raises(ValueError, match="lacks weight_global_scale$"):
        codec.decode({k: v for k, v in parts.items() if k != "weight_global_scale"}, W)
    with pytest.raises(ValueError, match=r"scales: must be float8_e4m3fn \[16, 4\]"):
        codec.decode({**parts, "weight_scale": qw.scale.float()}, W)
    with pytest.raises(ValueError, match="input_global_scale .* must be one float"):
        codec.decode({**parts, "input_global_scale": torch.ones(2)}, W)


@pytest.mark.parametrize("acts", [None, A], ids=["w4a16", "w4a4"])
def test_round_trip_through_compressed_tensors_is_bit_exact(acts):
    """compressed-tensors' NVFP4PackedCompressor decompresses our tensors to our dequantized
    weight bit for bit (in bf16, its dtype); compressing the float weight with our scales gives
    our very bytes; compressing the decompressed weight gives the same values back (its packer
    drops the sign of a -0.0 input, which ours keeps for a negative weight rounded to zero, as
    its own does). It lists our tensors as its parameters."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    codec = get_codec("nvfp4-pack-quantized")
    group = quantization_config(W, ["Linear"], ["lm_head"], codec.name, acts)["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=["Linear"], weights=group["weights"],
                                input_activations=group["input_activations"])
    assert NVFP4PackedCompressor.can_compress(torch.nn.Linear, scheme)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 128, generator=g) * torch.logspace(-2, 1, 32).reshape(-1, 1)
    qw = nvfp4_quantize_weight(w, W)
    qw.input_global_scale = None if acts is None else torch.tensor([57.0])
    ours = codec.encode(qw)
    assert set(NVFP4PackedCompressor.compression_param_names(scheme)) <= set(ours)
    dense = NVFP4PackedCompressor.decompress(dict(ours), scheme)
    assert dense["weight"].dtype == torch.bfloat16 and torch.equal(dense["weight"], qw.dequantize(torch.bfloat16))
    again = NVFP4PackedCompressor.compress({**ours, "weight": w, "weight_scale": qw.scale.float()}, scheme)
    assert set(again) == set(ours)
    for name, t in ours.items():
        assert again[name].dtype == t.dtype and torch.equal(again[name].view(torch.uint8), t.view(torch.uint8)), name
    back = NVFP4PackedCompressor.compress({**ours, "weight": qw.dequantize(), "weight_scale": qw.scale.float()},
                                          scheme)
    assert torch.equal(dequantize_nvfp4(back["weight_packed"], back["weight_scale"], back["weight_global_scale"],
                                        torch.float32), qw.dequantize())


def test_config_groups_are_compressed_tensors_nvfp4_presets():
    """nvfp4's group equals compressed-tensors' NVFP4 preset field for field (scale_dtype and the
    static_minmax observer of its inputs included), nvfp4a16's NVFP4A16; both parse whole and
    read back to our arguments."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.quant_scheme import NVFP4, NVFP4A16

    fields = ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size", "scale_dtype")
    for acts, preset in ((A, NVFP4), (None, NVFP4A16)):
        qc = quantization_config(W, ["Linear"], ["lm_head"], "nvfp4-pack-quantized", acts)
        g = json.loads(json.dumps(qc))["config_groups"]["group_0"]
        assert qc["format"] == g["format"] == "nvfp4-pack-quantized"
        theirs = ct.QuantizationScheme.model_validate(g)
        assert all(getattr(theirs.weights, f) == getattr(preset["weights"], f) for f in fields)
        if acts is None:
            assert theirs.input_activations is None and "input_activations" not in preset
        else:
            assert all(getattr(theirs.input_activations, f) == getattr(preset["input_activations"], f) for f in fields)
            assert theirs.input_activations.observer == preset["input_activations"].observer == "static_minmax"
        ct.QuantizationConfig.model_validate(qc)  # the whole quantization_config parses
        read = read_quantization({"quantization_config": json.loads(json.dumps(qc))})
        assert read.weights == W and read.input_activations == acts


def test_arguments_nvfp4_cannot_hold_are_one_sentence():
    codec = get_codec("nvfp4-pack-quantized")
    with pytest.raises(ValueError, match=r"^NVFP4 weights are float 4-bit with strategy 'tensor_group' and "
                                         r"group_size 16, not float 4-bit with strategy 'group', group_size 64$"):
        codec.check(QuantArgs(4, 64, type="float"), A)
    with pytest.raises(ValueError, match="not int 4-bit with strategy 'group', group_size 128"):
        codec.check(QuantArgs(4, 128), None)
    with pytest.raises(ValueError, match=r"^NVFP4 input activations are float 4-bit .* not float 8-bit"):
        codec.check(W, QuantArgs(8, None, type="float", strategy="token", dynamic=True))
    with pytest.raises(ValueError, match="take dynamic 'local' .* not True"):
        codec.check(W, QuantArgs(4, 16, type="float", strategy="tensor_group", dynamic=True))
    with pytest.raises(ValueError, match="weights are static"):
        codec.check(QuantArgs(4, 16, type="float", strategy="tensor_group", dynamic=True), None)
    with pytest.raises(ValueError, match="dynamic='local' needs strategy 'tensor_group', not 'token'"):
        QuantArgs(4, None, type="float", strategy="token", dynamic=LOCAL)
    with pytest.raises(ValueError, match="nvfp4-pack-quantized weights need a global_scale"):
        codec.encode(NVFP4QuantizedWeight(torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 1), None, W))
    assert codec.vllm_incompatibility(W, A) is None and codec.vllm_incompatibility(W, None) is None
