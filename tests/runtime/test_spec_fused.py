"""Fused speculative steps (runtime/model_runner.py ``_execute_fused``): a step that admits
requests (prefill chunks) or runs plain decodes eagerly while other sequences speculate drafts
the trees first and verifies them in the same target forward as the plain rows, the plain
sequences causal and the trees under their masks (kernels/extend_attention.py's negative mask
offsets). A plain row attending a tree, a tree row attending past its ancestors, a feature or KV
row stored at the wrong slot, or a sample read from the wrong logits row would change the
tokens: the output must equal plain greedy decoding, fused or not, on the torch references, on
the Triton kernels and through the propose graphs' CPU stand-ins."""

from __future__ import annotations

import pytest
from conftest import write_drafts

from optllm.runtime.llm import LLM
from optllm.runtime.sampling_params import SamplingParams

PROMPTS = ["The interpreter reads the configuration file and then starts to run the code it finds there",
           "def main():\n    return", "In the beginning of the module the", "x = 1\ny = 2\nz = x + y\nprint(z)",
           "a b c d e", "Once the cache is warm every request that shares the prefix skips its prefill"]
LENGTHS = (9, 30, 14, 25, 11, 20)  # staggered: requests finish, and others are admitted, mid-speculation
GREEDY = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in LENGTHS]
# three running at once, admitted one by one, prompts cut into chunks: most steps carry plain rows
BUSY = dict(max_num_seqs=3, max_num_batched_tokens=48, admit_group=1)
SPEC = dict(spec_top_k=3, spec_depth=4, spec_num_draft=10, spec_policy="fixed")


@pytest.fixture(scope="module")
def drafts(tiny_llama, tmp_path_factory):
    return write_drafts(tmp_path_factory.mktemp("drafts"), tiny_llama)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain_greedy(tiny_llama):
    return _tokens(LLM(str(tiny_llama), device="cpu", dtype="float32", **BUSY), PROMPTS, GREEDY)


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_fused_steps_equal_plain_greedy_and_the_unfused_steps(tiny_llama, drafts, plain_greedy, method):
    runs = {}
    for fuse in (True, False):
        llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts[method]), spec_fuse=fuse,
                  **BUSY, **SPEC)
        got = _tokens(llm, PROMPTS, GREEDY)
        assert got == plain_greedy, f"spec_fuse={fuse}"
        runs[fuse] = llm.engine.stats().speculation
    fused, unfused = runs[True], runs[False]
    assert fused["fused_steps"] >= 5 and unfused["fused_steps"] == 0, (fused, unfused)
    # unfused, each of those steps split: the plain rows' forward, then the trees' (the stats count them)
    assert unfused["split_steps"] >= fused["fused_steps"] and fused["split_steps"] == 0
    assert unfused["split_steps"] <= min(unfused["plain_parts"], unfused["steps"])
    # a fused step is a speculative step: the unfused engine ran its plain rows as parts of their own
    assert unfused["plain_parts"] > fused["plain_parts"]
    if method != "eagle3":  # (this test's EAGLE-3 draft is no pass-through: it proposes noise)
        assert sum(fused["histogram"][1:]) > 0  # draft tokens were accepted
    # the same drafts, accepted alike: greedy tokens would match even with the draft's inputs (the
    # plain rows' features, its KV) stored wrong, acceptance would not
    assert (fused["accepted"], fused["histogram"]) == (unfused["accepted"], unfused["histogram"])


def test_fused_steps_under_the_propose_graphs(tiny_llama, drafts, plain_greedy):
    """With graphs (CPU stand-ins) but none for prefills (cuda_graph_max_tokens 0, as for steps
    longer than those graphs take): pure speculative steps replay SpecStepGraphs, fused steps
    replay a propose graph (catch-up window, states, trees) and verify eagerly with the plain
    rows; batches pad to their buckets."""
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts["eagle"]),
              **(BUSY | {"max_num_seqs": 4}), **SPEC, cuda_graph_max_tokens=0)
    r = llm.engine.runner
    r.make_graphs(4, eager_stand_in=True)
    proposed: list[int] = []
    run = r.spec.graphs.run_propose_seqs

    def counted(seqs, n):
        proposed.append(len(seqs))
        tree, ranks = run(seqs, n)
        assert tree.tokens.shape == (len(seqs), n) and ranks.shape == (len(seqs), n)
        return tree, ranks

    r.spec.graphs.run_propose_seqs = counted
    assert _tokens(llm, PROMPTS, GREEDY) == plain_greedy
    st = llm.engine.stats().speculation
    assert len(proposed) == st["fused_steps"] >= 5
    assert 3 in proposed  # a batch of 3 padded to bucket 4


