"""End to end on tiny random models of every supported architecture."""

import json

import pytest
import torch
from conftest import ARCHS
from hf_reference import load_quantized

from optllm.errors import UserError
from optllm.formats.compressed_tensors import load_quantized_weights
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import quantize

# Bounds sit ~20% above the largest errors measured on these tiny models (8 x 32 tokens, g32;
# commit 13d29f0 + this change): layer errors RTN 0.105, AWQ 0.102, GPTQ 0.076; block errors
# RTN 0.091, AWQ 0.084, GPTQ 0.061 (all four architectures).
MAX_LAYER_ERROR = {"w4a16-rtn": 0.13, "w4a16-awq": 0.125, "w4a16-gptq": 0.09}
MAX_BLOCK_ERROR = {"w4a16-rtn": 0.11, "w4a16-awq": 0.10, "w4a16-gptq": 0.075}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scheme", ["w4a16-rtn", "w4a16-awq", "w4a16-gptq"])
def test_every_architecture_and_algorithm(arch, scheme, tiny_models, tmp_path):
    cfg = QuantizeConfig(scheme=scheme, group_size=32, num_samples=8, seq_len=32, batch_size=4,
                         symmetric=(arch != "mistral"))
    report = quantize(str(tiny_models[arch]), tmp_path / "q", cfg, progress=False)
    assert len(report.layers) == 2 * 7
    assert all(0 < s.rel_error < MAX_LAYER_ERROR[scheme] for s in report.layers)
    assert all(0 < b.rel_error < MAX_BLOCK_ERROR[scheme] for b in report.blocks)
    model, tok, qweights = load_quantized(tmp_path / "q")
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    written = json.loads((tmp_path / "q" / "optllm-report.json").read_text())
    assert written["scheme"] == scheme and written["peak_memory_bytes"] > 0
    hidden = model.config.hidden_size
    assert written["activations"] == {"bytes_per_copy": 8 * 32 * hidden * 4, "device": "cpu"}


def test_gptq_and_awq_beat_rtn_on_the_same_calibration(tiny_llama, tmp_path):
    """Measured (16 x 64 tokens, g32): mean layer error RTN 0.0952, AWQ 0.0860 (0.90x), GPTQ
    0.0639 (0.67x); block errors RTN 0.0567 / 0.0724, AWQ 0.0506 / 0.0573 (0.89x, 0.79x), GPTQ
    0.0354 / 0.0388 (0.62x, 0.54x). AWQ optimises the blocks' outputs; its per-layer error is
    lower too, but that is not what it promises."""
    layer_err, block_err = {}, {}
    for scheme in ("w4a16-rtn", "w4a16-awq", "w4a16-gptq"):
        cfg = QuantizeConfig(scheme=scheme, group_size=32, num_samples=16, seq_len=64)
        rep = quantize(str(tiny_llama), tmp_path / scheme, cfg, progress=False)
        layer_err[scheme] = sum(s.rel_error for s in rep.layers) / len(rep.layers)
        block_err[scheme] = [b.rel_error for b in rep.blocks]
    print(layer_err, block_err)
    rtn = block_err["w4a16-rtn"]
    assert all(a < 0.95 * r for a, r in zip(block_err["w4a16-awq"], rtn))
    assert all(g < 0.7 * r for g, r in zip(block_err["w4a16-gptq"], rtn))
    assert layer_err["w4a16-awq"] < 0.95 * layer_err["w4a16-rtn"]
    assert layer_err["w4a16-gptq"] < 0.75 * layer_err["w4a16-rtn"]


