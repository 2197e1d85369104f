"""Scheduler: token budgets, FCFS admission, preemption by recompute, stop rules, abort."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from optllm.runtime.config import SchedulerConfig
from optllm.runtime.sampling_params import SamplingParams
from optllm.runtime.scheduler import Scheduler
from optllm.runtime.sequence import FinishReason, Sequence, SequenceStatus

EOS = 2


def make_sched(num_blocks=64, eos=frozenset({EOS}), **cfg) -> Scheduler:
    cfg = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256, "block_size": 8, **cfg}
    return Scheduler(SchedulerConfig(**cfg), num_blocks, eos)


def make_seq(n_prompt, request_id="r", first=10, **params) -> Sequence:
    params.setdefault("max_tokens", 100)
    return Sequence(request_id, list(range(first, first + n_prompt)), SamplingParams(**params))


def step(sched: Scheduler, token: int = 7):
    """One schedule/update round; every sampling sequence samples `token`."""
    batch = sched.schedule()
    sampled = [token if batch.samples(i) else None for i in range(len(batch))]
    return batch, sched.update(batch, sampled)


def plan(batch):
    return [(s.request_id, k) for s, k in zip(batch.seqs, batch.num_new_tokens)]


def test_chunked_prefill_splits_the_budget_exactly():
    sched = make_sched(max_num_batched_tokens=10)
    a, b = make_seq(25, "a"), make_seq(7, "b")
    sched.add(a)
    sched.add(b)
    plans, samples, decode_only = [], [], []
    for _ in range(5):
        batch, _ = step(sched)
        plans.append(plan(batch))
        samples.append(batch.sample_indices)
        decode_only.append(batch.decode_only)
        assert batch.num_batched_tokens <= 10
    assert plans == [[("a", 10)], [("a", 10)], [("a", 5), ("b", 5)], [("a", 1), ("b", 2)], [("a", 1), ("b", 1)]]
    assert samples == [[], [], [0], [0, 1], [0, 1]]
    assert decode_only == [False, False, False, False, True]
    assert a.num_output_tokens == 3 and b.num_output_tokens == 2
    assert a.num_computed_tokens == 27 and a.num_tokens == 28


def test_decodes_come_before_a_new_prefill():
    sched = make_sched(max_num_batched_tokens=10)
    sched.add(make_seq(4, "a"))
    step(sched)
    sched.add(make_seq(30, "c"))
    batch, _ = step(sched)
    assert plan(batch) == [("a", 1), ("c", 9)] and batch.sample_indices == [0]


def test_max_num_seqs_is_honored():
    sched = make_sched(max_num_seqs=2)
    for r in "abc":
        sched.add(make_seq(4, r, max_tokens=2))
    batch, _ = step(sched)
    assert plan(batch) == [("a", 4), ("b", 4)] and sched.num_running == 2 and sched.num_waiting == 1
    batch, finished = step(sched)
    assert plan(batch) == [("a", 1), ("b", 1)] and [s.request_id for s in finished] == ["a", "b"]
    batch, _ = step(sched)
    assert plan(batch) == [("c", 4)]


def test_admit_group_holds_arrivals_while_decode_steps_run_graphed():
    """admit_group=2: with sequences decoding, a lone freed place is not filled (the step stays
    decode-only) until two fit or a place has stood empty admit_max_wait steps; an idle engine or a
    step that is mixed anyway admits at once."""
    sched = make_sched(max_num_seqs=3, admit_group=2, admit_max_wait=3)
    sched.add(make_seq(4, "a", max_tokens=2))
    sched.add(make_seq(4, "b", max_tokens=9))
    sched.add(make_seq(4, "c", max_tokens=9))
    batch, _ = step(sched)  # idle engine: all admitted together
    assert plan(batch) == [("a", 4), ("b", 4), ("c", 4)]
    sched.add(make_seq(4, "d", max_tokens=9))
    sched.add(make_seq(4, "e", max_tokens=9))
    batch, finished = step(sched)
    assert [s.request_id for s in finished] == ["a"] and batch.decode_only
    held = []
    for _ in range(3):  # one place free, two wait: held for admit_max_wait = 3 steps
        batch, _ = step(sched)
        held.append(batch.decode_only and plan(batch) == [("b", 1), ("c", 1)])
    assert held == [True, True, True]
    batch, _ = step(sched)  # waited long enough: the head goes in alone
    assert plan(batch) == [("b", 1), ("c", 1), ("d", 4)] and sched.num_waiting == 1


def test_admit_group_admits_a_group_as_soon_as_it_fits():
    sched = make_sched(max_num_seqs=4, admit_group=2, admit_max_wait=50)
    for r, n in (("a", 2), ("b", 3), ("c", 9), ("d", 9)):
        sched.add(make_seq(4, r, max_tokens=n))
    step(sched)
    for r in "ef":
        sched.add(make_seq(4, r, max_tokens=9))
    batch, finished = step(sched)  # a finishes: one place, held
    assert [s.request_id for s in finished] == ["a"]
    batch, finished = step(sched)  # b finishes in this step; still one place while it ran
    assert [s.request_id for s in finished] == ["b"] and len(batch) == 3
    batch, _ = step(sched)  # two places: both admitted in one mixed step
    assert plan(batch) == [("c", 1), ("d", 1), ("e", 4), ("f", 4)]


def test_admit_group_one_is_the_old_behaviour_and_bad_values_are_refused():
    sched = make_sched(max_num_seqs=2)
    assert sched.config.admit_group == 1
    with pytest.raises(ValueError, match="admit_group=0 is not allowed"):
        SchedulerConfig(admit_group=0)
    with pytest.raises(ValueError, match="admit_max_wait=0 is not allowed"):
        SchedulerConfig(admit_max_wait=0)


def test_fcfs_a_big_waiting_prompt_blocks_smaller_ones():
    sched = make_sched(num_blocks=4)  # 32 slots
    sched.add(make_seq(15, "a", max_tokens=2))  # 2 blocks
    sched.add(make_seq(20, "b", first=100))  # 3 blocks: does not fit beside a
    sched.add(make_seq(3, "c", first=200))  # 1 block would fit, but b came first
    batch, _ = step(sched)
    assert plan(batch) == [("a", 15)] and [s.request_id for s in sched.waiting] == ["b", "c"]
    batch, finished = step(sched)
    assert plan(batch) == [("a", 1)] and [s.request_id for s in finished] == ["a"]
    assert sched.block_manager.num_free_blocks == 4
    batch, _ = step(sched)
    assert plan(batch) == [("b", 20), ("c", 3)] and sched.block_manager.num_free_blocks == 0


def test_newest_running_sequence_is_preempted_and_recomputed_later():
    sched = make_sched(num_blocks=4, max_num_seqs=2, enable_prefix_caching=False)
    a, b, c = make_seq(8, "a", max_tokens=20), make_seq(8, "b", first=50), make_seq(8, "c", first=90)
    for s in (a, b, c):
        sched.add(s)
    for _ in range(9):  # prompts, then decodes up to 17 tokens each (2 blocks each: the cache is full)
        batch, _ = step(sched)
        assert plan(batch) in ([("a", 8), ("b", 8)], [("a", 1), ("b", 1)]) and not batch.preempted
    assert a.num_tokens == b.num_tokens == 17 and sched.block_manager.num_free_blocks == 0
    batch, _ = step(sched)  # a's token 17 opens a third block: b (the newest) makes room
    assert plan(batch) == [("a", 1)] and batch.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [b, c]  # back at the front, before the later arrival
    assert len(a.block_table) == 3 and sched.block_manager.num_free_blocks == 1
    steps = 0
    while not a.is_finished:  # b (17 tokens: 3 blocks) cannot come back before a ends
        batch, _ = step(sched)
        steps += 1
        assert plan(batch) == [("a", 1)]
    assert steps == 10 and a.num_output_tokens == 20 and a.finish_reason is FinishReason.LENGTH
    batch, _ = step(sched)
    assert plan(batch) == [("b", 17), ("c", 8)]  # b recomputes prompt + its 9 earlier outputs
    assert batch.sample_indices == [0, 1] and b.num_output_tokens == 10 and b.num_computed_tokens == 17


def test_a_sequence_that_is_itself_the_newest_preempts_itself():
    sched = make_sched(num_blocks=2)
    a, b = make_seq(4, "a"), make_seq(8, "b")
    sched.add(a)
    sched.add(b)
    step(sched)  # a: 1 block, b: 1 block
    batch, _ = step(sched)  # a still fits its block; b needs a second one
    assert plan(batch) == [("a", 1)] and batch.preempted == [b] and list(sched.waiting) == [b]
    assert sched.block_manager.num_free_blocks == 1 and sched.num_running == 1


def test_preempted_sequence_resumes_from_the_prefix_cache():
    sched = make_sched(num_blocks=2)
    a, b = make_seq(4, "a"), make_seq(8, "b")
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)  # b preempted; its full block 0 stays cached
    a.params.max_tokens = a.num_output_tokens + 1
    batch, finished = step(sched)
    assert finished == [a] and plan(batch) == [("a", 1)]
    batch, _ = step(sched)
    assert plan(batch) == [("b", 1)] and b.num_cached_tokens == 8  # only the sampled token is recomputed
    assert sched.prefix_cache_hit_rate == pytest.approx(8 / (4 + 8 + 9))


@pytest.mark.parametrize("params, tokens, n_out, reason, stop_reason", [
    ({}, [5, EOS, 5], 2, FinishReason.STOP, None),
    ({"ignore_eos": True, "max_tokens": 3}, [EOS] * 5, 3, FinishReason.LENGTH, None),
    ({"min_tokens": 2}, [EOS] * 5, 3, FinishReason.STOP, None),
    ({"stop_token_ids": [9]}, [5, 9, 5], 2, FinishReason.STOP, 9),
    ({"stop_token_ids": [9], "min_tokens": 1}, [9, 9, 5], 2, FinishReason.STOP, 9),
    ({"max_tokens": 3}, [5] * 5, 3, FinishReason.LENGTH, None),
    ({"max_tokens": None}, [5] * 5, 4, FinishReason.LENGTH, None),  # max_model_len = 14
])
def test_stop_rules(params, tokens, n_out, reason, stop_reason):
    sched = make_sched(max_model_len=14)
    seq = make_seq(10, **params)
    sched.add(seq)
    for i, tok in enumerate(tokens):
        _, finished = step(sched, tok)
        if finished:
            break
    assert finished == [seq] and seq.num_output_tokens == n_out == i + 1
    assert seq.output_token_ids == tokens[:n_out]
    assert (seq.finish_reason, seq.stop_reason) == (reason, stop_reason)
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished()


@pytest.mark.parametrize("seed", range(3))
def test_a_step_of_several_tokens_stops_as_one_token_at_a_time(seed, monkeypatch):
    """update() with a speculative step's token list appends them in one call when none can stop
    the sequence (Scheduler._cannot_stop); the outcome equals appending them one at a time under the
    stop rules, which the second scheduler does for every list: random lists of 2-6 tokens with EOS
    and a stop token among them or not, min_tokens, ignore_eos, and max_tokens / max_model_len
    reached before, at or after the list's end."""
    rng = random.Random(seed)
    fast_calls = []
    for case in range(200):
        max_tokens = rng.choice([None, 3, 5, 8])
        params = dict(max_tokens=max_tokens, min_tokens=min(rng.choice([0, 0, 2, 4]), max_tokens or 4),
                      ignore_eos=rng.random() < 0.2, stop_token_ids=rng.choice([[], [9], [9, 11]]))
        pool = [5, 6, 7, EOS, 9, 11] if rng.random() < 0.5 else [5, 6, 7]
        lists = [[rng.choice(pool) for _ in range(rng.randint(2, 6))] for _ in range(3)]
        outcomes = []
        for per_token in (False, True):
            sched = make_sched(max_model_len=random.Random(case).choice([16, 64]))
            if per_token:
                monkeypatch.setattr(sched, "_cannot_stop", lambda seq, toks: False)
            else:
                real = sched._cannot_stop
                monkeypatch.setattr(sched, "_cannot_stop",
                                    lambda seq, toks, real=real: fast_calls.append(r := real(seq, toks)) or r)
            seq = make_seq(6, **params)
            sched.add(seq)
            step(sched, 5)  # the prefill samples a first token
            for toks in lists:
                if seq.is_finished:
                    break
                batch = sched.schedule()
                assert batch.seqs == [seq] and batch.num_new_tokens == [1]
                sched.update(batch, [list(toks)])
            outcomes.append((seq.output_token_ids, seq.num_computed_tokens, seq.finish_reason, seq.stop_reason,
                             sched.block_manager.num_free_blocks))
        assert outcomes[0] == outcomes[1], (params, lists)
    assert any(fast_calls) and not all(fast_calls)  # both paths were taken


