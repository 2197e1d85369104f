"""A checkpoint quantized with --kv-cache fp8 | fp8-head runs on an FP8 KV cache with its
calibrated (static) scales.

Three runs of the same weights (w4a16-rtn, float32 compute on CPU; the checkpoint written
without --kv-cache holds the identical weight tensors, tests/quant/test_kv_cache_calib.py):
float cache (no kv_cache_scheme, kv_cache_dtype "auto"), dynamic fp8 (the same, "fp8": a scale
per token and head) and static fp8 (the --kv-cache checkpoint, "auto" or "fp8").

Bounds, |prompt log-prob difference| over every prompt position of three prompts (40, 70 and 23
random tokens) on tiny random Llama / Qwen3 models:
* static vs float cache: < 0.05 (E4M3 keeps 3 mantissa bits; measured 0.008-0.013).
* static vs dynamic fp8: < 0.05 (a per-layer or per-head scale is coarser than a per-row one;
  measured 0.010-0.014).
* greedy tokens: the 8 the float cache gives, on all three prompts (measured).
* scales 1000x too small (a checkpoint whose calibration missed the range): every value
  saturates at +-448 * scale, log-probs stay finite (no NaN).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from optllm import LLM, SamplingParams
from optllm.errors import UserError
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import quantize

# symmetric, as when the bounds and the token comparison below were set (the KV cache is what is tested)
CFG = dict(scheme="w4a16-rtn", group_size=32, symmetric=True, num_samples=8, seq_len=64, holdout=0)
BOUND = 0.05


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 300, (n,), generator=g).tolist() for n in (40, 70, 23)]


@pytest.fixture(scope="module", params=[("llama", "fp8"), ("qwen3", "fp8-head")], ids=lambda p: "-".join(p))
def checkpoints(request, tiny_models, tmp_path_factory):
    arch, choice = request.param
    root = tmp_path_factory.mktemp(f"kv-{arch}")
    quantize(str(tiny_models[arch]), root / "plain", QuantizeConfig(**CFG), progress=False)
    quantize(str(tiny_models[arch]), root / "kv", QuantizeConfig(**CFG, kv_cache=choice), progress=False)
    return root / "plain", root / "kv", choice


def run(folder, **kw):
    """(llm, prompt log-probs of every prompt position, greedy tokens per prompt)."""
    prompts = _prompts()
    llm = LLM(folder, device="cpu", **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, prompt_logprobs=0, temperature=0))
    lps = torch.tensor([o.prompt_logprobs[p][pr[p]] for o, pr in zip(outs, prompts) for p in range(1, len(pr))])
    return llm, lps, [o.outputs[0].token_ids for o in outs]


def test_static_fp8_cache_is_close_to_float_and_dynamic(checkpoints):
    plain, kv, choice = checkpoints
    flt, lp_float, tok_float = run(plain)
    dyn, lp_dyn, _ = run(plain, kv_cache_dtype="fp8")
    static, lp_static, tok_static = run(kv)
    assert flt.engine.runner.kv_spec.dtype == torch.float32  # no kv_cache_scheme: as before
    assert all(a.static_k_scale is None for a in flt.engine.runner.model.attention_layers())
    assert all(a.static_k_scale is None for a in dyn.engine.runner.model.attention_layers())
    assert static.engine.runner.kv_spec.dtype == torch.float8_e4m3fn
    assert float((lp_static - lp_float).abs().max()) < BOUND
    assert float((lp_static - lp_dyn).abs().max()) < BOUND
    assert tok_static == tok_float
    # the checkpoint's scales are what the cache stored with, per head
    sd = load_file(kv / "model.safetensors")
    cache = static.engine.runner.kv_cache
    for i, layer in enumerate(static.engine.runner.model.attention_layers()):
        for name, held, written in (("k_scale", layer.static_k_scale, cache.k_scale[i]),
                                    ("v_scale", layer.static_v_scale, cache.v_scale[i])):
            want = sd[f"model.layers.{i}.self_attn.{name}"].reshape(-1).expand(layer.num_kv_heads)
            assert torch.equal(held, want)
            for h in range(layer.num_kv_heads):  # every slot holds its head's static scale, or the initial 1
                values = set(written[:, h].unique().tolist())
                assert float(want[h]) in values and values <= {1.0, float(want[h])}
    # --kv-cache-dtype fp8 on a calibrated checkpoint keeps its static scales
    _, lp_fp8, _ = run(kv, kv_cache_dtype="fp8")
    assert torch.equal(lp_fp8, lp_static)


def _edit(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        sd = load_file(dst / "model.safetensors")
        tensors(sd)
        save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_too_small_scales_saturate_never_nan(checkpoints, tmp_path):
    _, kv, _ = checkpoints

    def shrink(sd):
        for k in sd:
            if k.endswith(("self_attn.k_scale", "self_attn.v_scale")):
                sd[k] = sd[k] / 1000

    llm, lps, _ = run(_edit(kv, tmp_path / "small", tensors=shrink))
    assert bool(torch.isfinite(lps).all())
    k0 = llm.engine.runner.kv_cache.k[0].float()
    assert not torch.isnan(k0).any() and float(k0.abs().max()) == 448.0


def test_checkpoint_errors_are_one_line(checkpoints, tmp_path):
    _, kv, _ = checkpoints
    missing = _edit(kv, tmp_path / "missing", tensors=lambda sd: sd.pop("model.layers.1.self_attn.v_scale"))
    with pytest.raises(UserError, match=r"kv_cache_scheme needs every attention's K and V scales; 1 missing, "
                                        r"e\.g\. model\.layers\.1\.self_attn\.v_scale"):
        LLM(missing, device="cpu")

    def zero(sd):
        sd["model.layers.0.self_attn.k_scale"] = torch.zeros_like(sd["model.layers.0.self_attn.k_scale"])

    with pytest.raises(UserError, match=r"^model\.layers\.0\.self_attn\.k_scale: scales must be finite and > 0"):
        LLM(_edit(kv, tmp_path / "zero", tensors=zero), device="cpu")

    def int8(qc):
        qc["kv_cache_scheme"]["type"] = "int"

    with pytest.raises(UserError, match="unsupported KV cache quantization in config.json: kv_cache_scheme int 8-bit"):
        LLM(_edit(kv, tmp_path / "int8", config=int8), device="cpu")

    def drop(qc):
        qc["kv_cache_scheme"] = None

    with pytest.raises(UserError, match=r"self_attn\.k_scale has no place in the model"):
        LLM(_edit(kv, tmp_path / "noscheme", config=drop), device="cpu")
