"""Format codecs: the registry, pack-quantized's tensors bit for bit, the on-disk form of the
quantization arguments, and one clear error for a format or arguments no codec holds."""

from __future__ import annotations

import json

import pytest
import torch

from optllm.errors import UserError
from optllm.formats.args import CHANNEL, QuantArgs
from optllm.formats.codec import CODECS, get_codec
from optllm.formats.compressed_tensors import quantization_config, read_quantization
from optllm.formats.packing import pack_int32
from optllm.formats.qweight import QuantizedWeight


def _qweight(args: QuantArgs, n=16, k=64, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(args.qmin, args.qmax + 1, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, args.groups(k), generator=g).to(torch.bfloat16)
    zero = None if args.symmetric else torch.randint(args.qmin, args.qmax + 1, scale.shape, generator=g,
                                                     dtype=torch.int8)
    return QuantizedWeight(q, scale, zero, args)


def test_unknown_format_is_one_error_listing_the_registered_ones():
    assert "pack-quantized" in CODECS.names()
    with pytest.raises(UserError, match=r"^unknown checkpoint format 'marlin-24'; allowed: .*pack-quantized"):
        get_codec("marlin-24")
    cfg = {"quantization_config": {**quantization_config(QuantArgs(4, 32), ["Linear"], []), "format": "marlin-24"}}
    with pytest.raises(UserError, match="unknown checkpoint format 'marlin-24'"):
        read_quantization(cfg)


@pytest.mark.parametrize("args", [QuantArgs(4, 32, True), QuantArgs(3, 32, False), QuantArgs(8, None, False),
                                  QuantArgs(2, None, True, "static")], ids=["w4-g32", "w3-asym", "w8-chan", "w2-chan"])
def test_pack_quantized_tensors_are_the_packed_codes_and_read_back_exactly(args):
    codec = get_codec("pack-quantized")
    qw = _qweight(args)
    parts = codec.encode(qw)
    assert set(parts) == codec.required(args) and codec.required(args) <= set(codec.tensor_names)
    assert torch.equal(parts["weight_packed"], pack_int32(qw.q, args.num_bits, dim=1))
    assert parts["weight_shape"].tolist() == [16, 64] and parts["weight_scale"] is not None
    back = codec.decode(parts, args)
    assert torch.equal(back.q, qw.q) and torch.equal(back.scale, qw.scale)
    assert (back.zero is None) == args.symmetric and (args.symmetric or torch.equal(back.zero, qw.zero))
    if not args.symmetric:
        with pytest.raises(ValueError, match="lacks weight_zero_point"):
            codec.decode({k: v for k, v in parts.items() if k != "weight_zero_point"}, args)


def test_per_channel_is_written_as_compressed_tensors_writes_it():
    """One scale per output channel: strategy "channel", group_size null, as before CHANNEL
    existed; read back as group_size None."""
    args = QuantArgs(num_bits=4, group_size=None, symmetric=False)
    assert args.strategy == CHANNEL and args.groups(576) == 1
    w = quantization_config(args, ["Linear"], ["lm_head"])["config_groups"]["group_0"]["weights"]
    assert (w["strategy"], w["group_size"], w["type"], w["dynamic"], w["observer"]) == ("channel", None, "int",
                                                                                       False, "minmax")
    assert QuantArgs.from_compressed_tensors(json.loads(json.dumps(w))) == args
    group = quantization_config(QuantArgs(4, 64), ["Linear"], [])["config_groups"]["group_0"]["weights"]
    assert (group["strategy"], group["group_size"]) == ("group", 64)


def test_arguments_a_format_cannot_hold_are_refused():
    codec = get_codec("pack-quantized")
    fp8 = QuantArgs(num_bits=8, group_size=None, type="float", strategy="tensor")
    with pytest.raises(ValueError, match="weight type 'float' is not supported here"):
        codec.check(fp8)
    with pytest.raises(ValueError, match="weight-only"):
        codec.check(QuantArgs(4, 32), QuantArgs(8, None, strategy="token", dynamic=True))
    with pytest.raises(ValueError, match="weight type 'float'"):
        quantization_config(fp8, ["Linear"], [])
    cfg = {"quantization_config": quantization_config(QuantArgs(4, 32), ["Linear"], [])}
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"] = fp8.to_compressed_tensors()
    with pytest.raises(UserError, match="^unsupported weight quantization in config.json: weight type 'float'"):
        read_quantization(cfg)


def test_quant_args_say_strategy_and_group_size_consistently():
    assert QuantArgs(4, 64).strategy == "group" and QuantArgs(4, None).strategy == "channel"
    act = QuantArgs(8, None, strategy="token", dynamic=True)
    assert QuantArgs.from_compressed_tensors(act.to_compressed_tensors()) == act
    with pytest.raises(ValueError, match="needs strategy 'group'"):
        QuantArgs(4, 64, strategy="channel")
    with pytest.raises(ValueError, match="group_size=None is not supported"):
        QuantArgs(4, None, strategy="group")
    with pytest.raises(ValueError, match="no integer grid"):
        QuantArgs(8, None, type="float", strategy="tensor").qmax