def test_length_stop_at_the_kv_cache_capacity():
    sched = make_sched(num_blocks=2, max_model_len=100)  # 16 slots in all
    seq = make_seq(10, max_tokens=None)
    sched.add(seq)
    while sched.has_unfinished():
        step(sched)
    assert seq.num_tokens == 16 and seq.finish_reason is FinishReason.LENGTH


def test_abort_frees_blocks_at_once_waiting_and_running():
    sched = make_sched(max_num_seqs=1)
    r1, r2, other = make_seq(20, "x"), make_seq(20, "x"), make_seq(5, "y")
    for s in (r1, r2, other):
        sched.add(s)
    batch = sched.schedule()
    assert plan(batch) == [("x", 20)] and sched.block_manager.num_used_blocks == 3
    aborted = sched.abort("x")
    assert aborted == [r1, r2] and all(s.finish_reason is FinishReason.ABORT for s in aborted)
    assert sched.block_manager.num_used_blocks == 0 and list(sched.waiting) == [other]
    assert sched.update(batch, [7]) == [] and r1.num_tokens == 20  # the aborted step's result is dropped
    batch, _ = step(sched)
    assert plan(batch) == [("y", 5)]


def test_finish_from_outside_frees_blocks():
    sched = make_sched()
    seq = make_seq(9)
    sched.add(seq)
    step(sched)
    sched.finish(seq, FinishReason.STOP, "stop!")
    assert (seq.finish_reason, seq.stop_reason) == (FinishReason.STOP, "stop!")
    assert sched.num_running == 0 and sched.block_manager.num_free_blocks == 64


