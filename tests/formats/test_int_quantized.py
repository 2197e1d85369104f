"""int-quantized (INT8 W8A8): the codec's tensors bit for bit, a round trip through the installed
compressed-tensors package's own IntQuantizationCompressor (decompress gives our dequantized
weight, compress gives our codes back), our int8 grid against compressed-tensors' observer
and quantizer, the config group against its INT8_W8A8 preset, the static input quantizer
against hand-computed codes, and one clear error for arguments the format cannot hold."""

from __future__ import annotations

import pytest
import torch

from optllm.formats.args import QuantArgs
from optllm.formats.codec import get_codec
from optllm.formats.compressed_tensors import quantization_config
from optllm.formats.int_quantized import IntQuantizedWeight, int8_scale, quantize_static_int8
from optllm.quant.smoothquant import int8_rtn

W = QuantArgs(8, None, strategy="channel")
DYNAMIC = QuantArgs(8, None, strategy="token", dynamic=True)
STATIC = QuantArgs(8, None, strategy="tensor")
DYNAMIC_ASYM = QuantArgs(8, None, strategy="token", dynamic=True, symmetric=False)  # w8a8-int8-asym


def _weight(n=16, k=64, seed=0, static=False) -> IntQuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n).reshape(-1, 1)
    qw = int8_rtn(w, W, torch.bfloat16)
    if static:
        qw.input_scale = torch.tensor([0.037], dtype=torch.bfloat16)
    return qw


@pytest.mark.parametrize("acts", [DYNAMIC, STATIC], ids=["dynamic", "static"])
def test_codec_tensors_read_back_exactly(acts):
    codec = get_codec("int-quantized")
    qw = _weight(static=not acts.dynamic)
    parts = codec.encode(qw)
    want = {"weight", "weight_scale"} | codec.activation_tensors(acts)
    assert set(parts) == want and want <= set(codec.tensor_names) and codec.tensor_names[0] == "weight_scale"
    assert parts["weight"].dtype == torch.int8 and parts["weight_scale"].shape == (16, 1)
    back = codec.decode(parts, W)
    assert torch.equal(back.q, qw.q) and torch.equal(back.scale, qw.scale) and back.zero is None
    assert (back.input_scale is None) == acts.dynamic
    if not acts.dynamic:
        assert torch.equal(back.input_scale, qw.input_scale.reshape(1))
    with pytest.raises(ValueError, match=r"weight_scale .* does not match a channel scale \(16, 1\)"):
        codec.decode({**parts, "weight_scale": qw.scale.reshape(-1)}, W)
    with pytest.raises(ValueError, match="lacks weight$"):
        codec.decode({"weight_scale": qw.scale}, W)
    with pytest.raises(ValueError, match="weight is torch.float32 .* needs torch.int8"):
        codec.decode({**parts, "weight": qw.q.float()}, W)


@pytest.mark.parametrize("acts", ["dynamic", "static", "asym"])
def test_round_trip_through_compressed_tensors_is_bit_exact(acts):
    """compressed-tensors' IntQuantizationCompressor decompresses our tensors to our dequantized
    weight bit for bit, and compresses that weight (with our scale) back to our very codes."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    codec = get_codec("int-quantized")
    static = acts == "static"
    args = {"dynamic": DYNAMIC, "static": STATIC, "asym": DYNAMIC_ASYM}[acts]
    codec.check(W, args)
    group = quantization_config(W, ["Linear"], ["lm_head"], "int-quantized", args)["config_groups"]["group_0"]
    assert group["input_activations"]["symmetric"] == (acts != "asym")
    scheme = QuantizationScheme(targets=["Linear"], weights=group["weights"],
                                input_activations=group["input_activations"])
    assert IntQuantizationCompressor.can_compress(torch.nn.Linear, scheme)
    qw = _weight(seed=3, static=static)
    ours = codec.encode(qw)
    dense = IntQuantizationCompressor.decompress(dict(ours), scheme)
    assert torch.equal(dense["weight"], qw.dequantize()) and dense["weight"].dtype == torch.bfloat16
    # compress from the float32 values (q * s is exact in float32), as a float32 model would hold them
    again = IntQuantizationCompressor.compress({**ours, "weight": qw.dequantize(torch.float32)}, scheme)
    assert set(again) == set(ours)
    for name, t in ours.items():
        assert again[name].dtype == t.dtype and torch.equal(again[name], t), name


def test_int8_grid_is_compressed_tensors_observer_and_quantizer():
    """Per-channel RTN int8 equals compressed-tensors' calculate_qparams (absmax / 127.5) and
    quantize (round, clamp to [-128, 127]) on a float32 weight with float32 scales; codes stay
    within half a step of the weight."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 96, generator=g) * torch.logspace(-3, 1, 32).reshape(-1, 1)
    w[4] = 0.0  # an all-zero row: eps scale, zero codes
    args = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
    scale, zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), args)
    theirs = quantize(w, scale, zp, args, dtype=torch.int8)
    ours = int8_rtn(w, W, torch.float32)
    assert ours.scale.shape == (32, 1)
    assert torch.equal(ours.scale[torch.arange(32) != 4], scale[torch.arange(32) != 4])
    assert torch.equal(ours.q, theirs) and not ours.q[4].any()
    rows = torch.arange(32) != 4
    assert ((ours.dequantize() - w).abs()[rows] <= ours.scale[rows] * (0.5 + 1e-5)).all()  # the clamped +127.5: 0.5
    # each row's absmax sits at 127.5 steps: +127.5 rounds to 128 and clamps to 127, -127.5 to -128
    assert set(ours.q[rows].int().abs().amax(1).tolist()) <= {127, 128}
    assert int8_scale(torch.zeros(1), torch.bfloat16) == torch.finfo(torch.bfloat16).eps


