"""The one-launch greedy acceptance + KV move (kernels/spec_accept.py) against the runtime's
tensor-op path it stands in for: runtime/spec/acceptance.py's greedy_accept and kv_compact.py's
accepted_kv_slots / move_kv_slots, on random trees whose target tokens match the draft's often
enough for deep paths, bf16 and fp8 caches, padded trees. Integer outputs and moved cache bytes:
equality is exact. Under TRITON_INTERPRET=1 on CPU (and on CUDA where present)."""

import pytest
import torch

from optllm.kernels.spec_accept import (
    accepted_per_size_ref,
    greedy_accept_move,
    greedy_accept_move_packed,
    greedy_accept_move_ref,
)
from optllm.kernels.tree_grow import tree_structure_ref as tree_struct_ref
from optllm.runtime.spec.acceptance import accepted_per_size, greedy_accept
from optllm.runtime.spec.kv_compact import accepted_kv_slots, move_kv_slots
from optllm.runtime.spec.tree import TreeBatch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(bsz, n, layers, h, d, bs, dtype, seed, padded=False):
    g = torch.Generator().manual_seed(seed)
    par = torch.full((bsz, n), -1, dtype=torch.int64)
    for i in range(1, n):  # half of the nodes continue the previous one: deep paths exist
        chain = torch.rand(bsz, generator=g) < 0.5
        par[:, i] = torch.where(chain, i - 1, torch.randint(0, i, (bsz,), generator=g))
    sizes = torch.full((bsz,), n, dtype=torch.int64)
    if padded:  # later trees smaller: padding nodes have parent -1
        sizes = torch.randint(1, n + 1, (bsz,), generator=g)
        sizes[0] = n
        par[torch.arange(n)[None, :] >= sizes[:, None]] = -1
        par[:, 0] = -1
    depths, mask, paths = tree_struct_ref(par)
    valid = torch.arange(n)[None, :] < sizes[:, None]
    depths, mask = depths * valid, mask & valid[:, :, None] & valid[:, None, :]
    paths = torch.where(valid[:, :, None], paths, -1)
    tokens = torch.randint(0, 6, (bsz, n), generator=g) * valid  # a small vocabulary: frequent matches
    target = torch.randint(0, 6, (bsz, n), generator=g)
    # the target agrees with a node's first child mostly (deep accepted paths)
    for b in range(bsz):
        agreed = set()
        for i in range(1, int(sizes[b])):
            p = int(par[b, i])
            if p not in agreed and torch.rand(1, generator=g) < 0.9:
                target[b, p] = tokens[b, i]
                agreed.add(p)
    if n > 2:  # sequence 0: the last node's whole path matches (its K/V off the diagonal moves)
        path = [int(x) for x in paths[0, n - 1] if x >= 0]
        for a, c in zip(path, path[1:]):
            target[0, a] = tokens[0, c]
    ctx = torch.randint(0, 40, (bsz,), generator=g)
    width = (40 + n) // bs + 2
    blocks = bsz * width
    tables = torch.randperm(blocks, generator=g).view(bsz, width).to(torch.int32)
    shape = (layers, blocks, h, bs, d)
    if dtype == torch.float8_e4m3fn:
        k = torch.randn(shape, generator=g).to(dtype)
        v = torch.randn(shape, generator=g).to(dtype)
        ks, vs = torch.rand(shape[:-1], generator=g), torch.rand(shape[:-1], generator=g)
    else:
        k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        ks = vs = None
    tree = TreeBatch(tokens, par, sizes, depths, mask, paths)
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return tree, target, ctx, tables, [dev(t) for t in (k, v, ks, vs)]


def _runtime_path(tree, target, ctx, tables, caches):
    """greedy_accept, then the KV move, as runtime/spec_runner.py did it with tensor ops."""
    res = greedy_accept(tree, target)
    bs = caches[0].shape[3]
    src, dst = accepted_kv_slots(tables, ctx, res.accepted, bs)
    move_kv_slots(caches, src, dst)
    return res


