"""Speculative decoding in the engine (runtime/spec_runner.py): the same tokens as ordinary
decoding under greedy, for Medusa (static tree) and EAGLE (dynamic tree) drafts, batched,
with preemption, prefix-cache hits and stop rules; the draft's bookkeeping exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import hf_float32 as _hf
from conftest import read_eagle3, write_draft

from optllm.errors import UserError
from optllm.runtime.llm import LLM
from optllm.runtime.sampling_params import SamplingParams

PROMPTS = ["The interpreter reads", "def main():\n    return", "In the beginning of the module the", "x = 1\ny"]


@pytest.fixture(scope="module")
def drafts(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {m: write_draft(root / m, tiny_llama, m) for m in ("medusa", "eagle")}


def _run(model, prompts, params, **kw):
    llm = LLM(str(model), device="cpu", dtype="float32", **kw)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], llm


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _stepped_engine(model, draft, num_draft: int, max_tokens: int, steps: int, kernels: str = "auto",
                    top_k: int = 3):
    """An engine with an EAGLE-type draft (top-k top_k, default 3, depth 3, 16-token steps: prompts
    arrive in chunks) after `steps` steps of greedy requests for PROMPTS, mid-generation."""
    eng = LLM(str(model), device="cpu", dtype="float32", draft=str(draft), spec_top_k=top_k, spec_depth=3,
              spec_num_draft=num_draft, max_num_batched_tokens=16, kernels=kernels).engine
    for p in PROMPTS:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    for _ in range(steps):
        eng.step()
    return eng


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_speculative_greedy_equals_plain_greedy(tiny_llama, drafts, method):
    want, _ = _run(tiny_llama, PROMPTS, GREEDY)
    got, llm = _run(tiny_llama, PROMPTS, GREEDY, draft=str(drafts[method]), spec_top_k=3, spec_depth=4,
                    spec_num_draft=10)
    assert got == want
    st = llm.engine.stats().speculation
    assert st["seq_steps"] > 0 and st["drafted"] > 0
    # the multi-token path ran: some steps accepted draft tokens
    assert sum(st["histogram"][1:]) > 0, st
    assert st["mean_accepted_length"] > 1.0


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_speculative_greedy_with_preemption_prefix_hits_and_chunked_prefill(tiny_llama, drafts, method):
    """A KV cache too small for the batch (preemptions by recompute), prompts sharing a prefix
    of whole blocks (prefix-cache hits), and a step budget that chunks the prompts."""
    shared = "The module reads the configuration file and then the interpreter starts to run the code " * 2
    prompts = [shared + p for p in PROMPTS] + PROMPTS
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kw = dict(num_kv_blocks=24, block_size=8, max_num_batched_tokens=64, max_model_len=192)
    want, plain = _run(tiny_llama, prompts, params, **kw)
    got, llm = _run(tiny_llama, prompts, params, draft=str(drafts[method]), spec_top_k=3, spec_depth=4,
                    spec_num_draft=10, **kw)
    assert got == want
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and plain.engine.scheduler.num_preemptions > 0
    assert sched.block_manager.num_hit_tokens > 0
    assert sum(llm.engine.stats().speculation["histogram"][1:]) > 0
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks  # everything given back


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_speculative_stops_where_plain_decoding_stops(tiny_llama, drafts, method):
    """max_tokens, a stop token id and a stop string that a multi-token step overshoots: the
    tokens, text and finish reasons equal the ordinary decode's."""
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(str(tiny_llama), device="cpu", dtype="float32").generate(PROMPTS, free)
    params = []
    for o in ref:
        ids, text = o.outputs[0].token_ids, o.outputs[0].text
        stop_tok = ids[len(ids) // 2]
        word = text[len(text) // 2: len(text) // 2 + 3]
        params += [SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_tok]),
                   SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[word] if word.strip() else None)]
    prompts = [p for p in PROMPTS for _ in range(3)]
    plain = LLM(str(tiny_llama), device="cpu", dtype="float32").generate(prompts, params)
    spec = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts[method]), spec_top_k=3,
               spec_depth=4, spec_num_draft=10).generate(prompts, params)
    for a, b in zip(plain, spec):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (x.token_ids, x.text, x.finish_reason,
                                                                         x.stop_reason)


