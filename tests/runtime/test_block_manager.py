"""BlockManager: exact block counts, sharing, the prefix cache's rules, eviction and truncation."""

from __future__ import annotations

import pytest

from optllm.runtime import block_manager as bm_module
from optllm.runtime.block_manager import BlockManager
from optllm.runtime.sampling_params import SamplingParams
from optllm.runtime.sequence import Sequence


def make_seq(tokens, **params) -> Sequence:
    return Sequence("r", list(tokens), SamplingParams(**params))


def admit(bm: BlockManager, seq: Sequence, num_new: int | None = None) -> None:
    """First admission with lookup, then run the step (all uncomputed tokens by default) and commit."""
    hit = bm.lookup(seq)
    n = seq.num_tokens - hit.num_tokens if num_new is None else num_new
    assert bm.allocate(seq, n, hit)
    seq.num_computed_tokens += n
    bm.commit(seq)


def test_allocation_counts_grow_with_slots_and_lookahead():
    bm = BlockManager(num_blocks=10, block_size=4)
    s = make_seq(range(10))
    assert bm.allocate(s, 10)
    assert s.block_table == [0, 1, 2] and bm.num_free_blocks == 7 and bm.num_used_blocks == 3
    s.num_computed_tokens = 10
    s.append_token(10)
    s.append_token(11)
    assert bm.allocate(s, 2) and len(s.block_table) == 3  # slots 11, 12 fit block 2
    s.num_computed_tokens = 12
    s.append_token(12)
    assert bm.allocate(s, 1) and s.block_table == [0, 1, 2, 3]  # slot 13 opens block 3
    assert bm.allocate(s, 1, lookahead=4) and len(s.block_table) == 5  # ceil(17 / 4)
    assert bm.num_free_blocks == 5
    assert not bm.can_allocate(s, 1, lookahead=28)  # ceil(41 / 4) = 11 blocks > 10
    assert not bm.allocate(s, 1, lookahead=28)
    assert len(s.block_table) == 5 and bm.num_free_blocks == 5  # a refusal changes nothing
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.allocate(s, 2)  # only 1 token is uncomputed
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 10


def test_common_prefix_shares_exactly_its_full_blocks():
    bm = BlockManager(num_blocks=20, block_size=4)
    a = make_seq([*range(12), 100, 101, 102, 103, 104])  # 17 tokens: 5 blocks, 4 full
    admit(bm, a)
    assert bm.num_cached_blocks == 4
    b = make_seq([*range(12), 200, 201, 202])  # shares 3 full blocks with a
    hit = bm.lookup(b)
    assert hit.blocks == tuple(a.block_table[:3]) and hit.num_tokens == 12
    assert bm.allocate(b, 3, hit)
    assert b.block_table[:3] == a.block_table[:3] and len(b.block_table) == 4
    assert b.block_table[3] not in a.block_table
    assert [bm.ref_count(x) for x in a.block_table] == [2, 2, 2, 1, 1]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert bm.num_free_blocks == 20 - 5 - 1
    bm.free(a)
    assert [bm.ref_count(x) for x in b.block_table] == [1, 1, 1, 1]
    assert bm.num_free_blocks == 16
    bm.free(b)
    assert bm.num_free_blocks == 20


def test_block_holding_the_last_token_is_never_a_hit():
    bm = BlockManager(num_blocks=10, block_size=4)
    admit(bm, make_seq(range(8)))  # exactly 2 full blocks, both registered
    assert bm.num_cached_blocks == 2
    same = bm.lookup(make_seq(range(8)))
    assert len(same.blocks) == 1 and same.num_tokens == 4  # its last token must be computed
    longer = bm.lookup(make_seq(range(9)))
    assert len(longer.blocks) == 2 and longer.num_tokens == 8


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "block_hash", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=10, block_size=4)
    admit(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert bm.num_cached_blocks == 1  # block 1 collides with block 0: the first keeps the hash
    assert bm.lookup(make_seq([9, 9, 9, 9, 1, 2])).num_tokens == 0
    hit = bm.lookup(make_seq([1, 2, 3, 4, 9, 9, 9, 9, 0]))
    assert hit.num_tokens == 4  # block 0 matches; block 1's "hit" holds other tokens


def test_lru_eviction_after_never_cached_blocks():
    bm = BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq(range(8)), make_seq(range(50, 58))
    admit(bm, a)
    admit(bm, b)
    assert a.block_table == [0, 1] and b.block_table == [2, 3] and bm.num_cached_blocks == 4
    bm.free(a)  # releases 1 then 0
    bm.free(b)  # releases 3 then 2
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 4
    c = make_seq(range(100, 116))
    assert bm.allocate(c, 16)
    assert c.block_table == [4, 5, 1, 0]  # never-cached first, then least recently freed
    assert bm.num_cached_blocks == 2
    assert bm.lookup(make_seq([*range(8), 0])).num_tokens == 0  # a's blocks were evicted
    assert bm.lookup(make_seq([*range(50, 58), 0])).num_tokens == 8  # b's are still there
    d = make_seq(range(200, 204))
    assert bm.allocate(d, 4) and d.block_table == [3]
    # b's tail went first (a sequence's blocks are released last first): its head still hits
    assert bm.lookup(make_seq([*range(50, 58), 0])).num_tokens == 4


def test_freed_cached_block_is_revived_and_counts_as_free_block():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(range(9))
    admit(bm, a)  # blocks 0, 1 full and registered, 2 partial
    bm.free(a)
    x = make_seq([7])
    assert bm.allocate(x, 1) and x.block_table == [2]  # the never-cached block goes first
    b = make_seq(range(9))
    hit = bm.lookup(b)
    assert hit.blocks == (0, 1)
    assert not bm.can_allocate(b, 1, hit)  # 2 revived + 1 fresh > 2 free
    assert not bm.allocate(b, 1, hit)
    assert b.block_table == [] and b.num_computed_tokens == 0 and bm.num_free_blocks == 2
    bm.free(x)
    hit = bm.lookup(b)
    assert bm.allocate(b, 1, hit)
    assert b.block_table == [0, 1, 2] and [bm.ref_count(i) for i in range(3)] == [1, 1, 1]
    assert bm.num_free_blocks == 0 and b.num_computed_tokens == 8


def test_truncate_releases_blocks_and_unregisters_the_partial_one():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(14))
    admit(bm, a)  # blocks 0..2 full and registered, block 3 partial
    assert bm.num_cached_blocks == 3
    bm.truncate(a, 6)
    a.token_ids = a.token_ids[:6]
    a.num_computed_tokens = 6
    assert a.block_table == [0, 1] and bm.num_free_blocks == 8
    assert bm.num_cached_blocks == 2  # block 1 is partial now; block 2 stays findable while free
    assert bm.lookup(make_seq(range(14))).num_tokens == 4  # the chain stops at block 1
    a.token_ids += [90, 91]
    a.num_computed_tokens = 8
    bm.commit(a)  # block 1 is registered again, under its new tokens
    assert bm.lookup(make_seq([*range(6), 90, 91, 0])).num_tokens == 8
    bm.truncate(a, 4)  # on a block boundary: block 0 stays registered
    assert a.block_table == [0] and bm.lookup(make_seq(range(5))).num_tokens == 4
    with pytest.raises(ValueError, match="num_tokens"):
        bm.truncate(a, 100)


