"""Quantized checkpoints on the runtime against transformers + compressed-tensors (the loader a
user of HF has): prompt log-probs of RTN / AWQ / GPTQ checkpoints (symmetric and asymmetric,
act-order, an untied model with biases) equal the dequantized HF model's.

Bounds (float32 on CPU, |log-prob difference| over every prompt position):
* quantized_linear="dequant": the same dequantized bits as compressed-tensors: < 1e-4
  (float32 summation order; measured ~1e-6).
* quantized_linear="kernel" (W4A16 method, its torch reference on CPU): the weights are
  (q - zero) * scale formed exactly in float32, while compressed-tensors rounds that product
  to the checkpoint's bf16 first: < 2e-2 (measured below 5e-3).
"""

from __future__ import annotations

import pytest
import torch

from optllm import LLM, SamplingParams
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import quantize
from optllm.runtime.layers.linear_methods import DequantMethod, W4A16Method

PROMPT = [5, 17, 250, 3, 99, 42, 7, 11, 12, 13, 200, 201, 202, 90, 91, 92, 93, 40, 41]

CASES = {  # id -> (arch, scheme, symmetric, actorder)
    "llama-rtn-sym": ("llama", "w4a16-rtn", True, None),
    "llama-awq-asym": ("llama", "w4a16-awq", False, None),
    "qwen2-gptq-actorder-asym": ("qwen2", "w4a16-gptq", False, "static"),
    "mistral-gptq-sym": ("mistral", "w4a16-gptq", True, None),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tiny_models, tmp_path_factory):
    arch, scheme, sym, actorder = CASES[request.param]
    out = tmp_path_factory.mktemp("ckpt") / request.param
    cfg = QuantizeConfig(scheme=scheme, group_size=32, symmetric=sym, actorder=actorder, num_samples=8, seq_len=32)
    quantize(str(tiny_models[arch]), out, cfg, progress=False)
    return out


def hf_logprobs(folder):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    try:
        cfg = CompressedTensorsConfig(dequantize=True)
    except TypeError:  # older transformers name the same switch run_compressed=False
        cfg = CompressedTensorsConfig(run_compressed=False)
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, quantization_config=cfg).eval()
    with torch.no_grad():
        return torch.log_softmax(m(torch.tensor([PROMPT])).logits[0].double(), -1)


def ours(folder, mode):
    llm = LLM(folder, device="cpu", quantized_linear=mode)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    return llm, [out.prompt_logprobs[p][PROMPT[p]] for p in range(1, len(PROMPT))]


@pytest.mark.parametrize("mode, bound", [("dequant", 1e-4), ("kernel", 2e-2)])
def test_prompt_logprobs_match_transformers_compressed_tensors(checkpoint, mode, bound):
    ref = hf_logprobs(checkpoint)
    llm, lps = ours(checkpoint, mode)
    expect = [float(ref[p - 1, PROMPT[p]]) for p in range(1, len(PROMPT))]
    diff = max(abs(a - b) for a, b in zip(lps, expect))
    assert diff < bound, diff
    methods = {type(m.method) for m in llm.engine.runner.model.modules() if hasattr(m, "method")}
    assert (W4A16Method in methods) == (mode == "kernel")
    assert (DequantMethod in methods) == (mode == "dequant")