def test_config_group_is_compressed_tensors_int8_w8a8_preset():
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.quant_scheme import INT8_W8A8

    fields = ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size")

    def same(ours: dict, preset) -> bool:
        theirs = ct.QuantizationArgs.model_validate(ours)
        return all(getattr(theirs, f) == getattr(preset, f) for f in fields)

    dyn = quantization_config(W, ["Linear"], ["lm_head"], "int-quantized", DYNAMIC)
    g = dyn["config_groups"]["group_0"]
    assert dyn["format"] == g["format"] == "int-quantized" and dyn["quant_method"] == "compressed-tensors"
    assert same(g["weights"], INT8_W8A8["weights"]) and same(g["input_activations"], INT8_W8A8["input_activations"])
    parsed = ct.QuantizationConfig.model_validate(dyn)  # the whole quantization_config parses
    assert parsed.format == "int-quantized" and parsed.config_groups["group_0"].weights.strategy == "channel"
    st = quantization_config(W, ["Linear"], ["lm_head"], "int-quantized", STATIC)["config_groups"]["group_0"]
    acts = ct.QuantizationArgs.model_validate(st["input_activations"])
    assert (acts.strategy, acts.dynamic, acts.symmetric, acts.num_bits, acts.type) == ("tensor", False, True, 8, "int")
    assert st["input_activations"]["observer"] == "static_minmax" and same(st["weights"], INT8_W8A8["weights"])


def test_static_input_quantizer_rounds_half_to_even_and_saturates():
    x = torch.tensor([[0.05, 0.15, -0.25, 12.7, 12.8, -12.85, -13.0, 0.0]])
    q = quantize_static_int8(x, torch.tensor([0.1]))
    assert q.dtype == torch.int8
    assert q.tolist() == [[0, 2, -2, 127, 127, -128, -128, 0]]  # 0.5 -> 0, 1.5 -> 2, -2.5 -> -2


def test_arguments_int_quantized_cannot_hold_are_one_sentence():
    codec = get_codec("int-quantized")
    with pytest.raises(ValueError, match=r"^int8 W8A8 weight strategy 'group' \(group_size 64\) is not supported"):
        codec.check(QuantArgs(8, 64), DYNAMIC)
    with pytest.raises(ValueError, match="weight type int 4-bit is not supported here; allowed: int 8-bit"):
        codec.check(QuantArgs(4, None), DYNAMIC)
    with pytest.raises(ValueError, match="asymmetric int8 is not supported"):
        codec.check(QuantArgs(8, None, symmetric=False), DYNAMIC)
    with pytest.raises(ValueError, match="input_activations must be given"):
        codec.check(W, None)
    with pytest.raises(ValueError, match="strategy 'token' and dynamic False are not supported"):
        codec.check(W, QuantArgs(8, None, strategy="token"))
    with pytest.raises(ValueError, match="input activation type: asymmetric int8 is not supported"):
        codec.check(W, QuantArgs(8, None, strategy="tensor", symmetric=False))  # static inputs: symmetric only
    codec.check(W, DYNAMIC_ASYM)  # dynamic per-token inputs may have zero points (taken at run time)
    # llm-compressor's W8A8 GPTQ preset records actorder "weight" ("static"): GPTQ's column order
    # only, channel codes and scales as any other (its checkpoint failed to load here before)
    codec.check(QuantArgs(8, None, strategy="channel", actorder="static"), DYNAMIC)
    assert QuantArgs.from_compressed_tensors({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                "actorder": "weight", "dynamic": False}).actorder == "static"
    assert codec.vllm_incompatibility(W, DYNAMIC) is None and codec.vllm_incompatibility(W, STATIC) is None
    assert codec.vllm_incompatibility(W, DYNAMIC_ASYM) is None
    assert "per tensor" in codec.vllm_incompatibility(W, QuantArgs(8, None, strategy="channel"))
    with pytest.raises(ValueError, match="symmetric torch.int8 codes"):
        codec.encode(IntQuantizedWeight(torch.zeros(2, 8, dtype=torch.int8), torch.ones(2, 1), torch.zeros(2, 1), W))
