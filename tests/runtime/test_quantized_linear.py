import os

import pytest
import torch

from optllm.quant.load import load_quantized
from optllm.quant.rtn import rtn_quantize
from optllm.quant.scheme import QuantArgs
from optllm.runtime.layers.quantized_linear import QuantizedLinear


@pytest.mark.parametrize("sym", (True, False))
@pytest.mark.parametrize("group", (32, 64))
def test_quantized_linear_matches_dequantized_linear(sym, group):
    torch.manual_seed(group + sym)
    w = torch.randn(48, 128)
    qw = rtn_quantize(w, QuantArgs(num_bits=4, group_size=group, symmetric=sym), scale_dtype=torch.float32)
    bias = torch.randn(48)
    mod = QuantizedLinear.from_quantized(qw, bias=bias, dtype=torch.float32, backend="torch")
    x = torch.randn(5, 7, 128)
    ref = x @ qw.dequantize(torch.float32).T + bias
    err = (mod(x) - ref).norm() / ref.norm()
    assert err < 1e-6


def test_kernel_mode_checkpoint_gives_same_logits(tiny_llama, tmp_path):
    from optllm.quant.config import QuantizeConfig
    from optllm.quant.pipeline import quantize

    quantize(str(tiny_llama), tmp_path / "q", QuantizeConfig(group_size=32, num_samples=4, seq_len=32), progress=False)
    dq, tok, qweights = load_quantized(tmp_path / "q", dtype="float32")
    # the reference: (q - zero) * scale formed in float32 (the checkpoint's own dequantization
    # rounds that product to bf16, a 1e-3-level difference that is not the kernel's)
    for name, qw in qweights.items():
        q = qw.q.float() - (0 if qw.zero is None else qw.zero.float().repeat_interleave(32, 1))
        dq.get_submodule(name).weight.data = q * qw.scale.float().repeat_interleave(32, 1)
    kq, _, _ = load_quantized(tmp_path / "q", dtype="float32", linear="kernel")
    assert isinstance(kq.model.layers[0].mlp.down_proj, QuantizedLinear)
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        a, b = dq(ids).logits, kq(ids).logits
    assert float((a - b).norm() / a.norm()) < 1e-5
