"""The engine's request-level behaviour on a tiny model (CPU): stop strings and stop tokens,
logprobs, seeds, n completions, streaming, abort, the async engine, and errors."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from optllm import LLM, SamplingParams
from optllm.runtime.async_engine import AsyncLLMEngine

PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [11, 12, 13], list(range(20, 61))]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, device="cpu")


def greedy(n=24, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_text_is_the_incremental_decode_of_the_tokens(llm):
    for out in llm.generate(PROMPTS, greedy(40)):
        c = out.outputs[0]
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_the_text_and_ends_the_sequence(llm):
    full = llm.generate([PROMPTS[0]], greedy(40))[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.index(stop)
    out = llm.generate([PROMPTS[0]], greedy(40, stop=[stop]))[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids) and full.token_ids[: len(out.token_ids)] == out.token_ids
    kept = llm.generate([PROMPTS[0]], greedy(40, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]


def test_stop_token_id_and_max_tokens(llm):
    full = llm.generate([PROMPTS[1]], greedy(30))[0].outputs[0].token_ids
    tok = full[10]
    first = full.index(tok)
    out = llm.generate([PROMPTS[1]], greedy(30, stop_token_ids=[tok]))[0].outputs[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop" and out.stop_reason == tok
    late = llm.generate([PROMPTS[1]], greedy(30, stop_token_ids=[tok], min_tokens=first + 1))[0].outputs[0]
    assert len(late.token_ids) > first + 1  # min_tokens keeps the stop token from ending it early
    assert len(llm.generate([PROMPTS[1]], greedy(7))[0].outputs[0].token_ids) == 7


def test_logprobs_are_the_raw_distribution(llm, tiny_llama):
    from transformers import AutoModelForCausalLM

    out = llm.generate([PROMPTS[0]], greedy(5, logprobs=3))[0].outputs[0]
    m = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = PROMPTS[0] + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(m(torch.tensor([ids])).logits[0].double(), -1)
    assert len(out.logprobs) == 5
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(PROMPTS[0]) - 1 + i]
        top = torch.topk(row, 3).indices.tolist()
        assert set(entry) == set(top) | {tok} and tok == top[0]  # greedy: the sampled one is the top
        for t, lp in entry.items():
            assert abs(lp - float(row[t])) < 1e-4


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                         [SamplingParams(temperature=0.8, max_tokens=9), sp, greedy(30)])[1].outputs[0].token_ids
    assert alone == mixed
    other = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99,
                                                      ignore_eos=True))[0].outputs[0].token_ids
    assert other != alone


def test_n_completions_are_distinct_samples(llm):
    sp = dict(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    out = llm.generate([PROMPTS[2]], SamplingParams(n=3, **sp))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    single = llm.generate([PROMPTS[2]], SamplingParams(n=1, **sp))[0].outputs[0].token_ids
    assert out.outputs[0].token_ids == single


def test_stream_grows_and_ends_with_what_generate_returns(llm):
    outs = list(llm.stream(PROMPTS[2], greedy(20)))
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == llm.generate([PROMPTS[2]], greedy(20))[0].outputs[0].token_ids


def test_abort_frees_the_blocks_at_once(llm):
    eng = llm.engine
    free = eng.scheduler.block_manager.num_free_blocks
    rid = eng.add_request(PROMPTS[2], greedy(50))
    for _ in range(3):
        eng.step()
    assert eng.scheduler.block_manager.num_free_blocks < free
    out = eng.abort_request(rid)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.scheduler.block_manager.num_used_blocks == 0 and not eng.has_unfinished_requests()


def test_bad_requests_are_clear_errors(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 10_000], greedy())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], greedy())
    assert not llm.engine.has_unfinished_requests()


def test_async_engine_streams_concurrently_and_aborts_on_close(llm):
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(16))]
    engine = AsyncLLMEngine(engine=llm.engine)

    async def collect(i):
        last = None
        async for out in engine.generate(PROMPTS[i], greedy(16), request_id=f"r{i}"):
            last = out
        return last.outputs[0].token_ids

    async def leave_early():
        agen = engine.generate(PROMPTS[2], greedy(200), request_id="early")
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await agen.aclose()

    async def main():
        got = await asyncio.gather(*(collect(i) for i in range(3)), leave_early())
        for _ in range(100):  # the abort reaches the engine thread on its next turn
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        return got[:3]

    try:
        assert asyncio.run(main()) == ref
        assert llm.engine.scheduler.block_manager.num_used_blocks == 0
        with pytest.raises(ValueError, match="max_model_len"):
            asyncio.run(collect_one(engine, [1] * 10_000))
    finally:
        engine.shutdown()


async def collect_one(engine, prompt):
    async for _ in engine.generate(prompt, greedy(4), request_id="too-long"):
        pass


def test_prompt_logprobs_cover_every_prompt_token(llm):
    out = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[2])
    assert all(len(e) <= 2 and all(v <= 0 and math.isfinite(v) for v in e.values()) for e in out.prompt_logprobs[1:])
