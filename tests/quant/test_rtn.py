import pytest
import torch

from optllm.formats.args import QuantArgs
from optllm.formats.grid import expand_groups
from optllm.quant.rtn import rtn_quantize
from optllm.quant.scheme import parse_scheme


def test_rtn_symmetric_hand_computed():
    # absmax 1.5 -> scale = 1.5 / 7.5 = 0.2; codes = round(w / 0.2), clamped to [-8, 7]
    w = torch.tensor([[0.0, 0.3, -1.5, 1.5, 0.61, -0.19, 0.9, -0.41]])
    qw = rtn_quantize(w, QuantArgs(num_bits=4, group_size=8, symmetric=True), scale_dtype=torch.float32)
    assert qw.zero is None
    assert torch.allclose(qw.scale, torch.tensor([[0.2]]))
    assert qw.q.tolist() == [[0, 2, -8, 7, 3, -1, 4, -2]]  # 0.3/0.2 = 1.5 -> 2 (half to even)
    assert torch.allclose(qw.dequantize(), torch.tensor([[0.0, 0.4, -1.6, 1.4, 0.6, -0.2, 0.8, -0.4]]))


def test_rtn_asymmetric_hand_computed():
    # min -0.5, max 1.0 -> scale = 1.5 / 15 = 0.1, zero = round(-8 + 5) = -3
    w = torch.tensor([[-0.5, 1.0, 0.22, 0.0, 0.47, -0.33, 0.81, 0.08]])
    qw = rtn_quantize(w, QuantArgs(num_bits=4, group_size=8, symmetric=False), scale_dtype=torch.float32)
    assert torch.allclose(qw.scale, torch.tensor([[0.1]]))
    assert qw.zero.tolist() == [[-3]]
    assert qw.q.tolist() == [[-8, 7, -1, -3, 2, -6, 5, -2]]
    deq = qw.dequantize()
    assert torch.allclose(deq, torch.tensor([[-0.5, 1.0, 0.2, 0.0, 0.5, -0.3, 0.8, 0.1]]), atol=1e-6)


@pytest.mark.parametrize("bits", (3, 4, 8))
@pytest.mark.parametrize("group", (32, 64, None))
@pytest.mark.parametrize("sym", (True, False))
def test_rtn_error_bound(bits, group, sym):
    torch.manual_seed(bits + (group or 0))
    w = torch.randn(48, 128)
    args = QuantArgs(num_bits=bits, group_size=group, symmetric=sym)
    qw = rtn_quantize(w, args, scale_dtype=torch.float32)
    assert qw.q.min() >= args.qmin and qw.q.max() <= args.qmax
    # within a group every weight lies within half a step of the grid, except the one
    # positive extreme that the symmetric grid clips (at most one step away)
    step = expand_groups(qw.scale, 128)
    err = (qw.dequantize() - w).abs()
    assert bool((err <= step * (1.0 if sym else 0.5) + 1e-6).all())


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="does not divide in_features=100"):
        rtn_quantize(torch.randn(4, 100), QuantArgs(group_size=64))


def test_scheme_parsing():
    s = parse_scheme("W4A16-AWQ", group_size=64)
    assert (s.algorithm, s.weights.num_bits, s.weights.group_size) == ("awq", 4, 64)
    with pytest.raises(ValueError, match="unknown scheme 'w5a16-rtn'"):
        parse_scheme("w5a16-rtn")
    with pytest.raises(ValueError, match="unknown scheme"):
        parse_scheme("fp7")
    with pytest.raises(ValueError, match="group_size"):
        QuantArgs(group_size=12)
