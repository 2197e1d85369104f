"""SmoothQuant: the factors against a hand computation, the smoothed float model computes the
same logits, smoothing flattens the activations' channel ranges and lowers the W8A8 block error
on inputs with outlier channels, the α search keeps the block as it was and picks its best
candidate, and bad options are one error naming the field."""

from __future__ import annotations

import pytest
import torch

from optllm.errors import UserError
from optllm.formats.args import QuantArgs
from optllm.hub.architectures import architecture_of
from optllm.quant.algorithm import BlockContext
from optllm.quant.config import QuantizeConfig
from optllm.quant.sequential import block_linears, capture_block_inputs, decoder_layers, run_block
from optllm.quant.smoothquant import (
    MIN_SCALE,
    SmoothQuantOptions,
    block_mappings,
    channel_absmax,
    fake_quantize_input,
    quantized_block_error,
    search_alpha,
    smooth_block,
    smoothing_factors,
    static_input_scales,
    weight_absmax,
)

W8 = QuantArgs(8, None, strategy="channel")


@pytest.fixture
def model_and_inputs(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    return model, ids


def _ctx(model, ids, index=0) -> BlockContext:
    arch = architecture_of(model.config)
    layer = decoder_layers(model)[index]
    inputs = capture_block_inputs(model, ids, 2, torch.device("cpu"))
    return BlockContext(layer, index, block_linears(layer, arch.block), arch.block, inputs, W8, torch.bfloat16)


def test_factors_are_the_papers_formula_by_hand():
    x = torch.tensor([4.0, 0.25, 9.0, 0.0, 1e-12])
    w = torch.tensor([1.0, 0.5, 0.01, 2.0, 3.0])
    s = smoothing_factors(x, w, 0.5)
    # s_j = sqrt(max|X_j|) / sqrt(max|W_j|); a channel with no activation keeps 1; the floor is 1e-5
    assert torch.allclose(s[:3], torch.tensor([2.0, (0.25 / 0.5) ** 0.5, 30.0]))
    assert s[3] == 1.0 and s[4] == MIN_SCALE
    assert torch.allclose(smoothing_factors(x, w, 0.75)[:3], torch.tensor([4 ** 0.75, 0.25 ** 0.75 / 0.5 ** 0.25,
                                                                            9 ** 0.75 / 0.01 ** 0.25]))
    assert torch.equal(smoothing_factors(x, torch.zeros(5), 0.5), torch.ones(5))  # no weight: nothing to migrate


def test_statistics_are_the_per_channel_maxima_by_hand(model_and_inputs):
    model, ids = model_and_inputs
    ctx = _ctx(model, ids)
    pairs = block_mappings(ctx.mapping, fold_down_proj=True, quantized=list(ctx.linears))
    assert [m.smooth for m in pairs] == ["input_layernorm", "post_attention_layernorm", "mlp.up_proj"]
    amax = channel_absmax(ctx.layer, ctx.inputs, pairs)
    # by hand: input_layernorm's output on every token is q_proj's input
    norm = ctx.layer.input_layernorm
    with torch.no_grad():
        by_hand = torch.stack([norm(h).abs().reshape(-1, h.shape[-1]).amax(0) for h in ctx.inputs.hidden]).amax(0)
    assert torch.equal(amax["input_layernorm"], by_hand)
    w = torch.cat([ctx.layer.get_submodule(n).weight for n in pairs[0].balance]).abs().amax(0)
    assert torch.equal(weight_absmax(ctx.layer, pairs[0]), w)
    assert amax["mlp.up_proj"].shape == (ctx.layer.mlp.down_proj.in_features,)
    # ignored linears: a pair whose balance layers are all left out is not smoothed
    assert [m.smooth for m in block_mappings(ctx.mapping, False, ["self_attn.q_proj"])] == ["input_layernorm"]


def test_smoothed_float_model_gives_the_same_logits(model_and_inputs):
    model, ids = model_and_inputs
    with torch.no_grad():
        before = model(ids).logits
    arch = architecture_of(model.config)
    inputs = capture_block_inputs(model, ids, 2, torch.device("cpu"))
    norm_before = model.model.layers[1].post_attention_layernorm.weight.clone()
    for layer in decoder_layers(model):
        pairs = block_mappings(arch.block, True, arch.block.linears)
        scales = smooth_block(layer, inputs, pairs, 0.5)
        assert all((s != 1).any() for s in scales.values())  # it did change the parametrisation
        inputs.hidden = run_block(layer, inputs)  # the next block's inputs
    assert not torch.allclose(model.model.layers[1].post_attention_layernorm.weight, norm_before)
    with torch.no_grad():
        after = model(ids).logits
    # float32 rounding of the rescaled products only: measured 2e-6 on logits of magnitude ~1
    assert (after - before).abs().max() < 1e-4, float((after - before).abs().max())


def test_fold_o_proj_under_gqa_shares_a_factor_per_value_channel(model_and_inputs):
    """fold_o_proj smooths o_proj's input into v_proj's output rows; the tiny Llama has 4 query heads
    over 2 value heads, so each v_proj channel feeds two o_proj inputs, which get one shared factor
    (from the larger maximum of the two): the float model computes the same logits."""
    model, ids = model_and_inputs
    arch = architecture_of(model.config)
    pairs = block_mappings(arch.block, False, arch.block.linears, fold_o_proj=True)
    assert [m.smooth for m in pairs] == ["input_layernorm", "post_attention_layernorm", "self_attn.v_proj"]
    with torch.no_grad():
        before = model(ids).logits
    inputs = capture_block_inputs(model, ids, 2, torch.device("cpu"))
    layer0 = decoder_layers(model)[0]
    attn = layer0.self_attn
    hd, n_rep = attn.head_dim, attn.num_key_value_groups
    assert n_rep == 2
    amax = channel_absmax(layer0, inputs, pairs)
    x, w = amax["self_attn.v_proj"], weight_absmax(layer0, pairs[2])
    scales = smooth_block(layer0, inputs, pairs, 0.5, amax)
    s = scales["self_attn.v_proj"]
    assert s.shape == (attn.o_proj.in_features,)
    heads = s.reshape(-1, hd)  # [query heads, head_dim]
    for h in range(heads.shape[0]):  # the heads of one value group share their factors
        assert torch.equal(heads[h], heads[(h // n_rep) * n_rep])
        group = [(h // n_rep) * n_rep + r for r in range(n_rep)]
        xg = x.reshape(-1, hd)[group].amax(0)
        wg = w.reshape(-1, hd)[group].amax(0)
        assert torch.allclose(heads[h], smoothing_factors(xg, wg, 0.5))
    layers = list(decoder_layers(model))
    for prev, layer in zip(layers, layers[1:]):
        inputs.hidden = run_block(prev, inputs)  # this layer's inputs
        smooth_block(layer, inputs, pairs, 0.5)
    with torch.no_grad():
        after = model(ids).logits
    assert (after - before).abs().max() < 1e-4, float((after - before).abs().max())


def test_smoothing_flattens_outlier_channels_and_lowers_the_w8a8_error(model_and_inputs):
    """Give a few channels of the norm outputs 60x the others (the outliers SmoothQuant is for):
    per-token int8 then wastes its grid; smoothing (α 0.5) brings the block's quantized output
    error down by a wide margin and the channel ranges closer together."""
    model, ids = model_and_inputs
    with torch.no_grad():
        for layer in decoder_layers(model):
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[[3, 17, 40]] *= 60.0
    ctx = _ctx(model, ids)
    ref = run_block(ctx.layer, ctx.inputs)
    original = {k: v.clone() for k, v in ctx.layer.state_dict().items()}
    plain = quantized_block_error(ctx, False, ref)
    ctx.layer.load_state_dict(original)
    pairs = block_mappings(ctx.mapping, False, list(ctx.linears))
    amax = channel_absmax(ctx.layer, ctx.inputs, pairs)
    w = weight_absmax(ctx.layer, pairs[0])
    scales = smooth_block(ctx.layer, ctx.inputs, pairs, 0.5, amax)
    smoothed = quantized_block_error(ctx, False, ref)
    x = amax["input_layernorm"]
    spread = float(x.max() / x.min())
    flat = x / scales["input_layernorm"]  # = sqrt(max|X_j| max|W_j|) at α 0.5
    assert torch.allclose(flat, (x * w).sqrt(), rtol=1e-5)
    assert float(flat.max() / flat.min()) < spread / 5  # measured: 115 -> 12
    assert smoothed < 0.6 * plain, (smoothed, plain)  # measured: 0.0098 vs 0.0275


def test_alpha_search_picks_its_best_candidate_and_leaves_the_block(model_and_inputs):
    model, ids = model_and_inputs
    ctx = _ctx(model, ids, index=1)
    before = {k: v.clone() for k, v in ctx.layer.state_dict().items()}
    opts = SmoothQuantOptions(alpha="search", alpha_grid=4)
    pairs = block_mappings(ctx.mapping, False, list(ctx.linears))
    alpha, errors = search_alpha(ctx, pairs, channel_absmax(ctx.layer, ctx.inputs, pairs), opts, static_input=True)
    assert list(errors) == ["none", "0", "0.25", "0.5", "0.75", "1"]
    best = min(errors, key=errors.get)
    assert (alpha is None and best == "none") or f"{alpha:g}" == best
    assert len(set(errors.values())) > 1  # the candidates differ
    after = ctx.layer.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_static_scales_and_fake_quantized_inputs_by_hand(model_and_inputs):
    model, ids = model_and_inputs
    ctx = _ctx(model, ids)
    scales = static_input_scales(ctx)
    norm = ctx.layer.input_layernorm
    with torch.no_grad():
        amax = max(float(norm(h).abs().max()) for h in ctx.inputs.hidden)
    assert scales["self_attn.q_proj"].dtype == torch.bfloat16
    assert torch.equal(scales["self_attn.q_proj"], torch.tensor([amax / 127.5]).to(torch.bfloat16))
    assert torch.equal(scales["self_attn.q_proj"], scales["self_attn.v_proj"])  # one shared input
    x = torch.tensor([[1.5, -0.5, 0.26, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # per token: scale = 1.5 / 127, codes round(x / scale) = 127, -42 (-42.3), 22 (22.01), 0
    assert torch.allclose(fake_quantize_input(x, None)[0], torch.tensor([127.0, -42.0, 22.0, 0.0]) * 1.5 / 127)
    assert torch.equal(fake_quantize_input(x, None)[1], torch.zeros(4))
    # static: codes round(x / 0.01) clamped to [-128, 127]
    assert torch.allclose(fake_quantize_input(x, torch.tensor([0.01]))[0], torch.tensor([1.27, -0.5, 0.26, 0.0]))


@pytest.mark.parametrize("field, value, message", [
    ("alpha", 1.5, "smoothquant.alpha=1.5 is not allowed; allowed: a number in [0, 1] or 'search'"),
    ("alpha", "best", "smoothquant.alpha='best' is not allowed"),
    ("weights", "awq", "smoothquant.weights='awq' is not allowed; allowed: rtn, gptq"),
    ("alpha_grid", 0, "smoothquant.alpha_grid=0 must be an integer >= 1"),
])
def test_bad_options_are_one_error_naming_the_field(field, value, message):
    with pytest.raises(UserError, match="^smoothquant options: " + message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        QuantizeConfig.from_dict({"scheme": "w8a8-int8", "smoothquant": {field: value}})
    with pytest.raises(UserError, match="unexpected keyword argument 'beta'"):
        QuantizeConfig.from_dict({"scheme": "w8a8-int8", "smoothquant": {"beta": 1}})