def test_speculative_logprobs_equal_plain_logprobs(tiny_llama, drafts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    plain = LLM(str(tiny_llama), device="cpu", dtype="float32").generate(PROMPTS, params)
    spec = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts["medusa"])).generate(PROMPTS, params)
    for a, b in zip(plain, spec):
        x, y = a.outputs[0], b.outputs[0]
        assert y.token_ids == x.token_ids and len(y.logprobs) == len(x.logprobs) == 24
        for ex, ey in zip(x.logprobs, y.logprobs):
            assert list(ey) == list(ex)  # same token, same top-3 in the same order
            for t in ex:
                assert ey[t] == pytest.approx(ex[t], abs=1e-4)


def test_speculative_sampling_keeps_the_target_distribution(tiny_llama, drafts):
    """Temperature 1, top_k 2, three tokens per completion: the first from the ordinary step,
    the next two from speculative steps (rejection sampling over the tree). The joint counts of
    the 8 possible continuations over 900 completions against the exact top-2 distribution of
    the HF model: chi-square with 7 degrees of freedom, rejected at p < 0.001 (critical value
    24.32), so an honest sampler fails this test once in a thousand runs; its seed is fixed."""
    hf = _hf(tiny_llama)
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts["eagle"]), spec_top_k=2,
              spec_depth=3, spec_num_draft=4, seed=1)
    prompt = llm.tokenizer("The interpreter reads")["input_ids"]
    n = 900
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=3, ignore_eos=True, n=n)
    out = llm.generate([prompt], params)[0]
    counts: dict[tuple, int] = {}
    for c in out.outputs:
        counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1
    st = llm.engine.stats().speculation
    assert st["seq_steps"] >= n and sum(st["histogram"][1:]) > 0  # speculative steps ran and accepted

    def top2(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        v, i = torch.topk(logits, 2)
        return list(zip(i.tolist(), torch.softmax(v, -1).tolist()))

    expected = {}
    for a, pa in top2(prompt):
        for b, pb in top2(prompt + [a]):
            for c, pc in top2(prompt + [a, b]):
                expected[(a, b, c)] = pa * pb * pc * n
    assert set(counts) <= set(expected)
    chi2 = sum((counts.get(k, 0) - e) ** 2 / e for k, e in expected.items())
    assert chi2 < 24.32, (chi2, counts, expected)


def test_eagle_draft_state_and_cache_follow_the_sequence(tiny_llama, tmp_path):
    """With a random (untrained) EAGLE layer, the draft state the engine keeps after several
    speculative steps equals the training module's output at the last computed position over the
    whole sequence (features from HF's last hidden states): the draft's paged KV for every
    earlier position was written right, by prefill chunks, catch-ups and recomputes alike."""
    from safetensors.torch import load_file

    from optllm.speculative.eagle import EagleDraft
    from optllm.speculative.target import last_hidden

    folder = write_draft(tmp_path / "eagle", tiny_llama, "eagle", seed=3, noise=0.3)
    eng = _stepped_engine(tiny_llama, folder, num_draft=6, max_tokens=60, steps=12)
    hf = _hf(tiny_llama)
    ref = EagleDraft.from_target(hf)
    ref.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    seqs = [s for s in eng.scheduler.running if s.num_output_tokens > 2]
    assert seqs and eng.stats().speculation["steps"] > 0
    states = eng.runner.spec.states(seqs)  # the draft over the rows it has not seen yet
    for s, state in zip(seqs, states):
        c = s.num_computed_tokens
        ids = torch.tensor([s.token_ids[: c + 1]])
        feats = last_hidden(hf, ids[:, :c])
        with torch.no_grad():
            pred, _ = ref(feats, ids[:, 1:c + 1])
        err = (state - pred[0, -1]).abs().max()
        assert torch.allclose(state, pred[0, -1], atol=1e-4, rtol=1e-4), (s, err)


def test_catch_up_rows_are_padded_to_few_sizes():
    from optllm.runtime.spec_runner import catch_up_rows

    sizes = set()
    for r in range(1, 5000):
        p = catch_up_rows(r)
        assert r <= p <= max(r + 15, r * 9 // 8), (r, p)
        sizes.add(p)
    assert catch_up_rows(543) == 576 and catch_up_rows(2720) == 2816 and catch_up_rows(128) == 128
    assert len(sizes) <= 64  # up to 5000 rows: 8 sizes to 128, then eight an octave


def test_a_padded_catch_up_equals_an_unpadded_one(tiny_llama, tmp_path, monkeypatch):
    """The draft run again over every row of running sequences (their catch-up from position 0):
    padded to catch_up_rows (pad rows in the padding block) and not, the same states and the same
    draft KV in every block a sequence owns; the pads wrote only the padding block."""
    from optllm.runtime import spec_runner

    folder = write_draft(tmp_path / "eagle", tiny_llama, "eagle", seed=3, noise=0.3)
    eng = _stepped_engine(tiny_llama, folder, num_draft=6, max_tokens=60, steps=12)
    spec = eng.runner.spec
    seqs = [s for s in eng.scheduler.running if s.num_output_tokens > 2]
    rows = sum(s.num_computed_tokens for s in seqs)
    assert seqs and spec_runner.catch_up_rows(rows) > rows  # (the case pads)
    pad = eng.runner.num_blocks  # the padding block

    def again(padded: bool):
        for s in seqs:
            s.spec_state = (s.num_preemptions, 0)
        with monkeypatch.context() as m:
            if not padded:
                m.setattr(spec_runner, "catch_up_rows", lambda r: r)
            states = spec.states(seqs)
        return states, spec.draft_kv.k[:, :pad].clone(), spec.draft_kv.v[:, :pad].clone()

    plain, padded = again(False), again(True)
    for a, b in zip(plain, padded):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_medusa_state_is_the_targets_last_hidden_state(tiny_llama, drafts):
    from optllm.speculative.target import last_hidden

    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts["medusa"]))
    eng = llm.engine
    for p in PROMPTS:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(6):
        eng.step()
    hf = _hf(tiny_llama)
    seqs = list(eng.scheduler.running)
    for s, state in zip(seqs, eng.runner.spec.states(seqs)):
        c = s.num_computed_tokens
        want = last_hidden(hf, torch.tensor([s.token_ids[:c]]))[0, -1]
        assert torch.allclose(state, want, atol=1e-4, rtol=1e-4)


