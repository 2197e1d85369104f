"""Tree attention over the paged KV cache (kernels/tree_attention.py), Triton under
TRITON_INTERPRET=1 on CPU against the torch reference and against dense float64 attention.

Each batch holds sequences with different context lengths (0, within one block, across
blocks) and tree sizes (1 up to N, so rows past a tree's size are padding), random trees,
GQA, shuffled non-contiguous blocks; unused table entries and unwritten slots are NaN, so
reading a wrong key shows as NaN. The tree's K/V sit at positions context_len + i.

Error bounds (max |out - expected| / max |expected|):
    fp32 q and cache: 2e-5 against the reference and against float64 dense attention
        (ieee fp32 dots; the kernel differs only in summation order).
    bf16 q and cache: 2e-2 against float64 attention on the same bf16-rounded inputs (the
        kernel rounds its output to bf16, 2^-9, and on a GPU p to bf16 before p.V).
Padding rows must be exactly zero.
"""

import pytest
import torch

from optllm.kernels.extend_attention import paged_extend_attention_ref
from optllm.kernels.paged_attention import store_kv_cache_ref
from optllm.kernels.tree_attention import paged_tree_attention, paged_tree_attention_ref
from optllm.runtime.spec.tree import TokenTree, TreeBatch

BOUND = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _random_tree(size: int, g: torch.Generator) -> TokenTree:
    return TokenTree(tuple([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, size)]))


