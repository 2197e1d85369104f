"""The block step's shared parts: the output error measured without a Hessian equals the
Hessian form, and quantize_in_place leaves the block holding the quantized weights."""

from __future__ import annotations

import torch

from optllm.formats.args import QuantArgs
from optllm.hub.architectures import LLAMA_LIKE
from optllm.quant.algorithm import BlockContext, output_errors, quantize_in_place
from optllm.quant.gptq import HessianAccumulator, relative_error
from optllm.quant.rtn import rtn_quantize
from optllm.quant.sequential import block_linears, capture_block_inputs, capture_inputs, decoder_layers, run_block

ARGS = QuantArgs(num_bits=3, group_size=32, symmetric=False)


def _block():
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", 320, layers=1), dtype=torch.float32)
    ids = torch.randint(0, 320, (6, 24), generator=torch.Generator().manual_seed(0))
    return decoder_layers(model)[0], capture_block_inputs(model, ids, batch_size=4, device=torch.device("cpu"))


def test_output_error_equals_the_hessian_form():
    """sqrt(Σ‖xΔWᵀ‖² / Σ‖xWᵀ‖²) against sqrt(tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)) with the unweighted
    Hessian of the same inputs: equal to float32 rounding (measured ~1e-7 relative)."""
    layer, inputs = _block()
    linears = block_linears(layer, LLAMA_LIKE)
    qws = {n: rtn_quantize(lin.weight.detach(), ARGS, scale_dtype=torch.float32) for n, lin in linears.items()}
    acc = {n: HessianAccumulator(lin.in_features) for n, lin in linears.items()}
    with capture_inputs(linears, lambda n, x: acc[n].add(x)):
        run_block(layer, inputs, keep=False)
    errs = output_errors(layer, inputs, {n: (lin, qws[n]) for n, lin in linears.items()})
    for n, lin in linears.items():
        ref = relative_error(lin.weight.detach(), qws[n].dequantize(torch.float32), acc[n].hessian)
        assert 0.01 < ref < 0.5 and abs(errs[n] - ref) < 1e-5 * ref, (n, errs[n], ref)


def test_quantize_in_place_measures_the_float_block_then_installs():
    layer, inputs = _block()
    linears = block_linears(layer, LLAMA_LIKE)
    want = {n: rtn_quantize(lin.weight.detach(), ARGS, scale_dtype=torch.bfloat16) for n, lin in linears.items()}
    expect = output_errors(layer, inputs, {n: (lin, want[n]) for n, lin in linears.items()})  # the float block
    ctx = BlockContext(layer, 0, linears, LLAMA_LIKE, inputs, ARGS, torch.bfloat16)
    res = quantize_in_place(ctx, lambda _n, w: rtn_quantize(w, ARGS, scale_dtype=torch.bfloat16))
    assert [n for n, _e in res.errors] == list(linears) == list(res.qweights)
    for n, lin in linears.items():
        qw = res.qweights[n]
        assert qw.q.device.type == "cpu" and torch.equal(qw.q, want[n].q) and torch.equal(qw.scale, want[n].scale)
        assert torch.equal(lin.weight, qw.dequantize(torch.float32))
        assert dict(res.errors)[n] == expect[n]