def test_bad_drafts_are_one_line(tiny_llama, drafts, tmp_path, caplog):
    with pytest.raises(UserError, match="not a draft folder"):
        LLM(str(tiny_llama), device="cpu", draft=str(tmp_path))
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("model.safetensors", "config.json"):
        (bad / f).write_bytes((drafts["medusa"] / f).read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps([cfg]))
    with pytest.raises(UserError, match="config.json is not a JSON object"):
        LLM(str(tiny_llama), device="cpu", draft=str(bad))
    (bad / "config.json").write_text(json.dumps({**cfg, "method": "lookahead"}))
    with pytest.raises(UserError, match="method 'lookahead' is not supported"):
        LLM(str(tiny_llama), device="cpu", draft=str(bad))
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(UserError, match="hidden_size=32"):
        LLM(str(tiny_llama), device="cpu", draft=str(bad))
    (bad / "config.json").write_text(json.dumps({**cfg, "target": {"model": "x", "sha256": "0" * 64}}))
    with caplog.at_level("WARNING", logger="optllm.runtime"):
        LLM(str(tiny_llama), device="cpu", draft=str(bad))
    assert "trained for another target" in caplog.text


@pytest.mark.model
@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_smollm2_speculative_greedy_equals_plain_greedy(method, tmp_path):
    """The built-in model (real weights), a chat and a plain prompt, prefill chunked (a fused step:
    one prompt's tree beside the other's chunk); small trees (on CPU a verify costs its tokens, so
    this stays a correctness test)."""
    pytest.importorskip("gguf")
    from optllm.hub.loader import resolve_model

    try:
        folder = resolve_model("smollm2-135m")
    except Exception as e:  # the package is not installed here
        pytest.skip(str(e))
    draft = write_draft(tmp_path / method, folder, method)
    kw = dict(device="cpu", max_num_batched_tokens=32, max_model_len=512)
    plain = LLM(folder, **kw)
    prompts = [plain.tokenizer("def fibonacci(n):\n    ")["input_ids"],
               plain.chat_prompt([{"role": "user", "content": "Write a haiku about the sea."}])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    spec = LLM(folder, draft=str(draft), spec_top_k=2, spec_depth=3, spec_num_draft=5, **kw)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    st = spec.engine.stats().speculation
    # the first prompt's first speculative step verifies its tree beside the chat prompt's last chunk
    assert st["seq_steps"] > 0 and st["fused_steps"] >= 1, st


@pytest.mark.parametrize("draft_vocab", [None, 150])
def test_eagle3_greedy_equals_plain_and_its_state_follows_the_sequence(tiny_llama, tmp_path, draft_vocab):
    """An EAGLE-3 draft (fused features of the target's layer inputs, its own LM head, here also
    over a reduced vocabulary mapped into the target's): greedy output unchanged, and after many
    steps the logits the engine drafts from equal the training module's over the whole sequence."""
    from optllm.speculative.eagle3 import eagle3_features

    folder = write_draft(tmp_path / "e3", tiny_llama, "eagle3", seed=2, noise=0.3, draft_vocab=draft_vocab)
    want, _ = _run(tiny_llama, PROMPTS, GREEDY)
    got, llm = _run(tiny_llama, PROMPTS, GREEDY, draft=str(folder), spec_top_k=3, spec_depth=3, spec_num_draft=8)
    assert got == want and llm.engine.stats().speculation["seq_steps"] > 0

    eng = _stepped_engine(tiny_llama, folder, num_draft=8, max_tokens=40, steps=10)
    hf = _hf(tiny_llama)
    ref = read_eagle3(folder, hf, draft_vocab)
    draft = eng.runner.spec.draft
    seqs = [s for s in eng.scheduler.running if s.num_output_tokens > 2]
    assert seqs and eng.stats().speculation["steps"] > 0
    for s, state in zip(seqs, eng.runner.spec.states(seqs)):
        c = s.num_computed_tokens
        ids = torch.tensor([s.token_ids[: c + 1]])
        with torch.no_grad():
            aux = eagle3_features(hf, ids[:, :c], None, ref.aux_layers)
            want_lg = ref.ttt(aux, ids[:, 1:c + 1], 1)[0][0, -1]
            got_lg = draft.logits(state[None])[0]
        kept = ref.d2t + torch.arange(ref.draft_vocab_size)
        torch.testing.assert_close(got_lg[kept], want_lg, rtol=1e-4, atol=1e-4)
        if draft_vocab:
            assert torch.isinf(got_lg).sum() == hf.config.vocab_size - draft_vocab
        # what the trees read: the top-k of the log-softmax over the target's vocabulary
        vals, ids = draft.ranked(state[None], 3)
        want_lp = torch.log_softmax(got_lg.float(), dim=-1)
        assert torch.equal(ids[0], torch.topk(want_lp, 3).indices)
        torch.testing.assert_close(vals[0], want_lp[ids[0]], rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_speculative_greedy_on_the_triton_kernels(tiny_llama, drafts, method):
    """kernels="triton" (the interpreter here, a GPU's path): each draft level ranked by
    kernels/topk.py, the EAGLE trees grown by kernels/tree_grow.py, Medusa's shared
    static structure: the output is plain greedy decoding's."""
    short = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want, _ = _run(tiny_llama, PROMPTS[:2], short, kernels="triton")
    got, llm = _run(tiny_llama, PROMPTS[:2], short, kernels="triton", draft=str(drafts[method]), spec_top_k=3,
                    spec_depth=3, spec_num_draft=6)
    assert got == want
    st = llm.engine.stats().speculation
    assert st["seq_steps"] > 0 and sum(st["histogram"][1:]) > 0, st


def test_eligible_decodes_is_eligible_per_decode(tiny_llama, drafts):
    """plan()'s one-loop scan picks exactly the decodes ``eligible`` allows: not penalties, not a
    per-request seed under sampling, not inside min_tokens, not without room for the tree, not a
    prefill."""
    from optllm.runtime.sequence import Sequence

    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(drafts["eagle"]), spec_top_k=2,
              spec_depth=2, spec_num_draft=3, max_model_len=64)
    spec = llm.engine.runner.spec
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, seed=3),
             SamplingParams(temperature=0, seed=3), SamplingParams(temperature=0, repetition_penalty=1.2),
             SamplingParams(temperature=0, min_tokens=5)]
    running = []
    for i, p in enumerate(kinds * 3):
        s = Sequence(f"r{i}", list(range(1, 6 + i)), p)
        s.token_ids += [7] * (i % 4)  # outputs so far
        s.num_computed_tokens = len(s.token_ids) - (1 if i % 5 else 2)  # every fifth: two tokens to compute
        running.append(s)
    running[-1].token_ids += [7] * 40  # no room for the tree under max_model_len
    running[-1].num_computed_tokens = len(running[-1].token_ids) - 1
    want = [s for s in running if len(s.token_ids) - s.num_computed_tokens == 1 and spec.eligible(s)]
    got = spec.eligible_decodes(running)
    assert got == want and 0 < len(got) < len(running)
    # plan()'s scan: the same sequences, their ids and rows behind (the draft's progress and preemptions)
    for i, s in enumerate(running):
        s.spec_state = None if i % 3 == 0 else (s.num_preemptions + (i % 3 == 2), i)
    seqs, ids, behind, sampled, rest, _ = spec._scan(running)
    assert sampled and spec._scan([s for s in running if s.params.temperature == 0])[3] is False
    ref = sum(max(s.num_computed_tokens - spec._upto(s) - spec.catch_rows, 0) for s in want)
    assert seqs == want and ids == [s.seq_id for s in want] and behind == spec.rows_behind(want) == ref > 0
    # the other decodes (they would run plain beside a speculative step): counted, prefills not
    decodes = [s for s in running if len(s.token_ids) - s.num_computed_tokens == 1]
    assert rest == len(decodes) - len(want) > 0


