"""Checkpoints of several config groups (mixed precision) on the runtime: each linear runs with
its own group's arguments (W4 on the W4A16 method, W8 dequantized), the prompt log-probs equal
those of the same dequantized weights in transformers, and transformers + compressed-tensors
gives every module the same config group. Single-group checkpoints load as before; broken
group layouts are one clear error.

Bounds (float32 on CPU, |log-prob difference| over every prompt position), as in
test_checkpoints.py: "dequant" against the formats-level reference (the checkpoint's weights
dequantized as vLLM does): < 1e-4. Against transformers' own loader (compressed-tensors
decompresses in float32, not the scale's bf16): < 2e-2. (transformers' `dequantize=True`
switch decodes every dense linear with the first config group's arguments, so it cannot read a
mixed checkpoint; its default loader, used here, does.)
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_reference import load_quantized

from optllm import LLM, SamplingParams
from optllm.errors import UserError
from optllm.formats.args import QuantArgs
from optllm.formats.compressed_tensors import CheckpointQuant, ConfigGroup, read_quantization
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import quantize
from optllm.runtime.layers.linear_methods import DequantMethod, W4A16Method

PROMPT = [5, 17, 250, 3, 99, 42, 7, 11, 12, 13, 200, 201, 202, 90, 91, 92, 93, 40, 41]
# per module pattern, arguments over the run's W4 g32: the checkpoint has three config groups
OVERRIDES = {
    "re:.*layers\\.0\\.self_attn\\.o_proj": {"num_bits": 8, "group_size": "channel"},
    "re:.*layers\\.1\\.mlp\\.(gate|up)_proj": {"group_size": 64},
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def mixed(request, tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed") / request.param
    cfg = QuantizeConfig(scheme="w4a16-rtn", group_size=32, overrides=OVERRIDES, num_samples=2, seq_len=16, holdout=0)
    quantize(str(tiny_models[request.param]), out, cfg, progress=False)
    return out


def ours(folder, mode):
    llm = LLM(folder, device="cpu", quantized_linear=mode)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    return llm, [out.prompt_logprobs[p][PROMPT[p]] for p in range(1, len(PROMPT))]


def expected(ref):
    return [float(ref[p - 1, PROMPT[p]]) for p in range(1, len(PROMPT))]


def test_each_linear_runs_with_its_own_group(mixed):
    groups = read_quantization(json.loads((mixed / "config.json").read_text())).groups
    assert sorted((g.weights.num_bits, g.weights.group_size) for g in groups) == [(4, 32), (4, 64), (8, None)]
    llm, lps = ours(mixed, "dequant")
    model = llm.engine.runner.model
    assert llm.engine.source.mixed is not None
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    assert layer0.self_attn.o_proj.method.args == QuantArgs(8, None)
    assert layer1.mlp.gate_up_proj.method.args == QuantArgs(4, 64)
    assert layer1.self_attn.qkv_proj.method.args == QuantArgs(4, 32)
    ref_model, _, _ = load_quantized(mixed)
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([PROMPT])).logits[0].double(), -1)
    assert max(abs(a - b) for a, b in zip(lps, expected(ref))) < 1e-4
    # the kernel path: W4 linears on the W4A16 method, the W8 one dequantized at load
    llm, lps_kernel = ours(mixed, "kernel")
    kinds = {type(m.method) for m in llm.engine.runner.model.modules() if hasattr(m, "method")}
    assert {W4A16Method, DequantMethod} <= kinds
    assert max(abs(a - b) for a, b in zip(lps_kernel, expected(ref))) < 2e-2


def test_transformers_compressed_tensors_reads_the_same_groups(mixed):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mixed, dtype=torch.float32).eval()
    quant = read_quantization(json.loads((mixed / "config.json").read_text()))
    seen = 0
    for name, module in hf.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        group = quant.group_of(name) if isinstance(module, torch.nn.Linear) else None
        if group is None:
            assert scheme is None or scheme.weights is None, name
            continue
        seen += 1
        w = scheme.weights
        assert (w.num_bits, w.group_size, w.strategy) == (
            group.weights.num_bits,
            group.weights.group_size,
            group.weights.strategy,
        ), name
    assert seen == 14
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].double(), -1)
    _, lps = ours(mixed, "dequant")
    assert max(abs(a - b) for a, b in zip(lps, expected(ref))) < 2e-2


def test_a_target_bits_checkpoint_serves_its_dequantized_weights(tiny_llama, tmp_path):
    """A checkpoint `--target-bits` chose (AWQ, W4 g64 / g32 / W8 per channel at 4.6 bits on
    average): our runtime's prompt log-probs equal the formats-level dequantized reference
    (< 1e-4, dequant; < 2e-2 on the kernel path), and transformers + compressed-tensors reads it
    to the same log-probs (< 2e-2)."""
    cfg = QuantizeConfig(
        scheme="w4a16-awq",
        target_bits=4.6,
        mixed_candidates=("w4g64", "w4g32", "w8"),
        num_samples=4,
        seq_len=32,
        holdout=0,
    )
    report = quantize(str(tiny_llama), tmp_path / "m", cfg, progress=False)
    assert report.mixed["average_bits"] <= 4.6 and len({u["choice"] for u in report.mixed["units"]}) >= 2
    quant = read_quantization(json.loads((tmp_path / "m" / "config.json").read_text()))
    assert len(quant.groups) >= 2
    llm, lps = ours(tmp_path / "m", "dequant")
    assert llm.engine.source.mixed is not None
    for u in report.mixed["units"]:  # each fused linear runs with the arguments of its unit's choice
        args = quant.group_of(u["linears"][0]).weights
        assert u["choice"] == f"w{args.num_bits}" + (f"g{args.group_size}" if args.group_size else "")
    ref_model, _, _ = load_quantized(tmp_path / "m")
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([PROMPT])).logits[0].double(), -1)
    assert max(abs(a - b) for a, b in zip(lps, expected(ref))) < 1e-4
    _, lps_kernel = ours(tmp_path / "m", "kernel")
    assert max(abs(a - b) for a, b in zip(lps_kernel, expected(ref))) < 2e-2
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    with torch.no_grad():
        hf_ref = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].double(), -1)
    assert max(abs(a - b) for a, b in zip(lps, expected(hf_ref))) < 2e-2


def test_a_uniform_run_keeps_one_group_targeting_linear(tiny_llama, tmp_path):
    """Overrides that change nothing, or none: one config group with targets Linear, as before."""
    cfg = QuantizeConfig(
        scheme="w4a16-rtn",
        group_size=32,
        overrides={"re:.*o_proj": {"group_size": 32}},
        num_samples=2,
        seq_len=16,
        holdout=0,
    )
    quantize(str(tiny_llama), tmp_path / "q", cfg, progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert list(qc["config_groups"]) == ["group_0"] and qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert LLM(tmp_path / "q", device="cpu").engine.source.mixed is None


def test_group_precedence_is_compressed_tensors():
    """An exact name beats a re: pattern, which beats the class name; ignore beats all."""
    w4, w8, g64 = QuantArgs(4, 32), QuantArgs(8, None), QuantArgs(4, 64)
    q = CheckpointQuant(
        "pack-quantized",
        w4,
        None,
        ["Linear"],
        ["lm_head", "re:.*layers\\.9\\..*"],
        groups=(
            ConfigGroup("a", ("Linear",), w4, None, "pack-quantized"),
            ConfigGroup("b", ("re:.*o_proj",), w8, None, "pack-quantized"),
            ConfigGroup("c", ("model.layers.0.self_attn.o_proj",), g64, None, "pack-quantized"),
        ),
    )
    assert q.group_of("model.layers.0.self_attn.o_proj").weights == g64
    assert q.group_of("model.layers.1.self_attn.o_proj").weights == w8
    assert q.group_of("model.layers.1.mlp.up_proj").weights == w4
    assert q.group_of("model.layers.9.self_attn.o_proj") is None and q.group_of("lm_head") is None


def _edit(src, dst, change):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    change(cfg["quantization_config"]["config_groups"])
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_fused_linears_split_across_groups_are_one_error(mixed, tmp_path):
    def split(groups):
        for g in groups.values():
            g["targets"] = [t for t in g["targets"] if not t.endswith("layers.0.self_attn.k_proj")]
        groups["group_9"] = {
            **groups["group_0"],
            "targets": ["model.layers.0.self_attn.k_proj"],
            "weights": {**groups["group_0"]["weights"], "group_size": 64},
        }

    bad = _edit(mixed, tmp_path / "bad", split)
    with pytest.raises(
        UserError,
        match=r"self_attn.q_proj, .*k_proj, .*v_proj are fused into one linear but the "
        r"checkpoint's config groups quantize them differently",
    ):
        LLM(bad, device="cpu")


def test_a_quantized_module_no_group_targets_is_one_error(mixed, tmp_path):
    def drop(groups):
        for g in groups.values():
            g["targets"] = [t for t in g["targets"] if not t.endswith("layers.1.mlp.down_proj")]

    bad = _edit(mixed, tmp_path / "bad", drop)
    with pytest.raises(
        UserError,
        match=r"model.layers.1.mlp.down_proj is quantized but no config group of "
        r"config.json targets it",
    ):
        LLM(bad, device="cpu")


def test_an_asymmetric_mixed_checkpoint_keeps_8_bits_symmetric(tiny_llama, tmp_path):
    """--asym --target-bits: 4-bit units get zero points, 8-bit ones stay symmetric (vLLM serves
    8-bit zero points on Hopper only); our runtime serves it as its dequantized weights give.
    (transformers 5.24 + compressed-tensors 0.20 do not read asymmetric checkpoints of several
    config groups, either way: run compressed, their modules expect unpacked zero points;
    dequantizing, the weight conversion fails. README says so.)"""
    cfg = QuantizeConfig(scheme="w4a16-rtn", target_bits=5.5, mixed_candidates=("w4g64", "w8"), symmetric=False,
                         num_samples=2, seq_len=16, holdout=0)
    quantize(str(tiny_llama), tmp_path / "m", cfg, progress=False)
    groups = read_quantization(json.loads((tmp_path / "m" / "config.json").read_text())).groups
    assert {(g.weights.num_bits, g.weights.symmetric) for g in groups} == {(4, False), (8, True)}
    ref, _, _ = load_quantized(tmp_path / "m")
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([PROMPT])).logits[0].double(), -1)
    _, lps = ours(tmp_path / "m", "dequant")
    assert max(abs(a - b) for a, b in zip(lps, expected(want))) < 1e-4
