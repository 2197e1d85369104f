"""prompt_logprobs with prompt_logprobs_start on a tiny model (CPU): lm-eval style scoring,
where requests share a long context and each wants the log-probs of its own continuation,
reuses the context's KV from the prefix cache and still gives the log-probs of a run without
any cache; None entries keep indices aligned with the prompt; chunked prefill and preemption
by recompute give the same numbers, each entry once. Bound: 1e-5 absolute (float32)."""

from __future__ import annotations

import pytest

from optllm import LLM, SamplingParams

CONTEXT = list(range(100, 145))  # 45 tokens: two full blocks of 16 and a partial one
CONTINUATIONS = [[7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18]]
PROMPTS = [CONTEXT + c for c in CONTINUATIONS]
START = len(CONTEXT)
# the log-prob of token 45 needs the logits at position 44 (block 2), so blocks 0 and 1 hit
HIT = 32
BOUND = 1e-5


def scoring(start: int = START, k: int = 1, max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, prompt_logprobs=k,
                          prompt_logprobs_start=start, detokenize=False)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list]:
    """Every prompt's full prompt_logprobs, each request alone on an engine without a prefix cache."""
    llm = LLM(tiny_llama, device="cpu", enable_prefix_caching=False)
    return [llm.generate([p], scoring(start=0))[0].prompt_logprobs for p in PROMPTS]


def assert_matches(plp: list, ref: list, start: int) -> None:
    """plp: None before start (and at 0), the reference's entries from start on, within BOUND."""
    assert len(plp) == len(ref)
    for t, (got, want) in enumerate(zip(plp, ref)):
        if t < max(start, 1):
            assert got is None, t
        else:
            assert set(got) == set(want), t
            assert max(abs(got[tok] - want[tok]) for tok in want) < BOUND, t


def test_shared_context_is_served_from_the_cache_with_the_same_logprobs(tiny_llama, reference):
    llm = LLM(tiny_llama, device="cpu")
    first = llm.generate(PROMPTS[:1], scoring())[0]
    rest = llm.generate(PROMPTS[1:], scoring())
    assert first.metrics.num_cached_tokens == 0
    assert [o.metrics.num_cached_tokens for o in rest] == [HIT, HIT]
    for out, ref in zip([first, *rest], reference):
        assert_matches(out.prompt_logprobs, ref, START)
    # the same requests with start 0 want position 1 on: no cache use at all, as before
    again = llm.generate(PROMPTS, scoring(start=0))
    assert [o.metrics.num_cached_tokens for o in again] == [0, 0, 0]
    for out, ref in zip(again, reference):
        assert_matches(out.prompt_logprobs, ref, 0)


@pytest.mark.parametrize("start, hit", [(1, 0), (16, 0), (17, 16), (33, 32), (48, 32), (49, 48), (500, 48)])
def test_none_entries_line_up_with_the_prompt(tiny_llama, reference, start, hit):
    # prompt 2 has 49 tokens; start past the prompt wants nothing: all None, and only the
    # block holding the last token is computed
    llm = LLM(tiny_llama, device="cpu")
    llm.generate(PROMPTS[2:], scoring(start=0))  # fills the cache
    out = llm.generate(PROMPTS[2:], scoring(start=start))[0]
    assert out.metrics.num_cached_tokens == hit
    assert len(out.prompt_logprobs) == len(PROMPTS[2])
    assert sum(e is None for e in out.prompt_logprobs) == min(start, len(PROMPTS[2]))
    assert_matches(out.prompt_logprobs, reference[2], start)


def test_chunked_prefill_gives_the_same_logprobs(tiny_llama, reference):
    # a 8-token budget: every prompt is split over several steps, the wanted positions too
    llm = LLM(tiny_llama, device="cpu", max_num_batched_tokens=8)
    outs = llm.generate(PROMPTS[:1], scoring()) + llm.generate(PROMPTS[1:], scoring())
    assert [o.metrics.num_cached_tokens for o in outs] == [0, HIT, HIT]
    for out, ref in zip(outs, reference):
        assert_matches(out.prompt_logprobs, ref, START)


@pytest.mark.parametrize("start", [START, 0])
def test_preemption_keeps_each_logprob_once(tiny_llama, reference, monkeypatch, start):
    # 7 blocks of 16 for three sequences of up to 74 tokens (5 blocks each): the last one is
    # preempted, also in the middle of its wanted positions, and recomputed
    llm = LLM(tiny_llama, device="cpu", num_kv_blocks=7, max_model_len=80, max_num_batched_tokens=16)
    sched = llm.engine.scheduler
    preempted, preempt = [], sched._preempt

    def spy(seq):
        preempted.append(len(seq.prompt_logprobs))
        preempt(seq)

    monkeypatch.setattr(sched, "_preempt", spy)
    outs = llm.generate(PROMPTS, scoring(start=start, max_tokens=24))
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    if start:
        # some sequence lost its KV with part of its wanted log-probs out (49 tokens, 45 None)
        assert any(START < n < len(PROMPTS[2]) for n in preempted)
    for out, ref in zip(outs, reference):
        assert_matches(out.prompt_logprobs, ref, start)
    assert sched.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("value", [-1, 1.5, "3", True, None])
def test_bad_start_is_a_clear_error(value):
    with pytest.raises(ValueError, match=r"prompt_logprobs_start=.* is not allowed; allowed: an integer >= 0"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=value)