def _propose_recomputing_every_level(spec, roots, states, ctx, tables, n):
    """The EAGLE-2 growth as runtime/spec_runner.py ran it before each level ran only its own rows:
    level d reran all d * k scratch rows under the square ancestor mask (the reference), the
    pool's bookkeeping on kernels/tree_grow.py's torch references. Returns the selected Tree."""
    from optllm.kernels.spec_slots import step_slots_ref
    from optllm.kernels.tree_grow import grow, new_pool, select
    from optllm.runtime.layers.attention import AttentionMetadata

    k, bs, bsz = spec.options.top_k, spec.block_size, roots.shape[0]
    depth = spec.tree_depth(n)
    rows = (depth - 1) * k
    pool = new_pool(bsz, k, depth, "cpu")
    lp, ids = spec.draft.ranked(states, k)
    front = grow(pool, 1, lp[:, None], ids[:, None], states[:, None], roots=roots, backend="torch")
    slots = step_slots_ref(tables, ctx, 0, rows, bs).slots
    full = torch.eye(rows, dtype=torch.bool).expand(bsz, rows, rows).clone()
    feats, toks, prev, prev_ids = [], [], None, None
    for d in range(1, depth):
        m = d * k
        if d == 1:
            feats.append(states[:, None, :].expand(bsz, k, states.shape[-1]))
        else:  # each frontier node's parent, as an index into the previous frontier
            j = (pool.parents.gather(1, front.ids)[:, :, None] == prev_ids[:, None, :]).int().argmax(dim=2)
            feats.append(prev.gather(1, j[:, :, None].expand(bsz, k, prev.shape[-1])))
            full[:, m - k:m, :m - k] = full[:, :m - k, :m - k].gather(1, ((d - 2) * k + j)[:, :, None].expand(
                bsz, k, m - k))
        toks.append(front.tokens)
        meta = AttentionMetadata(
            slot_mapping=slots[:, :m].reshape(-1), block_tables=tables, seq_lens=(ctx + m).to(torch.int32),
            decode=False, cu_seqlens_q=torch.arange(bsz + 1, dtype=torch.int32) * m, max_seqlen_q=m,
            mask=full[:, :m, :m].reshape(-1), mask_offsets=torch.arange(bsz) * m * m)
        pos = (ctx[:, None] + torch.arange(m)[None, :] // k).reshape(-1)
        out = spec.draft(torch.cat(feats, 1).reshape(bsz * m, -1), torch.cat(toks, 1).reshape(-1), pos, meta)
        out = out.view(bsz, m, -1)[:, m - k:]
        lp, ids = spec.draft.ranked(out.reshape(bsz * k, -1), k)
        prev, prev_ids = out, front.ids
        front = grow(pool, 1 + k + (d - 1) * k * k, lp.view(bsz, k, k), ids.view(bsz, k, k), out, front=front,
                     last=d == depth - 1, backend="torch")
    return select(pool, n, depth, backend="torch")


def _running_decodes(eng):
    """A stepped engine's running decodes past their first output token (at least two), each given
    blocks for the draft's scratch rows as the scheduler gives a speculative decode: (spec, seqs,
    roots, ctx, tables)."""
    spec = eng.runner.spec
    seqs = [s for s in eng.scheduler.running if s.num_output_tokens > 1]
    assert len(seqs) >= 2
    for s in seqs:
        assert eng.scheduler.block_manager.allocate(s, 1, lookahead=spec.lookahead)
    ctx, tables = spec._context(seqs)
    return spec, seqs, spec._roots(seqs), ctx, tables


def _grow_one_tree(eng, kernels: str):
    """A stepped engine's running decodes (past their first output token) and one EAGLE-2 proposal for
    them, as a speculative step makes it: (spec, seqs, roots, states, ctx, tables, the proposed
    TreeBatch, the selection kernels/tree_grow.select returned: its scores)."""
    import optllm.runtime.spec_runner as spec_runner

    spec, seqs, roots, ctx, tables = _running_decodes(eng)
    assert spec.tree_depth(spec.n) == 3 and spec.runner.backend == kernels
    selected, select = [], spec_runner.select

    def keep(*a, **kw):
        selected.append(select(*a, **kw))
        return selected[-1]

    with torch.inference_mode():
        states = spec.states(seqs)
        spec_runner.select = keep
        try:
            got, _ = spec._propose(roots, states, ctx, tables, spec.n)
        finally:
            spec_runner.select = select
    return spec, seqs, roots, states, ctx, tables, got, selected[0]


@pytest.mark.parametrize(("kernels", "method"), [("torch", "eagle"), ("triton", "eagle"), ("torch", "eagle3"),
                                                 ("triton", "eagle3")])
def test_eagle_levels_run_only_their_rows_and_propose_what_rerunning_every_row_proposed(tiny_llama, tmp_path, kernels,
                                                                                        method):
    """Each EAGLE-2 level runs the draft over its k frontier rows only, their keys the context and
    the scratch rows of earlier levels under the ancestor mask (the extend kernel's mask_cols):
    the trees, their scores and every level's ranked log-probs equal the old growth's, which
    reran all d * k rows each level. A random EAGLE layer (its attention matters), batch 4; on the
    torch references and on the Triton kernels (kernels/tree_grow.py builds the masks and features).
    EAGLE-3's levels run forward_ranked (the rotary and KV store in one kernel, the last residual add
    in the final norm's launch); the reference, forward then ranked."""
    folder = write_draft(tmp_path / method, tiny_llama, method, seed=5, noise=0.5)
    eng = _stepped_engine(tiny_llama, folder, num_draft=20, max_tokens=60, steps=10, kernels=kernels)
    spec, _, roots, states, ctx, tables, got, selected = _grow_one_tree(eng, kernels)
    with torch.inference_mode():
        want = _propose_recomputing_every_level(spec, roots, states, ctx, tables, spec.n)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    assert int(got.depths.max()) == 3  # the deepest level's rows attended two levels above
    torch.testing.assert_close(selected.scores, want.scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kernels", "method", "flat"), [("torch", "eagle", False), ("triton", "eagle3", False),
                                                         ("torch", "eagle3", True)])