def _case(ctx_lens, sizes, n, hq, h, d, bs, dtype, seed, device="cpu"):
    """Caches holding each sequence's context + tree K/V, q, the tree batch and dense float64 K/V."""
    g = torch.Generator().manual_seed(seed)
    totals = [c + s for c, s in zip(ctx_lens, sizes)]
    nblk = [-(-t // bs) for t in totals]
    spare = 3
    num_blocks = sum(nblk) + spare
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[sum(nblk):][torch.randint(0, spare, (len(totals), max(nblk) + 2), generator=g)].int()
    start = 0
    for b, nb in enumerate(nblk):
        table[b, :nb] = perm[start:start + nb].int()
        start += nb
    kc = torch.full((num_blocks, h, bs, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    ks = [torch.randn(t, h, d, generator=g).to(dtype) for t in totals]
    vs = [torch.randn(t, h, d, generator=g).to(dtype) for t in totals]
    slots = torch.cat([table[b, torch.arange(t) // bs].long() * bs + torch.arange(t) % bs
                       for b, t in enumerate(totals)])
    store_kv_cache_ref(torch.cat(ks), torch.cat(vs), kc, vc, slots)
    trees = [_random_tree(s, g) for s in sizes]
    batch = TreeBatch.from_trees(trees, [[0] * t.size for t in trees])
    mask = torch.zeros(len(sizes), n, n, dtype=torch.bool)
    mask[:, :batch.num_nodes, :batch.num_nodes] = batch.mask
    q = torch.randn(len(sizes), n, hq, d, generator=g).to(dtype)
    to = dict(device=device)
    return dict(q=q.to(**to), k_cache=kc.to(**to), v_cache=vc.to(**to), block_tables=table.to(**to),
                context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
                tree_sizes=torch.tensor(sizes, dtype=torch.int32, device=device), tree_mask=mask.to(**to)), ks, vs


def _dense(case, ks, vs, scale):
    """float64 attention from the un-paged K/V with explicit visibility, row by row."""
    q = case["q"].cpu().double()
    out = torch.zeros_like(q)
    hq, h = q.shape[2], ks[0].shape[1]
    for b, (ctx, n) in enumerate(zip(case["context_lens"].tolist(), case["tree_sizes"].tolist())):
        k = ks[b].double().repeat_interleave(hq // h, dim=1)
        v = vs[b].double().repeat_interleave(hq // h, dim=1)
        for i in range(n):
            keys = list(range(ctx)) + [ctx + j for j in range(n) if case["tree_mask"][b, i, j]]
            s = torch.einsum("hd,khd->hk", q[b, i], k[keys]) * scale
            out[b, i] = torch.einsum("hk,khd->hd", s.softmax(dim=-1), v[keys])
    return out


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


CASES = [
    # ctx_lens, tree sizes, N, q heads, kv heads, head_dim, block_size
    ([0, 5, 13], [3, 7, 1], 7, 4, 2, 16, 4),
    ([9, 2], [5, 2], 6, 6, 2, 32, 8),  # G = 3: not a power of two
    ([21, 0, 4, 16], [4, 4, 2, 3], 4, 2, 2, 16, 4),  # G = 1
]


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("ci", range(len(CASES)))
def test_triton_matches_reference_and_dense_fp32(ci, splits):
    ctx, sizes, n, hq, h, d, bs = CASES[ci]
    case, ks, vs = _case(ctx, sizes, n, hq, h, d, bs, torch.float32, seed=ci)
    scale = d ** -0.5
    out = paged_tree_attention(**case, scale=scale, num_splits=splits, backend="triton")
    ref = paged_tree_attention_ref(**case, scale=scale)
    dense = _dense(case, ks, vs, scale)
    live = torch.arange(n)[None, :] < case["tree_sizes"][:, None].long()
    assert not out.isnan().any()
    assert _rel(out[live], ref[live]) < BOUND[torch.float32]
    assert _rel(out[live], dense[live]) < BOUND[torch.float32]
    assert _rel(ref[live], dense[live]) < BOUND[torch.float32]
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))  # padding rows: exactly zero


def test_bf16_against_dense():
    ctx, sizes, n, hq, h, d, bs = CASES[0]
    case, ks, vs = _case(ctx, sizes, n, hq, h, d, bs, torch.bfloat16, seed=7)
    out = paged_tree_attention(**case, scale=d ** -0.5, num_splits=2, backend="triton")
    assert out.dtype == torch.bfloat16
    live = torch.arange(n)[None, :] < case["tree_sizes"][:, None].long()
    assert _rel(out[live], _dense(case, ks, vs, d ** -0.5)[live]) < BOUND[torch.bfloat16]


def test_reference_equals_extend_attention_with_a_tree_mask():
    """The padded tree layout gives what the ragged extend reference gives with the same masks."""
    ctx, sizes, n, hq, h, d, bs = CASES[0]
    case, _, _ = _case(ctx, sizes, n, hq, h, d, bs, torch.float32, seed=3)
    ref = paged_tree_attention_ref(**case, scale=0.25)
    q_flat = torch.cat([case["q"][b, :s] for b, s in enumerate(sizes)])
    cu = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    flat_mask = torch.cat([case["tree_mask"][b, :s, :s].reshape(-1) for b, s in enumerate(sizes)])
    offsets = torch.tensor([0] + torch.tensor([s * s for s in sizes]).cumsum(0).tolist()[:-1], dtype=torch.int64)
    ext = paged_extend_attention_ref(q_flat, case["k_cache"], case["v_cache"], case["block_tables"],
                                     case["context_lens"] + case["tree_sizes"], cu, 0.25, mask=flat_mask,
                                     mask_offsets=offsets)
    assert torch.allclose(torch.cat([ref[b, :s] for b, s in enumerate(sizes)]), ext, rtol=0, atol=1e-6)


def test_a_node_attends_only_to_its_ancestors():
    """Changing the K/V of a node outside a row's ancestors leaves that row unchanged."""
    case, _, _ = _case([6], [5], 5, 2, 1, 16, 4, torch.float32, seed=11)
    case["tree_mask"][0] = TokenTree((-1, 0, 0, 1, 2)).attention_mask()
    before = paged_tree_attention(**case, scale=0.3, backend="triton")
    slot = int(case["block_tables"][0, (6 + 2) // 4]) * 4 + (6 + 2) % 4  # node 2's K/V
    case["k_cache"].view(-1, 16)[slot] += 5.0
    after = paged_tree_attention(**case, scale=0.3, backend="triton")
    for i in (0, 1, 3):  # not descendants of node 2: unchanged
        assert torch.equal(before[0, i], after[0, i])
    for i in (2, 4):
        assert not torch.allclose(before[0, i], after[0, i])


def test_bad_inputs_are_one_error():
    case, _, _ = _case([3], [2], 2, 2, 1, 16, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="tree_mask"):
        paged_tree_attention(**{**case, "tree_mask": case["tree_mask"][:, :1]}, scale=1.0)
    with pytest.raises(ValueError, match="q:"):
        paged_tree_attention(**{**case, "q": case["q"][0]}, scale=1.0)
    with pytest.raises(ValueError, match="context_lens"):
        paged_tree_attention(**{**case, "context_lens": case["context_lens"].long()}, scale=1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_dense(dtype):
    case, ks, vs = _case([700, 33, 0, 1500], [31, 64, 12, 1], 64, 32, 8, 128, 16, dtype, seed=5, device="cuda")
    out = paged_tree_attention(**case, scale=128 ** -0.5)
    live = torch.arange(64, device="cuda")[None, :] < case["tree_sizes"][:, None].long()
    dense = _dense(case, ks, vs, 128 ** -0.5).cuda()
    bound = 1e-4 if dtype == torch.float32 else BOUND[dtype]  # fp32: ieee dots, 2.3k keys summed
    assert _rel(out[live], dense[live]) < bound
