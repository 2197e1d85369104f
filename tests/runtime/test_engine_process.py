"""ProcessEngine (runtime/engine_process.py): the engine in a child process sends only what is
new per step, and the server side rebuilds the same cumulative outputs AsyncLLMEngine gives."""

from __future__ import annotations

import asyncio
import copy

import pytest

from optllm.errors import UserError
from optllm.runtime.config import EngineConfig
from optllm.runtime.engine_process import ProcessEngine, _delta
from optllm.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from optllm.runtime.sampling_params import SamplingParams


def _out(texts, tokens, lps, finish, finished, plp=None):
    comps = [CompletionOutput(i, t, list(ids), f, None, None if lp is None else list(lp))
             for i, (t, ids, lp, f) in enumerate(zip(texts, tokens, lps, finish))]
    return RequestOutput("r", "the prompt", [5, 6, 7], comps, finished, plp, RequestMetrics(1.0, 2.0))


def test_deltas_rebuild_the_cumulative_outputs_exactly():
    """Two completions growing at different rates, log-probs on one, a text that changes behind
    its end (an incomplete character replaced), a stop reason, prompt log-probs: the rebuilt
    output equals the engine's at every step, and the deltas carry no old tokens."""
    steps = [
        _out(["a", ""], [[1], []], [[{1: -0.1}], None], [None, None], False, [None, {6: -1.0}, {7: -2.0}]),
        _out(["ab\ufffd", "x"], [[1, 2], [9]], [[{1: -0.1}, {2: -0.2}], None], [None, None], False,
             [None, {6: -1.0}, {7: -2.0}]),
        _out(["abc d", "x"], [[1, 2, 3], [9]], [[{1: -0.1}, {2: -0.2}, {3: -0.3}], None], [None, None], False,
             [None, {6: -1.0}, {7: -2.0}]),
        _out(["abc de", "xy"], [[1, 2, 3, 4], [9, 8]], [[{1: -0.1}, {2: -0.2}, {3: -0.3}, {4: -0.4}], None],
             ["length", "stop"], True, [None, {6: -1.0}, {7: -2.0}]),
    ]
    steps[-1].outputs[1].stop_reason = "z"
    steps[-1].metrics.finished_time = 3.0
    sent: dict = {}
    side = ProcessEngine.__new__(ProcessEngine)
    side._accs = {}
    for k, out in enumerate(steps):
        d = _delta(copy.deepcopy(out), sent)
        if k:
            assert d[2] is None  # the prompt went with the first delta only
            assert all(len(c[1]) <= 1 for c in d[3])  # one new token per completion per step here
        got = side._rebuild(d)
        assert [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in got.outputs] == \
               [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in out.outputs]
        assert (got.request_id, got.prompt, got.prompt_token_ids, got.finished, got.prompt_logprobs) == \
               (out.request_id, out.prompt, out.prompt_token_ids, out.finished, out.prompt_logprobs)
    assert got.metrics.finished_time == 3.0
    assert sent == {} and side._accs == {}  # both sides forget a finished request


def test_the_text_resent_from_where_it_changed():
    sent: dict = {}
    _delta(_out(["ab\ufffd"], [[1]], [None], [None], False), sent)
    d = _delta(_out(["abc"], [[1, 2]], [None], [None], False), sent)
    (_, tokens, text_from, text, *_rest) = d[3][0]
    assert tokens == [2] and text_from == 0 and text == "abc"


def test_process_engine_generates_what_llm_generate_does(tiny_llama):
    from optllm import LLM

    prompts = ["The python language", "def main():", "In the beginning"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    want = LLM(tiny_llama, device="cpu").generate(prompts, params)
    engine = ProcessEngine(EngineConfig(model=str(tiny_llama), device="cpu", max_model_len=64))
    try:
        assert engine.max_model_len == 64 and engine.alive
        assert engine.tokenizer("def main():")["input_ids"] == want[1].prompt_token_ids

        async def run():
            async def one(i, p):
                last = None
                async for out in engine.generate(p, params, f"req-{i}"):
                    last = out
                return last

            got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            with pytest.raises(ValueError, match="max_model_len"):
                await engine.add_request("word " * 200, params, "too-long")
            with pytest.raises(ValueError, match="already in use"):
                stream = await engine.add_request("hello", SamplingParams(max_tokens=50, ignore_eos=True), "dup")
                await engine.add_request("hello", params, "dup")
            stream.close()  # aborts it: its blocks come back
            for _ in range(100):
                await asyncio.sleep(0.05)
                if engine.stats().num_free_blocks == engine.stats().num_blocks and engine.stats().num_running == 0:
                    break
            return got

        got = asyncio.run(run())
        for g, w in zip(got, want):
            assert g.finished and g.prompt_token_ids == w.prompt_token_ids
            assert g.outputs[0].text == w.outputs[0].text and g.outputs[0].token_ids == w.outputs[0].token_ids
            (gl, wl) = (g.outputs[0].logprobs, w.outputs[0].logprobs)
            assert [d.keys() for d in gl] == [d.keys() for d in wl]
            assert [v for d in gl for v in d.values()] == pytest.approx([v for d in wl for v in d.values()], abs=1e-5)
        s = engine.stats()
        assert s.num_running == 0 and s.num_waiting == 0
    finally:
        engine.shutdown(10)
    assert not engine._proc.is_alive() and engine._proc.exitcode == 0


def test_a_model_that_does_not_load_is_one_user_error(tmp_path):
    with pytest.raises(UserError):
        ProcessEngine(EngineConfig(model=str(tmp_path / "nowhere"), device="cpu"))