def test_truncate_into_a_shared_block_is_refused():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = make_seq(range(13))
    admit(bm, a)
    b = make_seq(range(13))
    admit(bm, b)  # shares a's 3 full blocks
    table = list(b.block_table)
    with pytest.raises(ValueError, match="share"):
        bm.truncate(b, 10)
    assert b.block_table == table and bm.ref_count(table[2]) == 2  # nothing changed
    bm.truncate(b, 8)  # a boundary: the shared block is dropped whole
    assert b.block_table == table[:2] and bm.ref_count(table[2]) == 1
    assert bm.num_free_blocks == 10 - 4 - 0  # b's own last block went back, a holds 4


def test_prompt_logprobs_skip_the_lookup_and_statistics():
    bm = BlockManager(num_blocks=10, block_size=4)
    admit(bm, make_seq(range(9)))
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (9, 0)
    p = make_seq(range(9), prompt_logprobs=0)
    hit = bm.lookup(p)
    assert hit.num_tokens == 0 and hit.num_queried == 0
    assert bm.allocate(p, 9, hit) and p.num_computed_tokens == 0 and p.block_table == [3, 4, 5]
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (9, 0)
    admit(bm, make_seq(range(10)))
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (19, 8)
    assert bm.hit_rate == pytest.approx(8 / 19)


@pytest.mark.parametrize("start, hit", [(0, 0), (1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (13, 12), (20, 16), (21, 20),
                                        (22, 20), (100, 20)])
def test_prompt_logprobs_start_limits_the_hit_to_blocks_before_its_logits(start, hit):
    # the log-prob of token `start` needs the logits at position start - 1: the hit ends at or
    # before it, on a block boundary (22 tokens, 5 full blocks cached; the last block is never a hit)
    bm = BlockManager(num_blocks=20, block_size=4)
    admit(bm, make_seq(range(22)))
    p = make_seq(range(22), prompt_logprobs=0, prompt_logprobs_start=start)
    assert p.prompt_logprobs == [None] * min(max(start, 1), 22)  # the entries nobody wants
    h = bm.lookup(p)
    assert h.num_tokens == hit and len(h.blocks) == hit // 4
    assert h.num_queried == (22 if hit else 0)  # a lookup that cannot hit is skipped, as before
    assert bm.allocate(p, 22 - hit, h) and p.num_computed_tokens == p.num_cached_tokens == hit


def test_prompt_logprobs_all_scored_lift_the_limit():
    # after a preemption, a sequence whose prompt log-probs are all out may reuse its whole prompt
    bm = BlockManager(num_blocks=20, block_size=4)
    admit(bm, make_seq(range(13)))
    p = make_seq(range(13), prompt_logprobs=0, prompt_logprobs_start=6)
    assert bm.lookup(p).num_tokens == 4 and p.next_prompt_logprob == 6
    p.prompt_logprobs += [{0: -1.0}] * 6  # tokens 6..11 scored, token 12 not yet
    assert p.next_prompt_logprob == 12 and bm.lookup(p).num_tokens == 8
    p.prompt_logprobs.append({0: -1.0})
    assert p.next_prompt_logprob == 13 and bm.lookup(p).num_tokens == 12
    assert make_seq(range(13)).next_prompt_logprob == 13  # nothing asked: nothing pending


def test_prefix_caching_off_registers_nothing():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    admit(bm, make_seq(range(9)))
    assert bm.num_cached_blocks == 0
    assert bm.lookup(make_seq(range(9))).num_tokens == 0 and bm.hit_rate == 0.0


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="lookahead"):
        bm.allocate(make_seq([1]), 1, lookahead=-1)
