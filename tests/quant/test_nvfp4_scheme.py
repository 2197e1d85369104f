"""NVFP4 schemes end to end: `optllm quantize --scheme nvfp4 | nvfp4a16` writes an
nvfp4-pack-quantized checkpoint (the weights compressed-tensors' own RTN gives, fused linears
sharing one global scale) that our runtime serves (CPU: the NVFP4 torch references) within a
measured bound of the float model's prompt log-probs, that a wrong scale breaks, and that
transformers (through the compressed-tensors package) loads and runs to our log-probs; the
runtime's NVFP4 linear against the references, on the CPU and on the Triton kernel (interpreter);
nvfp4 with a group size is one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from optllm import LLM, SamplingParams
from optllm.formats.args import LOCAL, QuantArgs
from optllm.kernels.nvfp4 import dequantize_nvfp4, nvfp4_linear, prepack_nvfp4
from optllm.kernels.nvfp4_format import nvfp4_global_scale, nvfp4_w4a4_linear_ref, quantize_nvfp4
from optllm.runtime.layers.linear import MergedColumnParallelLinear
from optllm.runtime.layers.linear_methods import NVFP4Method

W = QuantArgs(4, 16, type="float", strategy="tensor_group")
A = QuantArgs(4, 16, type="float", strategy="tensor_group", dynamic=LOCAL)
SCHEMES = ["nvfp4", "nvfp4a16"]
PROMPTS = [[5, 17, 250, 3, 99, 42, 7, 11, 12, 13], list(range(20, 61)), [300, 1, 300, 2] * 5]
PARAMS = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
# |log p(ours) - log p(float)| over the 70 prompt tokens of PROMPTS on the tiny llama (float32
# model). Measured: nvfp4 max 0.057 / mean 0.017, nvfp4a16 max 0.041 / mean 0.011. Every
# weight_global_scale x1.25 (weights / 1.25) gives nvfp4 0.10 / 0.031, nvfp4a16 0.12 / 0.031;
# x1.1 nvfp4 0.074 / 0.020, nvfp4a16 0.049 / 0.017; every input_global_scale x4 (group scales
# saturating at 448) 0.14 / 0.050; the two nibbles of every byte swapped 0.42 / 0.15.
BOUNDS = {"nvfp4": (0.08, 0.022), "nvfp4a16": (0.06, 0.015)}


def cli(*args):
    return subprocess.run([sys.executable, "-m", "optllm", *args], capture_output=True, text=True)


def prompt_logprobs(folder, device="cpu") -> torch.Tensor:
    outs = LLM(str(folder), device=device, num_kv_blocks=64).generate(PROMPTS, PARAMS)
    return torch.tensor([next(iter(d.values())) for o in outs for d in o.prompt_logprobs[1:]])


@pytest.fixture(scope="module")
def nvfp4_checkpoints(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    for scheme in SCHEMES:
        r = cli("quantize", str(tiny_llama), "--scheme", scheme, "--num-samples", "4", "--seq-len", "32",
                "--no-compare", "--out", str(root / scheme))
        assert r.returncode == 0, r.stderr
    return root


@pytest.mark.parametrize("scheme", SCHEMES)
def test_checkpoint_is_nvfp4_pack_quantized_and_serves_near_the_float_model(scheme, nvfp4_checkpoints, tiny_llama,
                                                                            tmp_path):
    folder = nvfp4_checkpoints / scheme
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == group["format"] == "nvfp4-pack-quantized"
    assert (group["weights"]["strategy"], group["weights"]["group_size"]) == ("tensor_group", 16)
    assert (group["input_activations"] or {}).get("dynamic") == ("local" if scheme == "nvfp4" else None)
    report = json.loads((folder / "optllm-report.json").read_text())
    assert report["scheme"] == scheme and report["vllm_loadable"] is True
    sd = load_file(folder / "model.safetensors")
    original = load_file(tiny_llama / "model.safetensors")
    p = "model.layers.0."
    q = f"{p}self_attn.q_proj"
    assert sd[f"{q}.weight_packed"].dtype == torch.uint8 and sd[f"{q}.weight_packed"].shape == (64, 32)
    assert sd[f"{q}.weight_scale"].dtype == torch.float8_e4m3fn and sd[f"{q}.weight_scale"].shape == (64, 4)
    assert sd[f"{q}.weight_global_scale"].dtype == torch.float32 and sd[f"{q}.weight_global_scale"].shape == (1,)
    assert (f"{q}.input_global_scale" in sd) == (scheme == "nvfp4") and "lm_head.weight" not in sd  # tied
    # linears fused at run time (q/k/v, gate/up) share the global scale of their common absmax;
    # o_proj and down_proj keep their own: every byte is then compressed-tensors' RTN of the weight
    for fused in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"),
                  ("self_attn.o_proj",), ("mlp.down_proj",)):
        names = [p + n for n in fused]
        g = nvfp4_global_scale(torch.stack([original[f"{n}.weight"].abs().amax() for n in names]).amax())
        for n in names:
            packed, scales, _ = quantize_nvfp4(original[f"{n}.weight"], g)
            assert torch.equal(sd[f"{n}.weight_global_scale"], g), n
            assert torch.equal(sd[f"{n}.weight_packed"], packed), n
            assert torch.equal(sd[f"{n}.weight_scale"].view(torch.uint8), scales.view(torch.uint8)), n
            if scheme == "nvfp4":  # one input, one calibrated input global scale
                assert torch.equal(sd[f"{n}.input_global_scale"], sd[f"{names[0]}.input_global_scale"]), n
    assert not torch.equal(sd[f"{q}.weight_global_scale"], sd[f"{p}self_attn.o_proj.weight_global_scale"])

    base = prompt_logprobs(tiny_llama)
    err = (prompt_logprobs(folder) - base).abs()
    max_err, mean_err = BOUNDS[scheme]
    assert err.max() < max_err and err.mean() < mean_err, (float(err.max()), float(err.mean()))
    # a wrong scale is caught: every weight global scale 25% too large
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    sd = {k: v * 1.25 if k.endswith(".weight_global_scale") else v for k, v in sd.items()}
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    err = (prompt_logprobs(bad) - base).abs()
    assert err.max() > max_err and err.mean() > mean_err


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_loads_the_checkpoint_to_our_log_probs(scheme, nvfp4_checkpoints):
    """transformers + compressed-tensors load the checkpoint with compressed-tensors' NVFP4 scheme on
    every linear; its decompression (to bf16, the dtype it hard-codes) gives our dequantized
    weights bit for bit. Run in float32 (decompressed by compressed-tensors' own dequantize in
    float32, as a bf16 weight cannot multiply float32 activations) with its own activation
    quantizer (W4A4), the model's prompt log-probs are ours within 1e-5 (measured 5e-7 / 1e-6)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from transformers import AutoModelForCausalLM

    folder = nvfp4_checkpoints / scheme
    sd = load_file(folder / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    linears = {n: m for n, m in model.named_modules() if hasattr(m, "weight_packed")}
    assert len(linears) == 14 and all(
        (m.quantization_scheme.input_activations is not None) == (scheme == "nvfp4") for m in linears.values())
    packed = {n: m.weight_packed.data.clone() for n, m in linears.items()}
    model.hf_quantizer.compressor.decompress_model(model)
    for n, m in linears.items():
        ours = dequantize_nvfp4(sd[f"{n}.weight_packed"], sd[f"{n}.weight_scale"], sd[f"{n}.weight_global_scale"],
                                torch.bfloat16)
        assert m.weight.dtype == torch.bfloat16 and torch.equal(m.weight.data, ours), n
        p = packed[n]
        m.weight.data = dequantize(unpack_fp4_from_uint8(p, p.shape[0], p.shape[1] * 2, dtype=torch.float32),
                                   m.weight_scale.float(), args=m.quantization_scheme.weights,
                                   global_scale=m.weight_global_scale, dtype=torch.float32)
    theirs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            lp = model(torch.tensor([prompt])).logits.float().log_softmax(-1)[0]
            theirs += [float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    err = (prompt_logprobs(folder) - torch.tensor(theirs)).abs().max()
    assert err < 1e-5, float(err)


def _fused_linear(w4a4: bool, backend: str, shared: bool, dtype=torch.float32):
    """A gate/up-like linear of two shards (16 + 24 rows, K = 64) loaded as the runtime's loader
    loads a checkpoint; shared: one global scale for both (as quantize writes them), else each
    its own. Returns the linear and per shard (packed, scales, global scale)."""
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(16, 64, generator=g), torch.randn(24, 64, generator=g) * 3]
    common = nvfp4_global_scale(torch.stack([w.abs().amax() for w in ws]).amax())
    shards = [quantize_nvfp4(w, common if shared else None) for w in ws]
    lin = MergedColumnParallelLinear(64, [16, 24], True, NVFP4Method(W, A if w4a4 else None, backend), dtype=dtype)
    for i, (packed, scales, gs) in enumerate(shards):
        lin.weight_loader("qweight", packed, i)
        lin.weight_loader("scales", scales, i)
        lin.weight_loader("global_scale", gs.expand(packed.shape[0]), i)
        if w4a4:  # the smaller input global scale (larger absmax) serves both
            lin.weight_loader("input_global_scale", torch.full((packed.shape[0],), 30.0 + 10 * i), i)
    lin.weight_loader("bias", torch.randn(16, generator=g), 0)
    lin.weight_loader("bias", torch.randn(24, generator=g), 1)
    lin.process_weights_after_loading()
    return lin, shards


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(2)
    return (torch.randn(5, 64, generator=g) * torch.logspace(-1, 1, 5).reshape(-1, 1)).to(dtype)


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_cpu_method_is_the_nvfp4_reference(w4a4):
    """The CPU NVFP4 linear equals the references bit for bit: W4A4 kernels.nvfp4_format's
    nvfp4_w4a4_linear_ref (input global scale = the shards' smallest), W4A16 nvfp4_linear's torch
    backend; fused shards with global scales of their own run as two runs of the same references."""
    x = _inputs()
    lin, shards = _fused_linear(w4a4, "torch", shared=True)
    packed, scales = (torch.cat([s[i] for s in shards]) for i in (0, 1))
    gs = shards[0][2]
    if w4a4:
        want = nvfp4_w4a4_linear_ref(x, packed, scales, gs, torch.tensor([30.0]), lin.bias)
    else:
        want = nvfp4_linear(x, prepack_nvfp4(packed, scales, gs), lin.bias, backend="torch")
    assert torch.equal(lin(x), want)
    assert lin.method.runs == [(0, 40)] and ("w4a4" if w4a4 else "w4a16") in lin.extra_repr()

    lin, shards = _fused_linear(w4a4, "torch", shared=False)
    assert lin.method.runs == [(0, 16), (16, 40)] and "2 global scales" in lin.extra_repr()
    if w4a4:
        want = torch.cat([nvfp4_w4a4_linear_ref(x, *s, torch.tensor([30.0])) for s in shards], -1) + lin.bias
    else:
        want = torch.cat([x @ dequantize_nvfp4(*s, torch.float32).T for s in shards], -1) + lin.bias
    torch.testing.assert_close(lin(x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shared", [True, False], ids=["one-global", "per-shard-global"])
@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_triton_method_matches_the_cpu_reference(w4a4, shared, monkeypatch):
    """The CUDA path (the NVFP4 Triton kernel, here under the interpreter, bf16 activations: W4A4
    quantized and dequantized into bf16 first) against the float32 torch reference of the same
    checkpoint tensors: within bf16 rounding of the output and the activations (measured at most
    0.47 of the bound); the kernel runs once per run of rows of one global scale."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = _inputs(torch.bfloat16)
    ref, _ = _fused_linear(w4a4, "torch", shared)
    lin, _ = _fused_linear(w4a4, "triton", shared, dtype=torch.bfloat16)
    assert any(n.startswith("nvfp4_packed_t") for n, _ in lin.named_buffers())
    want = ref(x.float())
    got = lin(x).float()
    dense = ref.dense.abs() if not w4a4 else ref.dense.abs() * ref.nvfp4_out_scale.reshape(-1, 1) * 30.0
    bound = 2.0 ** -7 * (x.float().abs() @ dense.T + ref.bias.abs()) + 1e-6
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())


def test_nvfp4_with_a_group_size_is_one_line(tiny_llama, tmp_path):
    r = cli("quantize", str(tiny_llama), "--scheme", "nvfp4", "--group-size", "64", "--no-compare",
            "--out", str(tmp_path / "q"))
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0] == ("error: scheme 'nvfp4' cannot be written as nvfp4-pack-quantized: NVFP4 weights are float "
                        "4-bit with strategy 'tensor_group' and group_size 16, not float 4-bit with strategy 'group', "
                        "group_size 64")
    assert not (tmp_path / "q").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gpu_kernel_matches_the_cpu_reference(scheme, nvfp4_checkpoints):
    """On CUDA in bf16 the checkpoint runs through the NVFP4 GEMM (W4A4: its activations
    quantized and dequantized into bf16 first): prompt log-probs near the CPU reference's in bf16.
    Bounds not yet measured on a GPU (this was written without one): set from the CPU's bf16 vs
    float32 difference, which another summation order should move by about as much (measured
    nvfp4 max 0.041 / mean 0.0096: activations near an E2M1 rounding boundary flip; nvfp4a16
    0.0021 / 0.00063). A nibble swap moves the log-probs by 0.15 on average."""
    outs = LLM(str(nvfp4_checkpoints / scheme), device="cuda", dtype="bfloat16", num_kv_blocks=64).generate(
        PROMPTS, PARAMS)
    gpu = torch.tensor([next(iter(d.values())) for o in outs for d in o.prompt_logprobs[1:]])
    outs = LLM(str(nvfp4_checkpoints / scheme), device="cpu", dtype="bfloat16", num_kv_blocks=64).generate(
        PROMPTS, PARAMS)
    cpu = torch.tensor([next(iter(d.values())) for o in outs for d in o.prompt_logprobs[1:]])
    diff = (gpu - cpu).abs()
    max_diff, mean_diff = {"nvfp4": (0.12, 0.025), "nvfp4a16": (0.02, 0.005)}[scheme]
    assert diff.mean() < mean_diff and diff.max() < max_diff, (diff.mean(), diff.max())