def test_small_trees_expand_no_wider_than_they_keep_and_grow_the_same_tree(tiny_llama, tmp_path, kernels, method, flat,
                                                                          monkeypatch):
    """A tree of n nodes keeps n - 1 candidates, so its levels expand min(top_k, n - 1) frontier
    nodes of min(top_k, n - 1) children each (``tree_width``): the same tokens, parents and ranks as
    growing it top_k wide, at every size (top-k 6, depth 3: 21, 10, 5 and 2 nodes), with fewer
    draft rows where n - 1 < top_k (the pool of 5 nodes: 1 + 4 + 2 * 16 candidates, not 1 + 6 + 2 * 36).
    flat: every draft log-prob made about -1 (a level costs more than any choice within it), so the
    trees are stars: a tree of 5 nodes keeps the root's 4 best children, which a width of 3 misses."""
    import optllm.runtime.models.draft as draft_mod
    import optllm.runtime.spec_runner as spec_runner

    folder = write_draft(tmp_path / method, tiny_llama, method, seed=7, noise=0.5)
    eng = _stepped_engine(tiny_llama, folder, num_draft=20, max_tokens=60, steps=10, kernels=kernels, top_k=6)
    spec, seqs, roots, ctx, tables = _running_decodes(eng)
    pools = []
    new_pool, topk = spec_runner.new_pool, draft_mod.topk_logprobs
    monkeypatch.setattr(spec_runner, "new_pool", lambda *a: pools.append(a[1:3]) or new_pool(*a))
    if flat:
        def flattened(*a, **kw):
            lp, ids = topk(*a, **kw)
            return lp * 1e-3 - 1, ids
        monkeypatch.setattr(draft_mod, "topk_logprobs", flattened)
    with torch.inference_mode():
        states = spec.states(seqs)
        for n, width in ((21, 6), (10, 6), (5, 4), (2, 1)):
            assert spec.tree_width(n) == width and spec.tree_depth(n) == min(3, n - 1)
            got, got_ranks = spec._propose_eagle(roots, states, ctx, tables, n)
            with monkeypatch.context() as m:
                m.setattr(type(spec), "tree_width", lambda self, n: self.options.top_k)
                want, want_ranks = spec._propose_eagle(roots, states, ctx, tables, n)
            assert pools[-2:] == [(width, min(3, n - 1)), (6, min(3, n - 1))]
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents), n
            assert torch.equal(got_ranks, want_ranks) and torch.equal(got.depths, want.depths), n
            # flat: a star up to the root's 6 children, then their best children
            assert int(got.depths.max()) == (1 + (n > 7) if flat else min(3, n - 1)), n


