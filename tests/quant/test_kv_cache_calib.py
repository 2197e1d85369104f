"""`--kv-cache fp8 | fp8-head`: static KV cache scales calibrated with the weights.

What is checked:
* config.json's kv_cache_scheme parses with compressed-tensors (QuantizationConfig.model_validate),
  and each layer's self_attn.k_scale / v_scale has the name, shape and dtype compressed-tensors
  initialises for that strategy ((1,) per tensor, (kv_heads, 1, 1) per head).
* the scales equal amax / 448 over the calibration windows' post-rotary keys (post-k-norm for
  Qwen3) and values, computed here in plain torch: the float model with the checkpoint's
  dequantized weights, k_proj / v_proj outputs hooked, the rotary applied by hand. Bound: 1e-5
  relative (the same float32 arithmetic, batched differently; measured 0).
* the weights do not depend on --kv-cache (same tensors with and without it), the report
  records the scales, and a bad choice is one readable error.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from optllm.errors import UserError
from optllm.formats.compressed_tensors import load_quantized_weights
from optllm.quant.calib_data import load_calibration, token_hash
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import quantize

CFG = dict(scheme="w4a16-rtn", group_size=32, num_samples=6, seq_len=32, batch_size=4, holdout=0)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def reference_amax(model_dir, ckpt, input_ids):
    """Per layer (k_amax [kv_heads], v_amax [kv_heads]) of the float model holding the
    checkpoint's dequantized weights, over input_ids [N, S]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    qweights, _, _ = load_quantized_weights(ckpt)
    with torch.no_grad():
        for name, qw in qweights.items():
            model.get_submodule(name).weight.copy_(qw.dequantize(torch.float32))
    cfg = model.config
    heads, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    seen = {}

    def keep(i, what):
        def hook(_m, _args, out):
            seen.setdefault((i, what), []).append(out.detach())
        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        k_mod = getattr(attn, "k_norm", None) or attn.k_proj  # Qwen3: keys are normed before the rotary
        handles += [k_mod.register_forward_hook(keep(i, "k")), attn.v_proj.register_forward_hook(keep(i, "v"))]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
            pos = torch.arange(input_ids.shape[1])[None]
            cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    finally:
        for h in handles:
            h.remove()
    out = []
    for i in range(cfg.num_hidden_layers):
        n, s = input_ids.shape
        k = seen[(i, "k")][0].reshape(n, s, heads, d).transpose(1, 2)  # [N, H, S, D]
        v = seen[(i, "v")][0].reshape(n, s, heads, d).transpose(1, 2)
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        out.append((k.abs().amax(dim=(0, 2, 3)), v.abs().amax(dim=(0, 2, 3))))
    return out


@pytest.mark.parametrize("arch, choice", [("llama", "fp8"), ("qwen3", "fp8-head")])
def test_kv_scales_are_amax_over_448_of_the_post_rotary_calibration_kv(arch, choice, tiny_models, tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams

    cfg = QuantizeConfig(**CFG, kv_cache=choice)
    rep = quantize(str(tiny_models[arch]), tmp_path / "q", cfg, progress=False)
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    qc = QuantizationConfig.model_validate(raw["quantization_config"])
    strategy = {"fp8": "tensor", "fp8-head": "attn_head"}[choice]
    kv = qc.kv_cache_scheme
    assert (kv.num_bits, kv.type, kv.strategy, kv.dynamic, kv.symmetric) == (8, "float", strategy, False, True)
    sd = load_file(tmp_path / "q" / "model.safetensors")
    heads, d = raw["num_key_value_heads"], raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    expect = torch.nn.Module()  # what compressed-tensors registers on an attention module for this scheme
    for base in ("k", "v"):
        initialize_qparams(expect, base, kv, observed_shape=(heads, None, d), observed_dtype=torch.float32,
                           force_zero_point=False)
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in expect.named_parameters()}
    assert set(shapes) == {"k_scale", "v_scale"}

    tok_ids = _calibration_ids(tiny_models[arch], cfg)
    assert token_hash(tok_ids) == rep.calibration["sha256"]
    ref = reference_amax(tiny_models[arch], tmp_path / "q", tok_ids)
    for i, (k_amax, v_amax) in enumerate(ref):
        for name, amax in (("k_scale", k_amax), ("v_scale", v_amax)):
            got = sd[f"model.layers.{i}.self_attn.{name}"]
            assert (tuple(got.shape), got.dtype) == shapes[name]
            want = (amax.amax().reshape(1) if strategy == "tensor" else amax) / 448.0
            torch.testing.assert_close(got.reshape(-1), want, rtol=1e-5, atol=0)
        layer = rep.kv_cache["layers"][i]
        assert layer["k_scale"] == sd[f"model.layers.{i}.self_attn.k_scale"].reshape(-1).tolist()
        assert layer["tokens"] == CFG["num_samples"] * CFG["seq_len"]
    assert rep.kv_cache["strategy"] == strategy
    assert json.loads((tmp_path / "q" / "optllm-report.json").read_text())["kv_cache"]["kv_cache"] == choice


def _calibration_ids(model_dir, cfg):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return load_calibration(tok, cfg.calib, cfg.num_samples, cfg.seq_len, cfg.seed).input_ids


def test_kv_cache_leaves_the_weights_alone(tiny_llama, tmp_path):
    quantize(str(tiny_llama), tmp_path / "a", QuantizeConfig(**CFG), progress=False)
    quantize(str(tiny_llama), tmp_path / "b", QuantizeConfig(**CFG, kv_cache="fp8"), progress=False)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    scales = {k for k in b if k.endswith(("self_attn.k_scale", "self_attn.v_scale"))}
    assert len(scales) == 4 and set(b) - scales == set(a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is None


def test_kv_cache_choice_is_validated():
    assert QuantizeConfig(kv_cache="none").kv_cache is None
    assert QuantizeConfig(kv_cache="fp8-head").to_dict()["kv_cache"] == "fp8-head"
    with pytest.raises(UserError, match="kv_cache='int8' is not allowed; allowed: none, fp8, fp8-head"):
        QuantizeConfig(kv_cache="int8")
