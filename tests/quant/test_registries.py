"""Schemes, algorithms and formats are registries: unknown names are one error listing the
registered ones; a scheme, an algorithm and a format registered here (not in optllm) run end to
end through the pipeline and the runtime; statistics a step does not ask for are not built."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from optllm.errors import UserError
from optllm.formats.args import CHANNEL, QuantArgs
from optllm.formats.codec import CODECS, FormatCodec, register_codec
from optllm.formats.compressed_tensors import load_quantized_weights
from optllm.formats.qweight import QuantizedWeight
from optllm.quant import gptq
from optllm.quant.algorithm import ALGORITHMS, Algorithm, get_algorithm, quantize_in_place, register_algorithm
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import quantize
from optllm.quant.rtn import rtn_quantize
from optllm.quant.scheme import SCHEMES, QuantScheme, available_schemes, register_scheme

SMALL = dict(num_samples=4, seq_len=32, batch_size=4)


def test_unknown_names_are_one_error_listing_the_registered_ones():
    with pytest.raises(UserError, match="^unknown scheme 'w4a16-magic'; allowed: " + ", ".join(available_schemes())):
        QuantizeConfig(scheme="w4a16-magic")
    assert available_schemes()[:9] == [f"w{b}a16-{a}" for b in (4, 3, 8) for a in ("rtn", "awq", "gptq")]
    assert {"fp8", "fp8-dynamic"} <= set(available_schemes())
    with pytest.raises(UserError, match="^unknown algorithm 'sparsegpt'; allowed: ") as err:
        get_algorithm("sparsegpt")
    assert {"awq", "gptq", "rtn", "fp8"} <= set(str(err.value).split("allowed: ")[1].split(", "))
    register_scheme(QuantScheme("w4a16-orphan", "sparsegpt", QuantArgs(4, 32)))
    try:
        with pytest.raises(UserError, match="^unknown algorithm 'sparsegpt'; allowed: "):
            QuantizeConfig(scheme="w4a16-orphan")
    finally:
        SCHEMES.unregister("w4a16-orphan")


# --- a scheme, an algorithm and a format of the test's own ------------------------------------

class CodesCodec(FormatCodec):
    """Unpacked int8 codes: a format whose tensors are not pack-quantized's."""

    name = "test-int8-codes"
    tensor_names = ("weight_codes", "weight_scale", "weight_zero")

    def required(self, weights):
        return {"weight_codes", "weight_scale"} | (set() if weights.symmetric else {"weight_zero"})

    def encode(self, qw):
        parts = {"weight_codes": qw.q, "weight_scale": qw.scale}
        return parts if qw.zero is None else {**parts, "weight_zero": qw.zero}

    def decode(self, parts, weights):
        return QuantizedWeight(parts["weight_codes"], parts["weight_scale"], parts.get("weight_zero"), weights)


@dataclass(frozen=True)
class ShrinkOptions:
    ratio: float = 0.9


SHRINK_BLOCKS: list[int] = []


def shrink_step(ctx, opts: ShrinkOptions):
    """RTN with every group's range shrunk by opts.ratio."""
    SHRINK_BLOCKS.append(ctx.index)
    return quantize_in_place(ctx, lambda _n, w: rtn_quantize(w, ctx.weights, clip_ratio=opts.ratio,
                                                               scale_dtype=ctx.scale_dtype))


@pytest.fixture
def own_registrations():
    register_codec(CodesCodec())
    register_algorithm(Algorithm("test-shrink", shrink_step, options=lambda cfg: ShrinkOptions()))
    register_scheme(QuantScheme("w4a16-test", "test-shrink", QuantArgs(4, 32), format="test-int8-codes"))
    register_scheme(QuantScheme("w4a16-test-packed", "test-shrink", QuantArgs(4, 32)))
    SHRINK_BLOCKS.clear()
    try:
        yield
    finally:
        SCHEMES.unregister("w4a16-test")
        SCHEMES.unregister("w4a16-test-packed")
        ALGORITHMS.unregister("test-shrink")
        CODECS.unregister("test-int8-codes")