def test_an_adaptive_steps_read_back_row_comes_from_the_acceptance_kernel(tiny_llama, tmp_path):
    """On the kernels, an adaptive decoder's step gets its read-back row (num, tokens, path, then
    the draft tokens each menu size would have accepted) from the acceptance launch
    (AcceptResult.packed): the per-size columns equal the runtime's accepted_per_size over the
    step's own ranks, and _pack / _per_size add no tensor ops. An engine with a pass-through EAGLE
    draft (its tokens often accepted) mid-generation (21-node trees, top-k 3, depth 3), made adaptive
    after start-up with a menu of 21, 10, 5 and 2 nodes (the start-up cost profile is slow under the
    interpreter)."""
    from optllm.runtime.spec.acceptance import accepted_per_size

    folder = write_draft(tmp_path / "eagle", tiny_llama, "eagle")
    eng = _stepped_engine(tiny_llama, folder, num_draft=20, max_tokens=60, steps=10, kernels="triton")
    spec, seqs, roots, ctx, tables = _running_decodes(eng)
    with torch.inference_mode():
        states = spec.states(seqs)
        spec.adaptive, spec.sizes = True, [2, 5, 10, 21]
        tree, _, _, res, ranks = spec._draft_and_verify(roots, states, ctx, tables,
                                                        [s.params for s in seqs], 21)
    n, menu = 21, spec._sizes_on()
    assert res.packed is not None and res.packed.shape == (len(seqs), 1 + 2 * n + 4)
    per = accepted_per_size(res.accepted, ranks, menu)
    assert torch.equal(res.packed[:, 1 + 2 * n:], per)
    assert torch.equal(res.packed[:, :1 + 2 * n], torch.cat([res.num_accepted[:, None], res.tokens, res.accepted], 1))
    assert spec._pack(res, None) is res.packed and spec._per_size(res, ranks) is None
    assert int(res.num_accepted.max()) >= 2 and (per[:, 0] < res.num_accepted).any()  # size 2 cuts a path


