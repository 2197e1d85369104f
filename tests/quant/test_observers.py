import pytest
import torch

from optllm.formats.args import QuantArgs
from optllm.quant import observers
from optllm.quant.rtn import rtn_quantize


@pytest.mark.parametrize("scale_dtype", (None, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("args", (QuantArgs(4, 32, True), QuantArgs(4, 64, False), QuantArgs(3, None, False),
                                  QuantArgs(8, 32, True)))
@pytest.mark.parametrize("clip", (None, 0.8, "per-group"))
def test_fake_quantize_is_the_checkpoint_weight_bit_for_bit(args, scale_dtype, clip):
    """What the AWQ searches score is exactly what the checkpoint will hold: RTN's codes on
    the grid with scales rounded to the checkpoint dtype, dequantized in that dtype."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * torch.exp(torch.randn(128, generator=g))
    if clip == "per-group":
        clip = 0.5 + 0.5 * torch.rand(48, args.groups(128), generator=g)
    fq = observers.fake_quantize(w, args, clip_ratio=clip, scale_dtype=scale_dtype)
    ref = rtn_quantize(w, args, clip_ratio=clip, scale_dtype=scale_dtype or torch.float32).dequantize(torch.float32)
    assert fq.dtype == torch.float32 and torch.equal(fq, ref)
    if scale_dtype is not None:  # and rounding the scale does change the values
        assert not torch.equal(fq, observers.fake_quantize(w, args, clip_ratio=clip))


def test_fake_quantize_leaves_its_input_alone():
    w = torch.randn(8, 64)
    w0 = w.clone()
    observers.fake_quantize(w, QuantArgs(4, 32, False))
    assert torch.equal(w, w0)