def test_actorder_changes_the_stored_weights(tiny_llama, tmp_path):
    """Static act-order keeps the original weight's grid (with min-max ranges its scales are RTN's,
    bit for bit; with the searched ones, the same ranges shrunk) and visits columns by activation
    size, so its codes differ from plain GPTQ's and RTN's."""
    ckpt = {}
    for name, scheme, actorder, grid in (("rtn", "w4a16-rtn", "auto", "minmax"),
                                         ("static", "w4a16-gptq", "static", "minmax"),
                                         ("none", "w4a16-gptq", "none", "minmax"),
                                         ("static-hmse", "w4a16-gptq", "static", "hmse")):
        cfg = QuantizeConfig(scheme=scheme, group_size=32, actorder=actorder, num_samples=8, seq_len=32,
                             gptq_grid=grid)
        quantize(str(tiny_llama), tmp_path / name, cfg, progress=False)
        ckpt[name] = load_quantized_weights(tmp_path / name)
    qc = ckpt["static"][2]["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    assert ckpt["none"][2]["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] is None
    static, plain, rtn = ckpt["static"][0], ckpt["none"][0], ckpt["rtn"][0]
    assert set(static) == set(plain) == set(rtn) and len(static) == 14
    for name in static:
        assert torch.equal(static[name].scale, rtn[name].scale), name  # the original weight's grid
        assert not torch.equal(static[name].q, rtn[name].q), name
        assert not torch.equal(static[name].q, plain[name].q), name
        assert not torch.equal(plain[name].scale, rtn[name].scale), name  # plain GPTQ: grid of updated weights
        searched = ckpt["static-hmse"][0][name].scale
        assert (searched <= rtn[name].scale).all() and (searched < rtn[name].scale).any(), name


@pytest.mark.parametrize("scheme", ["w4a16-rtn", "w4a16-awq", "w4a16-gptq"])
def test_ignored_layers_hold_their_original_weights(scheme, tiny_llama, tmp_path):
    """Before AWQ honoured --ignore, the AWQ checkpoint's down_proj held weights scaled by the
    up_proj -> down_proj search (and clip-searched): not the original ones."""
    from safetensors.torch import load_file

    original = load_file(tiny_llama / "model.safetensors")
    cfg = QuantizeConfig(scheme=scheme, group_size=32, num_samples=8, seq_len=32,
                         ignore=("lm_head", "re:.*down_proj"))
    rep = quantize(str(tiny_llama), tmp_path / "q", cfg, progress=False)
    assert len(rep.layers) == 2 * 6
    qweights, rest, config = load_quantized_weights(tmp_path / "q")
    ignore = config["quantization_config"]["ignore"]
    for i in range(2):
        name = f"model.layers.{i}.mlp.down_proj"
        assert name in ignore and name not in qweights
        stored = rest[f"{name}.weight"]
        assert stored.dtype == torch.bfloat16
        assert torch.equal(stored, original[f"{name}.weight"].to(torch.bfloat16)), name
        assert f"model.layers.{i}.mlp.up_proj" in qweights


def test_awq_searches_with_the_checkpoint_scale_dtype(tiny_llama, tmp_path, monkeypatch):
    from optllm.quant import awq

    seen = []
    for fn in ("search_clip", "search_scales"):
        orig = getattr(awq, fn)

        def spy(*args, _orig=orig, **kwargs):
            seen.append(kwargs.get("scale_dtype", args[-1] if isinstance(args[-1], torch.dtype) else None))
            return _orig(*args, **kwargs)

        monkeypatch.setattr(awq, fn, spy)
    cfg = QuantizeConfig(scheme="w4a16-awq", group_size=32, num_samples=4, seq_len=32, dtype="float16")
    quantize(str(tiny_llama), tmp_path / "q", cfg, progress=False)
    # 2 blocks x (3 scale searches + 5 clip searches: v, o, gate, up, down)
    assert len(seen) == 16 and set(seen) == {torch.float16}


def test_progress_is_a_plain_line_per_block_off_a_terminal(tiny_llama, tmp_path, capsys):
    cfg = QuantizeConfig(scheme="w4a16-rtn", group_size=32, num_samples=4, seq_len=32)
    quantize(str(tiny_llama), tmp_path / "q", cfg, progress=True)
    lines = [x for x in capsys.readouterr().out.splitlines() if "block" in x]
    assert [x.split(":")[0] for x in lines] == ["w4a16-rtn block 1/2", "w4a16-rtn block 2/2"]
    assert all("block rel. error" in x for x in lines)


def test_group_size_not_dividing_is_a_clear_error(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="does not divide in_features=64"):
        quantize(str(tiny_llama), tmp_path / "q", QuantizeConfig(group_size=48), progress=False)
    assert not (tmp_path / "q").exists()