@pytest.mark.parametrize(("kernels", "draft_vocab"), [("torch", None), ("triton", 150)])
def test_every_eagle3_tree_node_scores_what_the_training_time_test_computes(tiny_llama, tmp_path, kernels, draft_vocab):
    """Serving drafts what training trained, at every depth: each node of an EAGLE-2 tree the engine
    grows (depth 3, 20 nodes, batch 4, mid-generation) scores its parent's score plus the log-prob
    that the training module's training-time test (Eagle3Draft.ttt) gives its token at the parent's
    depth, over the target's features of the sequence and the path's tokens. The state test above
    covers depth 1 only; a level that attended the wrong rows or took the wrong position (which
    would make the deep levels accept less than the held-out accuracy says) fails here."""
    from optllm.speculative.eagle3 import eagle3_features

    folder = write_draft(tmp_path / "e3", tiny_llama, "eagle3", seed=2, noise=0.3, draft_vocab=draft_vocab)
    eng = _stepped_engine(tiny_llama, folder, num_draft=20, max_tokens=60, steps=10, kernels=kernels)
    _, seqs, roots, _, _, _, _, t = _grow_one_tree(eng, kernels)
    hf = _hf(tiny_llama)
    ref = read_eagle3(folder, hf, draft_vocab)
    kept = ref.d2t + torch.arange(ref.draft_vocab_size)  # draft index -> target id
    depths = []
    for b, s in enumerate(seqs):
        c = s.num_computed_tokens
        ids = torch.tensor([s.token_ids[: c + 1]])
        assert int(roots[b]) == s.token_ids[c]
        with torch.no_grad():
            aux = eagle3_features(hf, ids[:, :c], None, ref.aux_layers)
        for i in range(1, t.tokens.shape[1]):
            p, path = int(t.parents[b, i]), []
            while p > 0:  # the parent's path below the root, root side first
                path.insert(0, int(t.tokens[b, p]))
                p = int(t.parents[b, p])
            p, d = int(t.parents[b, i]), len(path)
            assert d == int(t.depths[b, p]) == int(t.depths[b, i]) - 1
            # the context's rows 0 .. c - 1 (tokens 1 .. c: the root last), then the path; the
            # training-time test's step d drafts from the draft's own outputs past row c - 1 (the
            # zero features there are never read)
            chain = torch.cat([ids[:, 1:], torch.tensor([path], dtype=torch.long).view(1, d)], dim=1)
            feats = torch.cat([aux, torch.zeros(1, d, aux.shape[-1])], dim=1)
            with torch.no_grad():
                lg = ref.ttt(feats, chain, d + 1)[d][0, c - 1 + d]
            want = torch.log_softmax(lg.float(), -1)[int((kept == t.tokens[b, i]).nonzero())]
            torch.testing.assert_close(t.scores[b, i] - t.scores[b, p], want, rtol=0, atol=1e-4)
            depths.append(d)
    assert max(depths) == 2 and depths.count(2) >= len(seqs)  # the deepest nodes' parents are two levels down


