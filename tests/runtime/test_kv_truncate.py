"""KV after verification: moving the accepted path's entries into place (runtime/spec/kv_compact.py)
and giving back the tree's unused blocks (BlockManager.truncate), checked exactly.

The move is checked on every slot of a whole-cache tensor whose entries are all distinct, so
a wrong source, a wrong destination or a stray write anywhere shows. The verify flow runs
the block manager's calls as the engine will: allocate the tree's slots as lookahead, store
the tree's K/V at positions context_len + i, accept a path, move, append the tokens,
truncate, commit; the sequence's KV then reads as if its tokens had been decoded one by one.
"""

import pytest
import torch

from optllm.kernels.paged_attention import gather_kv, store_kv_cache_ref
from optllm.runtime.block_manager import BlockManager
from optllm.runtime.sampling_params import SamplingParams
from optllm.runtime.sequence import Sequence
from optllm.runtime.spec.kv_compact import accepted_kv_slots, move_kv_slots


def _expected_move(cache, table, ctx, accepted, bs):
    """The cache after the moves, slot by slot in plain Python."""
    out = cache.clone()
    for b, path in enumerate(accepted):
        for i, node in enumerate(path):
            if node < 0:
                break
            src, dst = ctx[b] + node, ctx[b] + i
            sb, so = table[b][src // bs], src % bs
            db, do = table[b][dst // bs], dst % bs
            out[:, db, :, do] = cache[:, sb, :, so]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_move_matches_a_slot_by_slot_copy(dtype):
    bs, layers, blocks, heads, d = 4, 2, 14, 2, 3
    table = [[5, 2, 9, 0], [11, 7, 1, 3], [4, 13, 6, 8]]
    ctx = [3, 6, 8]
    # paths: a chain that reads a slot another move writes (2 -> 1 after 3 -> 2 is read),
    # one crossing a block boundary, one with nothing accepted
    accepted = [[0, 2, 3, 6], [0, 1, 4, -1], [0, -1, -1, -1]]
    n = layers * blocks * heads * bs * d
    k = torch.arange(n, dtype=torch.float32).view(layers, blocks, heads, bs, d).remainder(97).add(1)
    k = k.to(dtype)
    scale = torch.arange(layers * blocks * heads * bs, dtype=torch.float32).view(layers, blocks, heads, bs)
    expect_k = _expected_move(k.view(torch.uint8) if dtype != torch.float32 else k, table, ctx, accepted, bs)
    expect_s = _expected_move(scale, table, ctx, accepted, bs)
    src, dst = accepted_kv_slots(torch.tensor(table, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
                                 torch.tensor(accepted), bs)
    move_kv_slots([k, None, scale], src, dst)
    got_k = k.view(torch.uint8) if dtype != torch.float32 else k
    assert torch.equal(got_k, expect_k)
    assert torch.equal(scale, expect_s)
    assert (src != dst).sum() == 2 + 2  # only nodes out of place move


def test_move_of_one_layer_view():
    cache = torch.arange(2 * 3 * 4 * 2, dtype=torch.float32).view(2, 3, 4, 2)  # [blocks, heads, bs, d]
    src, dst = accepted_kv_slots(torch.tensor([[1, 0]]), torch.tensor([2]), torch.tensor([[0, 3]]), 4)
    before = cache.clone()
    move_kv_slots([cache.unsqueeze(0)], src, dst)
    # position 2 + 3 = 5 (block 0, offset 1) moved to position 3 (block 1, offset 3)
    assert torch.equal(cache[1, :, 3], before[0, :, 1])
    cache[1, :, 3] = before[1, :, 3]
    assert torch.equal(cache, before)


def test_bad_move_arguments():
    with pytest.raises(ValueError, match="block_size"):
        accepted_kv_slots(torch.zeros(1, 2), torch.zeros(1), torch.zeros(1, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="accepted"):
        accepted_kv_slots(torch.zeros(1, 2), torch.zeros(2), torch.zeros(1, 2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="src, dst"):
        move_kv_slots([torch.zeros(1, 1, 1, 1)], torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))


def _seq(tokens):
    return Sequence("r", list(tokens), SamplingParams(max_tokens=100))


def test_verify_flow_blocks_prefix_cache_and_kv():
    bs, h, d = 4, 1, 2
    bm = BlockManager(num_blocks=12, block_size=bs)
    kc = torch.full((12, h, bs, d), float("nan"))
    vc = kc.clone()
    kv_of = {}  # position -> the K row the sequence's token there must have

    def store(seq, positions, rows):
        slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in positions])
        store_kv_cache_ref(rows, rows + 0.5, kc, vc, slots)

    seq = _seq(range(7))
    assert bm.allocate(seq, 7)
    rows = torch.randn(7, h, d)
    store(seq, range(7), rows)
    kv_of.update({p: rows[p] for p in range(7)})
    seq.num_computed_tokens = 7
    seq.append_token(50)  # sampled from the prefill
    bm.commit(seq)
    assert len(seq.block_table) == 2 and bm.num_cached_blocks == 1

    # verify step: root = token 50 at position 7 (ctx), six draft nodes as lookahead slots
    tree_parents = (-1, 0, 0, 1, 1, 3, 2)
    tree_tokens = [50, 60, 61, 62, 63, 64, 65]
    ctx = seq.num_computed_tokens
    assert bm.allocate(seq, 1, lookahead=len(tree_parents) - 1)
    assert len(seq.block_table) == bm.blocks_needed(ctx + 7) == 4
    free_during = bm.num_free_blocks
    tree_rows = torch.randn(7, h, d)
    store(seq, range(ctx, ctx + 7), tree_rows)
    path = [0, 1, 3, 5]  # accepted: nodes 1, 3, 5 (tokens 60, 62, 64), then a bonus token 70
    assert all(tree_parents[path[i]] == path[i - 1] for i in range(1, len(path)))
    src, dst = accepted_kv_slots(torch.tensor([seq.block_table]), torch.tensor([ctx]), torch.tensor([path]), bs)
    move_kv_slots([kc.unsqueeze(0), vc.unsqueeze(0)], src, dst)
    for i, node in enumerate(path):
        kv_of[ctx + i] = tree_rows[node]
    for node in path[1:]:
        seq.append_token(tree_tokens[node])
    seq.append_token(70)
    seq.num_computed_tokens = ctx + len(path)
    bm.truncate(seq, seq.num_tokens)  # 12 tokens: the 4th block held only rejected nodes
    assert seq.num_tokens == 12 and len(seq.block_table) == 3
    assert bm.num_free_blocks == free_during + 1
    bm.commit(seq)
    assert bm.num_cached_blocks == 2  # positions 0..7 full and computed; block 2 is not full

    k = gather_kv(kc, None, torch.tensor(seq.block_table), seq.num_computed_tokens)
    v = gather_kv(vc, None, torch.tensor(seq.block_table), seq.num_computed_tokens)
    expect = torch.stack([kv_of[p] for p in range(seq.num_computed_tokens)])
    assert torch.equal(k, expect) and torch.equal(v, expect + 0.5)

    # the prefix cache serves exactly the committed, moved blocks to a sequence with this prefix
    other = _seq(seq.token_ids[:11] + [99])
    hit = bm.lookup(other)
    assert hit.num_tokens == 8 and hit.blocks == tuple(seq.block_table[:2])

    # a step that accepts nothing: the blocks past the final token's slot go back
    ctx = seq.num_computed_tokens
    assert bm.allocate(seq, 1, lookahead=9)
    assert len(seq.block_table) == bm.blocks_needed(ctx + 10)
    seq.append_token(71)
    seq.num_computed_tokens = ctx + 1
    bm.truncate(seq, seq.num_tokens)
    assert seq.num_tokens == 13 and len(seq.block_table) == 4  # slot 12 (token 71) opens block 4
    assert bm.num_free_blocks == 12 - 4
    bm.free(seq)
    assert bm.num_free_blocks == 12