def test_config_validation():
    with pytest.raises(UserError, match="offload='sometimes' is not allowed; allowed: auto, always, never"):
        QuantizeConfig(offload="sometimes")
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


def test_held_out_windows_compare_each_block_with_rtn(tiny_llama, tmp_path):
    cfg = QuantizeConfig(scheme="w4a16-gptq", group_size=32, num_samples=8, seq_len=32, holdout=2)
    rep = quantize(str(tiny_llama), tmp_path / "q", cfg, progress=False)
    assert rep.calibration["holdout_windows"] == 2 and rep.calibration["num_samples"] == 8
    assert rep.calibration["holdout_sha256"] != rep.calibration["sha256"]
    for b in rep.blocks:
        assert b.kept == "gptq" and 0 < b.holdout_error and 0 < b.holdout_rtn_error
    summary = json.loads((tmp_path / "q" / "optllm-report.json").read_text())["holdout"]
    assert summary["windows"] == 2 and summary["blocks_compared"] == 2 and summary["kept_rtn"] == []
    rtn = quantize(str(tiny_llama), tmp_path / "r", QuantizeConfig(scheme="w4a16-rtn", group_size=32, num_samples=8,
                                                                   seq_len=32, holdout=2), progress=False)
    assert all(b.holdout_error is None and b.kept == "rtn" for b in rtn.blocks)  # nothing to compare RTN with


def test_fallback_rtn_keeps_rtn_where_the_algorithm_lost(tiny_llama, tmp_path, monkeypatch):
    """A GPTQ made to fit badly (its weights perturbed before rounding) loses to RTN on the
    held-out windows in every block: the report says so, and with fallback_rtn the checkpoint
    holds RTN's codes and scales there, bit for bit."""
    from optllm.quant import gptq as pipeline  # the GPTQ step (gptq.py) calls gptq_quantize

    real = pipeline.gptq_quantize

    def bad_gptq(w, h, args, **kw):
        gen = torch.Generator(device=w.device).manual_seed(0)
        return real(w + 0.5 * w.abs().mean() * torch.randn(w.shape, generator=gen, device=w.device), h, args, **kw)

    monkeypatch.setattr(pipeline, "gptq_quantize", bad_gptq)
    base = dict(scheme="w4a16-gptq", group_size=32, num_samples=8, seq_len=32, holdout=2)
    report = quantize(str(tiny_llama), tmp_path / "plain", QuantizeConfig(**base), progress=False)
    assert report.holdout_summary()["worse_than_rtn"] == [0, 1] and report.holdout_summary()["kept_rtn"] == []
    kept = quantize(str(tiny_llama), tmp_path / "fb", QuantizeConfig(**base, fallback_rtn=True), progress=False)
    assert kept.holdout_summary()["kept_rtn"] == [0, 1] and all(b.kept == "rtn" for b in kept.blocks)
    quantize(str(tiny_llama), tmp_path / "rtn", QuantizeConfig(**{**base, "scheme": "w4a16-rtn"}), progress=False)
    fb, rtn = load_quantized_weights(tmp_path / "fb")[0], load_quantized_weights(tmp_path / "rtn")[0]
    assert set(fb) == set(rtn) and len(fb) == 14
    for name in fb:
        assert torch.equal(fb[name].q, rtn[name].q) and torch.equal(fb[name].scale, rtn[name].scale), name


def test_holdout_and_gptq_options_are_validated():
    with pytest.raises(UserError, match="holdout=-1 is not allowed"):
        QuantizeConfig(holdout=-1)
    with pytest.raises(UserError, match="fallback_rtn needs held-out windows"):
        QuantizeConfig(holdout=0, fallback_rtn=True)
    with pytest.raises(UserError, match="token_cap=0"):
        QuantizeConfig(token_cap=0)
    with pytest.raises(UserError, match="hessian_shrink=1"):
        QuantizeConfig(hessian_shrink=1.0)
    assert QuantizeConfig(num_samples=128).holdout_windows() == 16
    assert QuantizeConfig(num_samples=4).holdout_windows() == 2