def test_no_runtime_code_reads_an_instance_dict():
    """Reading an object's __dict__ (or vars()) makes CPython 3.11+ keep that object's attributes in a
    real dict from then on, and every attribute read of it 2-3x slower: one such read of each
    Sequence (a speculation flag cached through seq.__dict__) made a draft engine's whole host step
    ~30% slower on the CPU, plain steps included. Per-object state is declared in __init__ instead."""
    import optllm.runtime

    root = Path(optllm.runtime.__file__).parent
    offenders = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if ("__dict__" in line or "vars(" in line) and not line.lstrip().startswith("#")]
    assert not offenders, offenders


def test_warm_up_shapes_keep_positions_below_max_model_len():
    """The start-up warm-up over `rows` rows (warm_shape): exactly `rows` rows (the GEMM shape it
    warms), no sequence longer than max_model_len (a longer one read past the draft's rotary table:
    an illegal address on the H100 with max_model_len 300 and the 4096-row warm-up)."""
    from optllm.runtime.spec_runner import catch_up_rows, warm_shape

    for max_len in (17, 24, 64, 300, 2048, 8192):
        for rows in [1, 2, 4, 8, 16, 32, 64] + sorted({catch_up_rows(r) for r in range(65, 4097)}):
            seqs, g = warm_shape(rows, max_len)
            assert seqs * g == rows and g <= max_len, (rows, max_len, seqs, g)
            assert seqs == 1 or g >= min(16, 1 << (max_len.bit_length() - 1)), (rows, max_len, g)
    assert warm_shape(4096, 300) == (16, 256) and warm_shape(576, 300) == (9, 64) and warm_shape(64, 300) == (1, 64)


def test_an_eagle_engine_shorter_than_its_warm_up_starts_and_decodes(tiny_llama, drafts):
    """max_model_len 28, below the warm-up's 32- and 64-row runs: the engine starts (the warm-up
    splits them into sequences that fit), the adaptive policy's start-up profile too, and speculative
    greedy equals plain greedy (small trees, so that steps find room for their lookahead)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The interpreter reads", "x = 1\ny"]
    plain, _ = _run(tiny_llama, prompts, params, max_model_len=28)
    for policy in ("fixed", "adaptive"):  # adaptive: the start-up cost profile's runs fit too
        spec, llm = _run(tiny_llama, prompts, params, max_model_len=28, draft=str(drafts["eagle"]), spec_top_k=2,
                         spec_depth=2, spec_num_draft=4, spec_policy=policy)
        assert spec == plain and (policy == "adaptive" or llm.engine.stats().speculation["steps"] > 0)