def test_a_scheme_algorithm_and_format_registered_elsewhere_run_end_to_end(own_registrations, tiny_models, tmp_path):
    """The test's scheme quantizes through its own step and is written by its own codec; the
    formats reader and the runtime read it back through that codec: the codes are RTN's with
    shrunk ranges, bit for bit, and the runtime's log-probs equal those of the same codes
    written as pack-quantized."""
    from optllm import LLM, SamplingParams

    assert "w4a16-test" in available_schemes()
    model = tiny_models["qwen2"]  # untied LM head, biases
    ours, packed = tmp_path / "ours", tmp_path / "packed"
    report = quantize(str(model), ours, QuantizeConfig(scheme="w4a16-test", **SMALL), progress=False)
    assert SHRINK_BLOCKS == [0, 1] and report.scheme == "w4a16-test" and len(report.layers) == 14
    quantize(str(model), packed, QuantizeConfig(scheme="w4a16-test-packed", **SMALL), progress=False)

    qc = json.loads((ours / "config.json").read_text())["quantization_config"]
    assert qc["format"] == qc["config_groups"]["group_0"]["format"] == "test-int8-codes"
    keys = load_file(ours / "model.safetensors").keys()
    assert sum(k.endswith(".weight_codes") for k in keys) == 14 and not any("weight_packed" in k for k in keys)
    report_file = json.loads((ours / "optllm-report.json").read_text())
    assert report_file["vllm_loadable"] is False and "test-int8-codes" in report_file["vllm_note"]

    original = load_file(model / "model.safetensors")
    qweights, _, _ = load_quantized_weights(ours)
    assert len(qweights) == 14
    for name, qw in qweights.items():
        want = rtn_quantize(original[f"{name}.weight"], QuantArgs(4, 32), clip_ratio=0.9, scale_dtype=torch.bfloat16)
        assert torch.equal(qw.q, want.q) and torch.equal(qw.scale, want.scale), name

    prompt = [5, 17, 250, 3, 99, 42, 7, 11, 12, 13]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    lps = [LLM(f, device="cpu", quantized_linear="dequant").generate([prompt], params)[0].prompt_logprobs
           for f in (ours, packed)]
    assert lps[0] == lps[1] and len(lps[0]) == len(prompt)


# --- statistics only for the step that asks ----------------------------------------------------

@pytest.mark.parametrize("scheme, built", [("w4a16-rtn", 0), ("w4a16-awq", 0), ("w4a16-gptq", 14)])
def test_only_gptq_builds_hessians(scheme, built, tiny_llama, tmp_path, monkeypatch):
    """RTN's and AWQ's calibration never constructs a K x K Hessian accumulator; GPTQ builds
    one per linear (2 blocks x 7)."""
    made = []
    init = gptq.HessianAccumulator.__init__

    def counting(self, *a, **k):  # on the class itself: every construction counts, wherever it is named
        made.append(a[0] if a else k["in_features"])
        init(self, *a, **k)

    monkeypatch.setattr(gptq.HessianAccumulator, "__init__", counting)
    rep = quantize(str(tiny_llama), tmp_path / "q", QuantizeConfig(scheme=scheme, group_size=32, **SMALL),
                   progress=False)
    assert len(made) == built and len(rep.layers) == 14 and all(0 < s.rel_error < 0.2 for s in rep.layers)


# --- per-channel is "channel", None is "not given" ---------------------------------------------

def test_group_size_none_is_the_schemes_and_channel_is_per_channel(tmp_path):
    assert QuantizeConfig().group_size == 128  # the scheme's own, stated in the config (and its report)
    cfg = QuantizeConfig(scheme="w4a16-gptq", group_size="Channel")
    w = cfg.quant_scheme().weights
    assert cfg.group_size == CHANNEL and (w.strategy, w.group_size) == ("channel", None)
    assert QuantizeConfig.from_dict(cfg.to_dict()) == cfg
    recipe = tmp_path / "r.yaml"
    recipe.write_text("scheme: w4a16-awq\ngroup_size: 64\n")
    assert QuantizeConfig.from_recipe(recipe, group_size=CHANNEL).group_size == CHANNEL
    assert QuantizeConfig.from_recipe(recipe, group_size=None).group_size == 64  # None: not given
    recipe.write_text("group_size: channel\n")
    assert QuantizeConfig.from_recipe(recipe).quant_scheme().weights.strategy == "channel"
    recipe.write_text("group_size: null\n")
    with pytest.raises(UserError, match="group_size: null is ambiguous; write 'channel'"):
        QuantizeConfig.from_recipe(recipe)
    with pytest.raises(UserError, match="group_size='sixty' is not allowed"):
        QuantizeConfig(group_size="sixty")


def test_each_algorithms_options_are_its_own():
    cfg = QuantizeConfig(scheme="w4a16-gptq", dampening=0.05, gptq_block_size=64, token_cap=None)
    opts = get_algorithm("gptq").options(cfg)
    assert opts == gptq.GPTQOptions(dampening=0.05, block_size=64, token_cap=None)
    assert get_algorithm("awq").options(cfg) is cfg.awq and get_algorithm("rtn").options(cfg) is None
    assert get_algorithm("gptq").actorders[0] == "static" and get_algorithm("awq").actorders == (None,)
    with pytest.raises(ValueError, match="dampening=0 must be in"):
        gptq.GPTQOptions(dampening=0)
