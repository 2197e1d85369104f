"""The runtime against HF transformers: greedy tokens identical to `generate` for tiny random
models of every architecture, on a batch of prompts of different lengths, also with prefix-cache
hits, chunked prefill and forced preemption (float32 on CPU: the torch references of every
kernel). Bounds: tokens identical; logits within 1e-4 relative (float32 summation order)."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS

from optllm import LLM, SamplingParams

PROMPTS = [
    [5, 17, 250, 3, 99, 42, 7],
    [11, 12, 13],
    list(range(20, 61)),  # 41 tokens: more than two blocks
    [300, 1, 300, 2, 300, 3, 300, 4, 300, 5, 300, 6, 300, 7, 300, 8, 300],  # 17: one full block + 1
]
NEW = 24


def hf_greedy(folder, prompts, new=NEW):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def greedy(n=NEW, **kw):
    # min_tokens = max_tokens, as HF's min_new_tokens: both suppress EOS at every step
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, **kw)


@pytest.fixture(scope="module")
def hf_reference(tiny_models):
    return {a: hf_greedy(tiny_models[a], PROMPTS) for a in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate(arch, tiny_models, hf_reference):
    llm = LLM(tiny_models[arch], device="cpu")
    outs = llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == hf_reference[arch]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_chunked_prefill_and_prefix_cache_keep_the_tokens(arch, tiny_models, hf_reference):
    # an 8-token budget: every prompt is split into chunks and decodes are mixed into prefill steps
    llm = LLM(tiny_models[arch], device="cpu", max_num_batched_tokens=8)
    outs = llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == hf_reference[arch]
    # the same prompts again: their full prompt blocks come from the prefix cache
    again = llm.generate(PROMPTS[2:], greedy())
    assert [o.outputs[0].token_ids for o in again] == hf_reference[arch][2:]
    assert again[0].metrics.num_cached_tokens == 32  # 41-token prompt: 2 full blocks hit
    assert again[1].metrics.num_cached_tokens == 16  # 17 tokens: the block holding the last one is computed


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_forced_preemption_keeps_the_tokens(arch, tiny_models, hf_reference):
    # 9 blocks of 16 tokens for 4 sequences needing 2 + 2 + 5 + 3: someone is preempted and recomputed
    llm = LLM(tiny_models[arch], device="cpu", num_kv_blocks=9, max_model_len=80)
    outs = llm.generate(PROMPTS, greedy())
    assert [o.outputs[0].token_ids for o in outs] == hf_reference[arch]
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    bm = llm.engine.scheduler.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 9


def test_shared_prefix_in_one_batch(tiny_llama):
    base = list(range(100, 140))  # 40 tokens
    prompts = [base + [7], base + [8, 9], base]
    ref = hf_greedy(tiny_llama, prompts, new=8)
    llm = LLM(tiny_llama, device="cpu")
    first = llm.generate(prompts[:1], greedy(8))
    rest = llm.generate(prompts[1:], greedy(8))
    assert [o.outputs[0].token_ids for o in first + rest] == ref
    assert [o.metrics.num_cached_tokens for o in rest] == [32, 32]


def test_prompt_logits_match_hf(tiny_models):
    """prompt_logprobs (what eval --ppl uses) equal HF's log-softmax of the same positions."""
    from transformers import AutoModelForCausalLM

    folder = tiny_models["qwen2"]
    ids = PROMPTS[2]
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(m(torch.tensor([ids])).logits[0].double(), -1)
    llm = LLM(folder, device="cpu", max_num_batched_tokens=16)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0))[0]
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        assert abs(plp[p][ids[p]] - float(ref[p - 1, ids[p]])) < 1e-4
        top = torch.topk(ref[p - 1], 2).indices.tolist()
        assert set(top) <= set(plp[p])


def test_triton_kernels_under_the_interpreter_give_the_same_tokens(tiny_models, monkeypatch, hf_reference):
    """Every Triton kernel of the model (norm, rotary, SiLU, KV store, extend + decode
    attention) run by TRITON_INTERPRET=1 gives the greedy tokens of the torch references."""
    from optllm.kernels.common import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set for the whole test session by tests/conftest.py on CPU)")
    llm = LLM(tiny_models["mistral"], device="cpu", kernels="triton", max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS[:2], greedy(6))
    assert [o.outputs[0].token_ids for o in outs] == [r[:6] for r in hf_reference["mistral"][:2]]


@pytest.mark.model
def test_smollm2_greedy_equals_hf_generate():
    """The built-in model (real weights): a batch of chat and plain prompts of different
    lengths, with a small token budget so prefill is chunked and mixed with decodes."""
    pytest.importorskip("gguf")
    from optllm.hub.loader import resolve_model

    try:
        folder = resolve_model("smollm2-135m")
    except Exception as e:  # the package is not installed here
        pytest.skip(str(e))
    llm = LLM(folder, device="cpu", max_num_batched_tokens=48, max_model_len=512)
    tok = llm.tokenizer
    prompts = [tok("The capital of France is")["input_ids"],
               llm.chat_prompt([{"role": "user", "content": "Write a haiku about the sea."}]),
               tok("def fibonacci(n):\n    ")["input_ids"]]
    outs = llm.generate(prompts, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, prompts)
