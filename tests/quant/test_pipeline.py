"""End to end on tiny random models of every supported architecture."""

import json

import pytest
import torch
from conftest import ARCHS
from hf_reference import load_quantized

from optllm.errors import UserError
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import quantize


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scheme", ["w4a16-rtn", "w4a16-awq", "w4a16-gptq"])
def test_every_architecture_and_algorithm(arch, scheme, tiny_models, tmp_path):
    cfg = QuantizeConfig(scheme=scheme, group_size=32, num_samples=8, seq_len=32, batch_size=4,
                         symmetric=(arch != "mistral"))
    report = quantize(str(tiny_models[arch]), tmp_path / "q", cfg, progress=False)
    assert len(report.layers) == 2 * 7
    assert all(0 < s.rel_error < 0.5 for s in report.layers)
    assert all(0 < b.rel_error < 0.5 for b in report.blocks)
    model, tok, qweights = load_quantized(tmp_path / "q")
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    written = json.loads((tmp_path / "q" / "optllm-report.json").read_text())
    assert written["scheme"] == scheme and written["peak_memory_bytes"] > 0


def test_gptq_and_awq_beat_rtn_on_the_same_calibration(tiny_llama, tmp_path):
    errs = {}
    for scheme in ("w4a16-rtn", "w4a16-awq", "w4a16-gptq"):
        cfg = QuantizeConfig(scheme=scheme, group_size=32, num_samples=16, seq_len=64)
        rep = quantize(str(tiny_llama), tmp_path / scheme, cfg, progress=False)
        errs[scheme] = sum(s.rel_error for s in rep.layers) / len(rep.layers)
    print(errs)
    assert errs["w4a16-gptq"] < errs["w4a16-rtn"]
    assert errs["w4a16-awq"] < errs["w4a16-rtn"] * 1.05  # AWQ optimises block outputs, not each layer


def test_actorder_gptq_runs_and_stores_weight_actorder(tiny_llama, tmp_path):
    cfg = QuantizeConfig(scheme="w4a16-gptq", group_size=32, actorder="static", num_samples=4, seq_len=32)
    quantize(str(tiny_llama), tmp_path / "q", cfg, progress=False)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"


def test_ignore_leaves_layers_in_full_precision(tiny_llama, tmp_path):
    cfg = QuantizeConfig(scheme="w4a16-rtn", group_size=32, num_samples=4, seq_len=32,
                         ignore=("lm_head", "re:.*down_proj"))
    rep = quantize(str(tiny_llama), tmp_path / "q", cfg, progress=False)
    assert len(rep.layers) == 2 * 6
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.down_proj" in qc["ignore"]


def test_group_size_not_dividing_is_a_clear_error(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="does not divide in_features=64"):
        quantize(str(tiny_llama), tmp_path / "q", QuantizeConfig(group_size=48), progress=False)
    assert not (tmp_path / "q").exists()


def test_config_validation():
    with pytest.raises(UserError, match="unknown scheme"):
        QuantizeConfig(scheme="w4a16-magic")
    with pytest.raises(UserError, match="num_samples=0"):
        QuantizeConfig(num_samples=0)
    with pytest.raises(UserError, match="unknown config field"):
        QuantizeConfig.from_dict({"sceme": "w4a16-rtn"})
    with pytest.raises(UserError, match="dtype"):
        QuantizeConfig(dtype="float64")


def test_gptq_defaults_to_static_actorder_only_for_gptq():
    assert QuantizeConfig(scheme="w4a16-gptq").quant_scheme().weights.actorder == "static"
    assert QuantizeConfig(scheme="w4a16-gptq", actorder="none").quant_scheme().weights.actorder is None
    assert QuantizeConfig(scheme="w4a16-awq").quant_scheme().weights.actorder is None
    with pytest.raises(UserError, match="actorder is a GPTQ option"):
        QuantizeConfig(scheme="w4a16-awq", actorder="static")


def test_recipe_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("scheme: w4a16-gptq\ngroup_size: 64\nawq:\n  n_grid: 5\n")
    cfg = QuantizeConfig.from_recipe(p, num_samples=3)
    assert (cfg.scheme, cfg.group_size, cfg.num_samples, cfg.awq.n_grid) == ("w4a16-gptq", 64, 3, 5)