@pytest.mark.parametrize("bsz, n, layers, h, d, bs, dtype, padded", [
    (3, 9, 2, 2, 16, 8, torch.float32, False),
    (4, 41, 3, 3, 32, 16, torch.bfloat16, False),  # an EAGLE-2 step's tree (40 draft nodes)
    (2, 20, 2, 2, 16, 4, torch.float8_e4m3fn, False),  # fp8 cache with per-row scales; a block of 4
    (5, 17, 1, 1, 8, 8, torch.float32, True),  # padded trees (a batch of several sizes)
    (1, 1, 1, 2, 16, 8, torch.bfloat16, False),  # the root alone
])
def test_matches_greedy_accept_and_the_kv_move(bsz, n, layers, h, d, bs, dtype, padded):
    tree, target, ctx, tables, caches = _case(bsz, n, layers, h, d, bs, dtype, seed=n + bsz, padded=padded)
    want_caches = [None if c is None else c.clone().cpu() for c in caches]
    res = _runtime_path(tree, target, ctx, tables, want_caches)
    on = lambda t: t.to(DEV)  # noqa: E731
    acc, num, out, rows, slots = greedy_accept_move(
        *(on(t) for t in (tree.tokens, tree.parents, tree.depths, tree.mask, tree.paths, tree.sizes, target, tables,
                          ctx)), *caches, backend="triton")
    assert torch.equal(acc.cpu(), res.accepted) and torch.equal(num.cpu(), res.num_accepted)
    assert torch.equal(out.cpu(), res.tokens)
    if n > 2:  # paths of two draft tokens or more were accepted, some off the diagonal (K/V moved)
        moved = (res.accepted > torch.arange(n)[None, :]).any()
        assert int(res.num_accepted.max()) >= 2 and moved, res
    for got, want in zip(caches, want_caches):
        if got is not None:
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    # the feature store's rows and slots: the verify row of path node i, stored at ctx + i
    i = torch.arange(n)[None, :]
    want_rows = torch.where(res.accepted >= 0, torch.arange(bsz)[:, None] * n + res.accepted, 0)
    pos = ctx[:, None] + i
    table = tables.long()
    want_slots = torch.where(i <= res.num_accepted[:, None],
                             table.gather(1, (pos // bs).clamp_max(table.shape[1] - 1)) * bs + pos % bs, -1)
    assert torch.equal(rows.cpu(), want_rows) and torch.equal(slots.cpu(), want_slots)
    # and the torch reference in kernels/ equals the runtime path too
    ref_caches = [None if c is None else c.clone() for c in _case(bsz, n, layers, h, d, bs, dtype, seed=n + bsz,
                                                                  padded=padded)[4]]
    r = greedy_accept_move_ref(tree.tokens, tree.parents, tree.depths, tree.mask, tree.paths, tree.sizes, target,
                               tables, ctx, *[None if c is None else c.cpu() for c in ref_caches])
    assert torch.equal(r[0], res.accepted) and torch.equal(r[2], res.tokens)


def test_a_shared_tree_structure_expanded_over_the_batch():
    """A Medusa step's TreeBatch: one static tree's parents, depths, mask and paths expanded over
    the batch (batch stride 0), its own tokens per sequence."""
    tree, target, ctx, tables, caches = _case(3, 12, 2, 2, 16, 8, torch.float32, seed=5)
    one = [t[:1].expand(3, *t.shape[1:]) for t in (tree.parents, tree.depths, tree.mask, tree.paths)]
    shared = TreeBatch(tree.tokens, one[0], tree.sizes, one[1], one[2], one[3])
    want_caches = [None if c is None else c.clone().cpu() for c in caches]
    res = _runtime_path(shared, target, ctx, tables, want_caches)
    acc, num, out, _, _ = greedy_accept_move(
        *(t.to(DEV) for t in (shared.tokens, *one[:3])), one[3].to(DEV), shared.sizes.to(DEV), target.to(DEV),
        tables.to(DEV), ctx.to(DEV), *caches, backend="triton")
    assert torch.equal(acc.cpu(), res.accepted) and torch.equal(out.cpu(), res.tokens)
    assert torch.equal(caches[0].cpu(), want_caches[0]) and torch.equal(caches[1].cpu(), want_caches[1])


def test_a_broken_path_stops_at_the_first_mismatch():
    """A chain 0-1-2-3 whose node 2 mismatches: one draft token accepted, the target's token at node 1
    emitted; node 1's K/V moves nowhere (already in place)."""
    par = torch.tensor([[-1, 0, 1, 2]])
    depths, mask, paths = tree_struct_ref(par)
    tokens = torch.tensor([[7, 3, 4, 5]])
    target = torch.tensor([[3, 9, 5, 1]])  # after node 0: 3 (= node 1), after node 1: 9 (!= node 2)
    k = torch.arange(1 * 2 * 1 * 4 * 16, dtype=torch.float32).view(1, 2, 1, 4, 16)
    v = -k.clone()
    before = k.clone()
    acc, num, out, rows, slots = greedy_accept_move(
        *(t.to(DEV) for t in (tokens, par, depths, mask, paths, torch.tensor([4]), target,
                              torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([2]))),
        k.to(DEV), v.to(DEV), backend="triton")
    assert acc.cpu().tolist() == [[0, 1, -1, -1]] and num.cpu().tolist() == [1]
    assert out.cpu().tolist() == [[3, 9, -1, -1]]
    assert torch.equal(k, before)


def test_too_many_nodes_is_refused():
    z = torch.zeros(1, 129, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most 128"):
        greedy_accept_move(z, z, z, torch.zeros(1, 129, 129, dtype=torch.bool), z[:, :, None], torch.tensor([129]),
                           z, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64),
                           torch.zeros(1, 1, 1, 8, 8), torch.zeros(1, 1, 1, 8, 8))


@pytest.mark.parametrize("bsz, n, dtype, padded", [(6, 9, torch.float32, False), (4, 41, torch.bfloat16, False),
                                                   (5, 17, torch.float32, True)])
def test_first_match_takes_a_repeated_token_at_its_first_sibling_only(bsz, n, dtype, padded):
    """Sampled verification (first_match): the random trees' small vocabulary repeats tokens among
    siblings; the kernel equals its reference (paths, tokens, rows, slots, moved caches), no accepted
    node repeats an earlier sibling's token, and on the full trees the rule changes some outcome
    (where the deepest-path rule alone would take a later duplicate)."""
    found_change = False
    for seed in range(4):
        tree, target, ctx, tables, caches = _case(bsz, n, 2, 2, 16, 8, dtype, seed=100 + seed, padded=padded)
        ref_caches = [None if c is None else c.clone().cpu() for c in caches]
        on = lambda t: t.to(DEV)  # noqa: E731
        args = (tree.tokens, tree.parents, tree.depths, tree.mask, tree.paths, tree.sizes, target, tables, ctx)
        got = greedy_accept_move(*(on(t) for t in args), *caches, backend="triton", first_match=True)
        want = greedy_accept_move_ref(*args, *ref_caches, first_match=True)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b)
        for a, b in zip(caches, ref_caches):
            if a is not None:
                assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
        acc = want[0]
        for bi in range(bsz):
            for node in acc[bi].tolist():
                if node <= 0:
                    continue
                p, t = int(tree.parents[bi, node]), int(tree.tokens[bi, node])
                earlier = [j for j in range(node) if int(tree.parents[bi, j]) == p and int(tree.tokens[bi, j]) == t]
                assert not earlier, (bi, node, earlier)
        plain = greedy_accept_move_ref(*args, *[None if c is None else c.clone().cpu() for c in caches])
        found_change = found_change or not torch.equal(plain[0], acc)
    assert found_change or padded  # (the padded trees are small: no such case among these seeds)


def _ranks(tree, seed):
    """Each node's rank by a random score that falls along every path (a parent ranks before its
    children, as an EAGLE-2 selection's ranks do): int64 [B, N], the root 0."""
    g = torch.Generator().manual_seed(seed)
    bsz, n = tree.tokens.shape
    score = torch.zeros(bsz, n)
    for i in range(1, n):  # parents precede children
        score[:, i] = score.gather(1, tree.parents[:, i:i + 1].clamp_min(0))[:, 0] - torch.rand(bsz, generator=g)
    order = score.argsort(dim=1, descending=True, stable=True)
    return torch.empty_like(order).scatter_(1, order, torch.arange(n).expand(bsz, n).contiguous())


@pytest.mark.parametrize("bsz, n, menu, first, padded", [
    (4, 41, [41, 20, 10, 5, 2], False, False),  # the default EAGLE menu
    (3, 61, [61, 30, 15, 7, 3], True, False),  # sampled verification, a depth-7 menu
    (5, 17, [2, 17, 9], False, True),  # padded trees; an unsorted menu, one size
])
def test_the_packed_row_holds_the_results_and_each_menu_sizes_acceptance(bsz, n, menu, first, padded):
    """greedy_accept_move_packed's row a sequence: num, tokens, the accepted path (what
    greedy_accept_move returns), then per menu size m the draft tokens the tree of the first m ranks
    would have accepted, as accepted_per_size_ref counts them (the runtime's accepted_per_size).
    Random ranks that fall along every path; the menu's smallest size cuts some path short."""
    tree, target, ctx, tables, caches = _case(bsz, n, 2, 2, 16, 8, torch.float32, seed=7 * n, padded=padded)
    ranks = _ranks(tree, seed=n)
    sizes = torch.tensor(menu)
    on = lambda t: t.to(DEV)  # noqa: E731
    args = (tree.tokens, tree.parents, tree.depths, tree.mask, tree.paths, tree.sizes, target, tables, ctx)
    ref_caches = [None if c is None else c.clone().cpu() for c in caches]
    packed, rows, slots = greedy_accept_move_packed(*(on(t) for t in args), *caches, backend="triton",
                                                    first_match=first, ranks=on(ranks), menu=on(sizes))
    acc, num, out, want_rows, want_slots = greedy_accept_move_ref(*args, *ref_caches, first_match=first)
    per = accepted_per_size_ref(acc, ranks, sizes)
    assert torch.equal(per, accepted_per_size(acc, ranks, sizes))
    assert packed.shape == (bsz, 1 + 2 * n + len(menu))
    assert torch.equal(packed.cpu(), torch.cat([num[:, None], out, acc, per], dim=1))
    assert torch.equal(rows.cpu(), want_rows) and torch.equal(slots.cpu(), want_slots)
    small = menu.index(min(menu))
    assert (per[:, small] < num).any() and (per <= num[:, None]).all(), (per, num)  # the smallest cuts a path
    # the per-size count by hand for one sequence: the path's nodes before its first of rank >= m
    b = int(num.argmax())
    path = [a for a in acc[b, 1:].tolist() if a >= 0]
    for j, m in enumerate(menu):
        want = next((c for c, a in enumerate(path) if int(ranks[b, a]) >= m), len(path))
        assert int(per[b, j]) == want
    # the torch path packs the same, and without a menu the row ends at the path
    packed_t, _, _ = greedy_accept_move_packed(*args, *[None if c is None else c.clone().cpu() for c in caches],
                                               backend="torch", first_match=first, ranks=ranks, menu=sizes)
    assert torch.equal(packed_t, packed.cpu())
    plain, _, _ = greedy_accept_move_packed(*(on(t) for t in args), *caches, backend="triton", first_match=first)
    assert torch.equal(plain.cpu(), packed.cpu()[:, :1 + 2 * n])
    with pytest.raises(ValueError, match="both or neither"):
        greedy_accept_move_packed(*args, *ref_caches, ranks=ranks)
    with pytest.raises(ValueError, match="must be int64"):
        greedy_accept_move_packed(*args, *ref_caches, ranks=ranks, menu=sizes.int())
