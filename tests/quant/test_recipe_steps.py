"""Recipes with steps (quant/recipe.py): what each composition compiles to, one line per
mistake (unknown step, bad order, unknown field, a field given twice), flat recipes as before,
and the checkpoint's copy of its configuration (recipe.yaml, and the recipe's text in the
report) read back to the same config."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from optllm.errors import UserError
from optllm.formats.compressed_tensors import read_quantization
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import RECIPE_NAME, quantize


def recipe(tmp_path, text: str, name: str = "r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_flat_recipes_read_as_before(tmp_path):
    p = recipe(tmp_path, "scheme: w4a16-gptq\ngroup_size: 64\ndampening: 0.02\nawq: {n_grid: 5}\n")
    assert QuantizeConfig.from_recipe(p) == QuantizeConfig(
        scheme="w4a16-gptq", group_size=64, dampening=0.02, awq=QuantizeConfig().awq.__class__(n_grid=5)
    )


def test_smoothquant_then_gptq_is_w8a8_int8_with_gptq_weights(tmp_path):
    p = recipe(
        tmp_path, "num_samples: 4\nsteps:\n  - smoothquant: {alpha: 0.7}\n  - gptq: {dampening: 0.05, block_size: 64}\n"
    )
    c = QuantizeConfig.from_recipe(p)
    assert c.scheme == "w8a8-int8" and c.num_samples == 4
    assert (c.smoothquant.smooth, c.smoothquant.alpha, c.smoothquant.weights) == (True, 0.7, "gptq")
    assert (c.dampening, c.gptq_block_size) == (0.05, 64)
    c = QuantizeConfig.from_recipe(recipe(tmp_path, "steps:\n  - gptq: {grid: hmse}\n", "g.yaml"))
    assert (c.scheme, c.gptq_grid) == ("w4a16-gptq", "hmse")
    # the static-input scheme, and its weights by RTN without smoothing
    c = QuantizeConfig.from_dict({"scheme": "w8a8-int8-static", "steps": [{"rtn": None}]})
    assert (c.scheme, c.smoothquant.smooth, c.smoothquant.weights) == ("w8a8-int8-static", False, "rtn")


def test_smoothquant_then_gptq_makes_a_checkpoint(tiny_llama, tmp_path):
    """The two-step recipe end to end: a W8A8 int8 checkpoint whose every block was smoothed
    with the recipe's alpha and whose weights are GPTQ's (not those the same recipe with an rtn
    step gives); it keeps the recipe, which reads back to the same config, and the runtime loads it."""
    from safetensors.torch import load_file

    from optllm import LLM, SamplingParams

    head = "num_samples: 4\nseq_len: 32\nholdout: 0\nsteps:\n  - smoothquant: {alpha: 0.6}\n"
    p = recipe(tmp_path, head + "  - gptq: {dampening: 0.05}\n")
    cfg = QuantizeConfig.from_recipe(p)
    report = quantize(str(tiny_llama), tmp_path / "q", cfg, progress=False, recipe=p)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized" and list(qc["config_groups"]) == ["group_0"]
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["num_bits"], group["weights"]["strategy"]) == (8, "channel")
    assert group["input_activations"]["num_bits"] == 8 and group["input_activations"]["dynamic"] is True
    assert [b.smoothquant["alpha"] for b in report.blocks] == [0.6, 0.6] and all(
        b.smoothquant["smoothed"] for b in report.blocks
    )
    saved = report.to_dict()["config"]["smoothquant"]
    assert (saved["smooth"], saved["weights"], report.to_dict()["config"]["dampening"]) == (True, "gptq", 0.05)
    assert QuantizeConfig.from_recipe(tmp_path / "q" / RECIPE_NAME) == cfg
    rtn = recipe(tmp_path, head + "  - rtn: {}\n", "rtn.yaml")
    quantize(str(tiny_llama), tmp_path / "r", QuantizeConfig.from_recipe(rtn), progress=False)
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("q", "r"))
    key = "model.layers.1.mlp.down_proj.weight"
    assert a[key].dtype == torch.int8 and not torch.equal(a[key], b[key])
    out = LLM(tmp_path / "q", device="cpu").generate([[5, 17, 250, 3]], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2


def test_awq_with_overrides_and_mixed_precision(tmp_path):
    p = recipe(
        tmp_path,
        "group_size: 64\nsteps:\n  - mixed: {target_bits: 4.5, candidates: [w4g64, w8], "
        "tokens: 512, sensitivity: output}\n  - awq: {n_grid: 10}\n    overrides:\n"
        "      're:.*down_proj': {group_size: 32}\n",
    )
    c = QuantizeConfig.from_recipe(p)
    assert (c.scheme, c.group_size, c.awq.n_grid) == ("w4a16-awq", 64, 10)
    assert (c.target_bits, c.mixed_candidates, c.mixed_tokens) == (4.5, ("w4g64", "w8"), 512)
    assert c.mixed_sensitivity == "output"
    assert c.overrides == {"re:.*down_proj": {"group_size": 32}}
    # flags win over the recipe, as for flat recipes
    assert QuantizeConfig.from_recipe(p, target_bits=4.25).target_bits == 4.25


@pytest.mark.parametrize(
    "steps, message",
    [
        ("[{gptqq: {}}]", "steps[0]: unknown step 'gptqq'; allowed: awq, fp8, gptq, mixed, nvfp4, rtn, smoothquant"),
        (
            "[{gptq: {}}, {smoothquant: {}}]",
            "steps[1]: smoothquant after gptq: smoothquant must come before the quantizing step (gptq), which is last",
        ),
        ("[{awq: {}}, {gptq: {}}]", "steps[1]: gptq after awq: a recipe has one quantizing step"),
        (
            "[{smoothquant: {}}]",
            "no quantizing step, so no scheme; the last step must be one of rtn, awq, gptq, fp8, nvfp4",
        ),
        (
            "[{mixed: {candidates: [w4g64, w8]}}, {gptq: {}}]",
            "steps[0].mixed: target_bits is missing; give the average "
            "bits per weight to reach, e.g. {target_bits: 4.5}",
        ),
        (
            "[{gptq: {dampening: lots}}]",
            "steps[0].gptq: dampening='lots' has the wrong type (a string); allowed: a number",
        ),
        (
            "[{gptq: {block_size: 1.5}}]",
            "steps[0].gptq: block_size=1.5 has the wrong type (a number); allowed: an integer",
        ),
        ("[{awq: {n_grid: '20'}}]", "steps[0].awq: n_grid='20' has the wrong type (a string); allowed: an integer"),
        (
            "[{mixed: {target_bits: 4.5, candidates: w8}}, {rtn: {}}]",
            "steps[0].mixed: candidates='w8' has the wrong type (a string); allowed: a list of strings",
        ),
        (
            "[{awq: {}, overrides: {'re:.*o_proj': {symmetric: 'no'}}}]",
            "steps[0].overrides['re:.*o_proj'].symmetric='no' has the wrong type (a string); allowed: true or false",
        ),
        ("[{smoothquant: {}}, {smoothquant: {}}, {rtn: {}}]", "steps[1]: smoothquant is given twice (steps[0])"),
        ("[{smoothquant: {}}, {awq: {}}]", "steps[0]: smoothquant can precede only rtn or gptq"),
        (
            "[{gptq: {damp: 0.1}}]",
            "steps[0].gptq: unknown field 'damp'; allowed: actorder, block_size, dampening, grid, "
            "hessian_shrink, token_cap, true_sequential",
        ),
        ("[{rtn: {x: 1}}]", "steps[0].rtn: unknown field 'x'; allowed: none (the step has no options)"),
        ("[{gptq: {}, awq: {}}]", "steps[0] names 2 steps (gptq, awq); one per list entry"),
        ("[gptq]", "steps[0] must be a mapping of one step name to its options"),
        (
            "[{awq: {}, overrides: {'re:.*o_proj': {bits: 8}}}]",
            "unknown field 'bits'; allowed: num_bits, group_size, symmetric",
        ),
        (
            "[{smoothquant: {}, overrides: {x: {num_bits: 8}}}, {rtn: {}}]",
            "steps[0]: overrides belong to a weight-only integer step (rtn, awq, gptq), not smoothquant",
        ),
        ("[{mixed: {target_bits: 4.5}}, {fp8: {}}]", "steps[0]: mixed precision needs a weight-only integer step"),
        ("[]", "steps must be a non-empty list of steps"),
    ],
)
def test_each_mistake_is_one_line_naming_the_step(tmp_path, steps, message):
    p = recipe(tmp_path, f"steps: {steps}\n")
    with pytest.raises(UserError) as e:
        QuantizeConfig.from_recipe(p)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"recipe {p}: ") and message in text, text


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "scheme: w4a16-gptq\nsteps: [{awq: {}}]\n",
            "steps[0]: awq does not match scheme 'w4a16-gptq', whose algorithm is gptq",
        ),
        ("scheme: w4a16-awq\nsteps: [{smoothquant: {}}, {rtn: {}}]\n", "smoothquant needs a w8a8-int8 scheme"),
        (
            "dampening: 0.1\nsteps: [{gptq: {dampening: 0.2}}]\n",
            "dampening is given both at the top level and in steps[0].gptq; give it once",
        ),
        ("scheme: w8a8-int8\nsteps: [{awq: {}}]\n", "scheme 'w8a8-int8' quantizes its weights with rtn or gptq"),
    ],
)
def test_steps_and_fields_must_agree(tmp_path, text, message):
    with pytest.raises(UserError, match="^recipe .*" + message.replace("[", r"\[").replace("]", r"\]")):
        QuantizeConfig.from_recipe(recipe(tmp_path, text))


@pytest.mark.parametrize(
    "text, message",
    [
        ("num_samples: many\n", "num_samples='many' has the wrong type (a string); allowed: an integer"),
        ("symmetric: 'yes'\n", "symmetric='yes' has the wrong type (a string); allowed: true or false"),
        ("ignore: lm_head\n", "ignore='lm_head' has the wrong type (a string); allowed: a list of strings"),
        ("awq: {n_grid: 2.5}\n", "awq.n_grid=2.5 has the wrong type (a number); allowed: an integer"),
        ("target_bits: [4]\n", "target_bits=[4] has the wrong type (a list); allowed: a number or null"),
        ("scheme: null\n", "scheme=None names no scheme; allowed: w4a16-rtn, w4a16-awq"),
        ("sheme: w4a16-rtn\n", "unknown config field(s) sheme; allowed: actorder, awq"),
    ],
)
def test_flat_field_mistakes_are_one_line_naming_the_recipe(tmp_path, text, message):
    """A value of the wrong type (or a field that does not exist, or no scheme) is one line
    that names the recipe, the field and what it takes, not a TypeError from deep inside."""
    p = recipe(tmp_path, text)
    with pytest.raises(UserError) as e:
        QuantizeConfig.from_recipe(p)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"recipe {p}: {message}"), str(e.value)


def test_target_bits_outside_the_candidates_is_one_line():
    """Above 16 (bf16's bits) or below the cheapest candidate's bits: refused on construction,
    before any model is loaded."""
    with pytest.raises(
        UserError,
        match=r"^target_bits=17 is not allowed; allowed: a number of bits per weight up "
        r"to 16, e.g. 4.5$",
    ):
        QuantizeConfig(target_bits=17)
    with pytest.raises(
        UserError,
        match=r"^target_bits=4 is below the cheapest candidate \(w4g128: 4.125 bits per "
        r"weight\); allowed: 4.125 to 16, or cheaper mixed_candidates$",
    ):
        QuantizeConfig(target_bits=4)
    with pytest.raises(UserError, match=r"^target_bits=4.2 is below the cheapest candidate \(w4g32: 4.5 bits"):
        QuantizeConfig(target_bits=4.2, mixed_candidates=("w8", "w4g32"))
    assert QuantizeConfig(target_bits=16).target_bits == 16
    assert QuantizeConfig(scheme="w4a16-gptq", target_bits=4.125).target_bits == 4.125


def test_override_values_are_checked_on_construction():
    with pytest.raises(UserError, match=r"override 're:.\*o_proj': group_size=12 is not supported"):
        QuantizeConfig(scheme="w4a16-rtn", overrides={"re:.*o_proj": {"group_size": 12}})
    with pytest.raises(UserError, match="overrides needs a weight-only integer scheme .* not 'fp8'"):
        QuantizeConfig(scheme="fp8", overrides={"re:.*o_proj": {"group_size": 32}})
    with pytest.raises(UserError, match="target_bits=0 is not allowed"):
        QuantizeConfig(target_bits=0)
    with pytest.raises(UserError, match="give target_bits too"):
        QuantizeConfig(mixed_candidates=("w4g64", "w8"))
    with pytest.raises(UserError, match="mixed_sensitivity='hessian' is not allowed; allowed: fisher, output"):
        QuantizeConfig(target_bits=4.5, mixed_sensitivity="hessian")


def test_the_checkpoint_keeps_its_recipe(tiny_llama, tmp_path):
    """recipe.yaml is the configuration as run (flags included); reading it back gives the same
    config; the report holds the file's own text. The overrides became config groups."""
    text = (
        "group_size: 32\nnum_samples: 4\nseq_len: 32\nholdout: 0\nsteps:\n  - awq: {n_grid: 4}\n"
        "    overrides:\n      're:.*down_proj': {group_size: 64}\n      're:.*o_proj': {num_bits: 8, "
        "group_size: channel}\n"
    )
    p = recipe(tmp_path, text)
    cfg = QuantizeConfig.from_recipe(p, seed=3)
    quantize(str(tiny_llama), tmp_path / "q", cfg, progress=False, recipe=p)
    saved = tmp_path / "q" / RECIPE_NAME
    assert QuantizeConfig.from_recipe(saved) == cfg
    assert yaml.safe_load(saved.read_text())["seed"] == 3
    report = json.loads((tmp_path / "q" / "optllm-report.json").read_text())
    assert report["recipe"] == {"file": str(p), "text": text, "saved_as": RECIPE_NAME}
    quant = read_quantization(json.loads((tmp_path / "q" / "config.json").read_text()))
    by_module = {
        n: quant.group_of(f"model.layers.1.{n}").weights
        for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
    }
    assert {n: (a.num_bits, a.group_size) for n, a in by_module.items()} == {
        "self_attn.q_proj": (4, 32),
        "self_attn.o_proj": (8, None),
        "mlp.up_proj": (4, 32),
        "mlp.down_proj": (4, 64),
    }


@pytest.mark.parametrize(
    "text, message",
    [
        (  # a step out of order
            "steps:\n  - gptq: {}\n  - smoothquant: {alpha: 0.5}\n",
            "steps[1]: smoothquant after gptq: smoothquant must come before the quantizing step (gptq), which is last",
        ),
        (  # an unknown step
            "steps:\n  - gptqq: {}\n",
            "steps[0]: unknown step 'gptqq'; allowed: awq, fp8, gptq, mixed, nvfp4, rtn, smoothquant",
        ),
        (  # an unknown option
            "steps:\n  - awq: {ngrid: 10}\n",
            "steps[0].awq: unknown field 'ngrid'; allowed: clip, clip_expand, clip_grid, clip_rows, clip_shrink, "
            "clip_tokens, duo_scaling, gqa_smooth, joint_clip, max_shrink, n_grid, scale_shrink, scale_tokens, "
            "token_cap",
        ),
        (  # a value of the wrong type
            "steps:\n  - gptq: {dampening: high}\n",
            "steps[0].gptq: dampening='high' has the wrong type (a string); allowed: a number",
        ),
        (  # no scheme: nothing quantizes
            "steps:\n  - mixed: {target_bits: 4.5}\n",
            "no quantizing step, so no scheme; the last step must be one of rtn, awq, gptq, fp8, nvfp4",
        ),
    ],
)
def test_cli_recipe_mistake_is_one_line(tiny_llama, tmp_path, text, message):
    p = recipe(tmp_path, text)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "optllm",
            "quantize",
            str(tiny_llama),
            "--recipe",
            str(p),
            "--no-compare",
            "--out",
            str(tmp_path / "q"),
        ],
        capture_output=True,
        text=True,
    )
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0] == f"error: recipe {p}: {message}"