def test_add_rejects_prompts_that_can_never_fit():
    sched = make_sched(num_blocks=2, max_model_len=20)
    with pytest.raises(ValueError, match="21 tokens exceeds max_model_len=20"):
        sched.add(make_seq(21))
    with pytest.raises(ValueError, match="needs 3 KV blocks.*holds 2"):
        make_sched(num_blocks=2).add(make_seq(17))
    sched.add(make_seq(16))  # 16 slots: exactly the cache; its one output token needs no slot
    assert sched.num_waiting == 1


def test_update_checks_the_sampled_list():
    sched = make_sched()
    sched.add(make_seq(4))
    batch = sched.schedule()
    with pytest.raises(ValueError, match="one per scheduled"):
        sched.update(batch, [])
    with pytest.raises(ValueError, match="sampled\\[0\\]=None"):
        sched.update(batch, [None])


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_keeps_reference_counts_exact(seed):
    """Shared prefixes, chunking, preemptions and aborts: every block's count equals its users."""
    rng = random.Random(seed)
    sched = make_sched(num_blocks=rng.randint(3, 12), max_num_seqs=rng.randint(1, 5),
                       max_num_batched_tokens=rng.randint(4, 40), max_model_len=80)
    bm = sched.block_manager
    prefixes = [[rng.randint(3, 6) for _ in range(rng.randint(0, 24))] for _ in range(3)]
    for t in range(200):
        prompt = rng.choice(prefixes) + [rng.randint(3, 6) for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.3 and len(prompt) < sched.max_seq_len:
            sched.add(Sequence(f"r{t % 5}", prompt, SamplingParams(max_tokens=rng.randint(1, 20))))
        if rng.random() < 0.03:
            sched.abort(f"r{rng.randint(0, 4)}")
        batch = sched.schedule()
        assert batch.num_batched_tokens <= sched.config.max_num_batched_tokens
        sched.update(batch, [rng.choice([EOS, 3, 4, 5]) if batch.samples(i) else None for i in range(len(batch))])
        users = Counter(b for s in sched.running for b in s.block_table)
        assert all(bm.ref_count(b) == users[b] for b in range(bm.num_blocks))
        assert bm.num_free_blocks == bm.num_blocks - len(users)
        assert all(not s.block_table and s.num_computed_tokens == 0 for s in sched.waiting)
    while sched.has_unfinished():
        batch = sched.schedule()
        sched.update(batch, [3 if batch.samples(i) else None for i in range(len(batch))])
    assert bm.num_free_blocks == bm.num_blocks
