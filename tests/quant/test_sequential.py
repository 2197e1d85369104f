"""Sequential calibration's bookkeeping: where activations live, what each pass keeps."""

import copy

import pytest
import torch

from optllm.quant.config import OFFLOAD_AUTO_BYTES, QuantizeConfig
from optllm.quant.pipeline import activation_store
from optllm.quant.sequential import (
    advance_block,
    capture_block_inputs,
    capture_inputs,
    collect_inputs,
    decoder_layers,
    run_block,
)


@pytest.fixture
def block():
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", 320, layers=2), dtype=torch.float32)
    ids = torch.randint(0, 320, (6, 24), generator=torch.Generator().manual_seed(0))
    inputs = capture_block_inputs(model, ids, batch_size=4, device=torch.device("cpu"))
    return model, decoder_layers(model), inputs


def test_captured_inputs_are_what_block_0_sees(block):
    model, _, inputs = block
    assert [tuple(h.shape) for h in inputs.hidden] == [(4, 24, 64), (2, 24, 64)]
    assert inputs.num_tokens() == 144 and inputs.nbytes() == 144 * 64 * 4
    ids = torch.randint(0, 320, (6, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        emb = model.model.embed_tokens(ids)  # Llama feeds block 0 the embeddings
    assert torch.equal(torch.cat(inputs.hidden), emb)


def test_advance_block_replaces_inputs_and_consumes_the_reference(block):
    _, layers, inputs = block
    layer = layers[0]
    ref = run_block(layer, inputs)
    quantized = copy.deepcopy(layer)
    with torch.no_grad():
        quantized.mlp.down_proj.weight.mul_(1.05)  # a stand-in for quantization error
    expected = run_block(quantized, inputs)
    num = sum(float((e - r).pow(2).sum()) for e, r in zip(expected, ref))
    den = sum(float(r.pow(2).sum()) for r in ref)
    err = advance_block(quantized, inputs, ref)
    assert err == pytest.approx((num / den) ** 0.5, rel=1e-6) and err > 0
    assert all(torch.equal(h, e) for h, e in zip(inputs.hidden, expected))  # the next block's inputs
    assert ref == [None, None]  # each reference batch freed once used


def test_collect_inputs_stops_at_the_module(block):
    _, layers, inputs = block
    layer = layers[0]
    full = []
    with capture_inputs({"g": layer.mlp.gate_proj}, lambda _n, x: full.append(x)):
        run_block(layer, inputs, keep=False)
    calls = []
    handle = layer.mlp.down_proj.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        got = collect_inputs(layer, inputs, layer.mlp.gate_proj)
        one = collect_inputs(layer, inputs, layer.self_attn.q_proj, batches=[1])
    finally:
        handle.remove()
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, full))
    assert not calls  # the forward stopped at gate_proj: down_proj never ran
    assert len(one) == 1 and one[0].shape == (2, 24, 64)


def test_offload_policy():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    auto = QuantizeConfig()
    assert activation_store(auto, cpu, 10 * OFFLOAD_AUTO_BYTES) == cpu
    assert activation_store(auto, cuda, OFFLOAD_AUTO_BYTES - 1) == cuda
    assert activation_store(auto, cuda, OFFLOAD_AUTO_BYTES) == cpu
    assert activation_store(QuantizeConfig(offload="always"), cuda, 1) == cpu
    assert activation_store(QuantizeConfig(offload="never"), cuda, 10 * OFFLOAD_AUTO_BYTES) == cuda
