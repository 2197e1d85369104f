import copy

import pytest
import torch

from optllm.formats.args import QuantArgs
from optllm.quant import observers
from optllm.quant.awq import AWQOptions, awq_block, search_clip
from optllm.quant.mappings import LLAMA_LIKE, block_linears
from optllm.quant.rtn import rtn_quantize
from optllm.quant.sequential import capture_block_inputs, decoder_layers, run_block

ARGS = QuantArgs(num_bits=4, group_size=32, symmetric=True)


def _tiny(hidden=128, seed=0):
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", 320, hidden=hidden, layers=1), dtype=torch.float32)
    layer = decoder_layers(model)[0]
    with torch.no_grad():
        # LLM-like activation outliers: a few channels of each norm carry large gains
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.copy_(1.0 + 0.1 * torch.randn(hidden))
            norm.weight[torch.randperm(hidden)[:4]] *= 12.0
    ids = torch.randint(0, 320, (8, 64), generator=torch.Generator().manual_seed(seed))
    inputs = capture_block_inputs(model, ids, batch_size=4, device=torch.device("cpu"))
    return model, layer, inputs


def _quantized_block_error(layer, inputs, ref, clip=None):
    for name, lin in block_linears(layer, LLAMA_LIKE).items():
        qw = rtn_quantize(lin.weight.detach(), ARGS, clip_ratio=None if clip is None else clip.get(name),
                          scale_dtype=torch.float32)
        lin.weight.data = qw.dequantize(torch.float32)
    out = run_block(layer, inputs)
    num = sum((o - r).pow(2).sum() for o, r in zip(out, ref))
    den = sum(r.pow(2).sum() for r in ref)
    return float((num / den).sqrt())


@pytest.mark.parametrize("seed", (0, 1))
def test_awq_lowers_block_output_error_vs_rtn(seed):
    _, layer, inputs = _tiny(seed=seed)
    ref = run_block(layer, inputs)
    rtn_layer = copy.deepcopy(layer)
    rtn_err = _quantized_block_error(rtn_layer, inputs, ref)

    awq_layer = copy.deepcopy(layer)
    res = awq_block(awq_layer, LLAMA_LIKE, inputs, ARGS, AWQOptions(n_grid=10, clip_grid=10))
    # folding scales leaves the float block unchanged
    unq = run_block(awq_layer, inputs)
    assert max(float((a - b).abs().max()) for a, b in zip(unq, ref)) < 1e-3
    awq_err = _quantized_block_error(awq_layer, inputs, ref, res.clip_ratio)
    print(f"block output rel. error: RTN {rtn_err:.4f}  AWQ {awq_err:.4f}  ratios {res.ratios}")
    assert awq_err < 0.9 * rtn_err
    # only scale-compatible mappings were searched (v_proj -> o_proj differs in shape under GQA)
    assert set(res.ratios) == {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"}


def test_clip_search_never_worse_than_no_clip():
    torch.manual_seed(3)
    w = torch.randn(32, 128)
    w[:, 5] *= 8  # an outlier weight column makes clipping worthwhile
    x = torch.randn(256, 128)
    ratio = search_clip(w, x, ARGS, AWQOptions())
    assert ratio.shape == (32, 4) and float(ratio.min()) >= 0.5 and float(ratio.max()) <= 1.0

    def err(r):
        q = observers.fake_quantize(w, ARGS, clip_ratio=r)
        return float((x @ (q - w).T).pow(2).mean())

    assert err(ratio) <= err(None) + 1e-9