def test_plain_rows_a_graph_takes_are_not_fused(tiny_llama, drafts, plain_greedy):
    """With prefill graphs (CPU stand-ins), the plain rows of a step with speculating sequences
    replay an extend graph, then the speculative step its own graph: two replays instead of one
    eager forward (on the H200 an eager step of this model costs ~12 ms, the two graphs ~2-3 ms).
    Tokens equal plain greedy decoding; drafts accepted as in the fused engine."""
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts["eagle"]),
              **(BUSY | {"max_num_seqs": 4}), **SPEC)
    r = llm.engine.runner
    r.make_graphs(4, eager_stand_in=True)
    extend: list[int] = []
    replay = r.extend_graphs.replay

    def counted(hb, *temps):
        extend.append(len(hb.ids))
        return replay(hb, *temps)

    r.extend_graphs.replay = counted
    assert _tokens(llm, PROMPTS, GREEDY) == plain_greedy
    st = llm.engine.stats().speculation
    assert st["fused_steps"] == 0 and st["plain_parts"] >= len(extend) >= 5, (st, extend)
    assert 5 <= st["split_steps"] <= st["plain_parts"]  # (each such step: two replays, a split step)
    assert sum(st["histogram"][1:]) > 0


def test_fused_plain_rows_keep_prompt_logprobs_seeded_samples_and_logprobs(tiny_llama, drafts):
    """The plain rows of fused steps as an ordinary step makes them: prompt log-probs of a request
    admitted while others speculate, a seeded sampled request (never speculates: it decodes as a
    plain row beside the trees), and a greedy request's log-probs."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in LENGTHS]
    params[3] = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True, prompt_logprobs=2)
    params[1] = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
    params[5] = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    plain = LLM(str(tiny_llama), device="cpu", dtype="float32", **BUSY).generate(PROMPTS, params)
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts["eagle"]), **BUSY, **SPEC)
    spec = llm.generate(PROMPTS, params)
    assert llm.engine.stats().speculation["fused_steps"] >= 5
    for a, b in zip(plain, spec):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for want, got in ((a.prompt_logprobs, b.prompt_logprobs), (a.outputs[0].logprobs, b.outputs[0].logprobs)):
            assert (want is None) == (got is None)
            for ew, eg in zip(want or [], got or []):
                assert (ew is None) == (eg is None)
                if ew is not None:
                    assert list(eg) == list(ew)
                    assert all(eg[t] == pytest.approx(ew[t], abs=1e-4) for t in ew)
    assert spec[3].prompt_logprobs is not None and len(spec[3].prompt_logprobs) == len(spec[3].prompt_token_ids)


def test_fused_steps_on_the_triton_kernels(tiny_llama, drafts):
    """kernels="triton" (the interpreter): the fused forward's attention is the extend kernel with
    causal and tree-masked sequences in one launch."""
    prompts, params = PROMPTS[:3], [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 8, 6)]
    kw = dict(max_num_seqs=2, max_num_batched_tokens=32, admit_group=1, kernels="triton")
    want = _tokens(LLM(str(tiny_llama), device="cpu", dtype="float32", **kw), prompts, params)
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts["eagle"]), spec_top_k=2,
              spec_depth=2, spec_num_draft=3, spec_policy="fixed", **kw)
    assert _tokens(llm, prompts, params) == want
    assert llm.engine.stats().speculation["fused_steps"] >= 1


def test_step_graphs_on_the_triton_kernels(tiny_llama, drafts):
    """kernels="triton" under the step graphs (CPU stand-ins): a graphed step's inputs are slices
    of its static buffers (the roots: the last column of the token window), which the growth,
    slot and acceptance kernels read as they are."""
    prompts, params = PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 6)]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, kernels="triton")
    want = _tokens(LLM(str(tiny_llama), device="cpu", dtype="float32", **kw), prompts, params)
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts["eagle"]), spec_top_k=2,
              spec_depth=3, spec_num_draft=5, spec_policy="fixed", **kw)
    r = llm.engine.runner
    r.make_graphs(4, eager_stand_in=True)
    replayed: list[int] = []
    run = r.spec.graphs.run_seqs

    def counted(seqs, n, temps=None):
        replayed.append(len(seqs))
        return run(seqs, n, temps)

    r.spec.graphs.run_seqs = counted
    assert _tokens(llm, prompts, params) == want
    assert replayed and sum(llm.engine.stats().speculation["histogram"][1:]) > 0
