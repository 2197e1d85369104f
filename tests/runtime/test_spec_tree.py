"""Token trees (runtime/spec/tree.py): depths, masks, retrieval indices and sibling links
checked exactly against hand-built trees; the padded batch against the per-tree host
version; Medusa choices; EAGLE-2 expansion against a brute-force enumeration of every
token path on a small vocabulary."""

import itertools

import pytest
import torch

from optllm.kernels.tree_grow import grow, new_pool, select
from optllm.runtime.spec.tree import StaticTree, TokenTree, TreeBatch

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
HAND = TokenTree((-1, 0, 0, 1, 1, 2, 3))
HAND_MASK = [
    [1, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0],
    [1, 1, 0, 0, 1, 0, 0],
    [1, 0, 1, 0, 0, 1, 0],
    [1, 1, 0, 1, 0, 0, 1],
]
HAND_RETRIEVE = [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]


def test_hand_built_tree():
    t = HAND
    assert t.depths == (0, 1, 1, 2, 2, 2, 3)
    assert t.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert t.leaves == (4, 5, 6)
    assert t.positions(10) == [10, 11, 11, 12, 12, 12, 13]
    assert t.attention_mask().int().tolist() == HAND_MASK
    assert t.retrieval_indices().tolist() == HAND_RETRIEVE
    assert TokenTree((-1,)).retrieval_indices().tolist() == [[0]]
    chain = TokenTree((-1, 0, 1, 2))
    assert chain.attention_mask().int().tolist() == torch.tril(torch.ones(4, 4)).int().tolist()
    assert chain.retrieval_indices().tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("parents", [(), (0,), (-1, 1), (-1, 0, 2), (-1, 0, -1), (-1, 0.5)])
def test_bad_parents_are_refused(parents):
    with pytest.raises(ValueError, match="parents"):
        TokenTree(parents)


def test_batch_of_different_sizes_matches_the_host_trees():
    chain = TokenTree((-1, 0, 1))
    single = TokenTree((-1,))
    trees = [HAND, chain, single]
    tokens = [[9, 1, 2, 3, 4, 5, 6], [7, 8, 9], [5]]
    tb = TreeBatch.from_trees(trees, tokens)
    assert tb.num_nodes == 7 and tb.sizes.tolist() == [7, 3, 1]
    assert tb.tokens.tolist() == [[9, 1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0]]
    for b, t in enumerate(trees):
        n = t.size
        assert tb.mask[b, :n, :n].tolist() == t.attention_mask().tolist()
        assert not tb.mask[b, n:].any() and not tb.mask[b, :, n:].any()  # padding: no entries
        assert tb.depths[b, :n].tolist() == list(t.depths) and not tb.depths[b, n:].any()
        assert tb.positions(torch.tensor([4, 5, 6]))[b, :n].tolist() == t.positions(4 + b)
        assert torch.equal(tb.retrieval_indices(b), t.retrieval_indices())
        assert tb.leaves[b].nonzero().flatten().tolist() == list(t.leaves)
        for i in range(n):
            assert tb.paths[b, i, :t.depths[i] + 1].tolist() == list(t.path(i))
            assert (tb.paths[b, i, t.depths[i] + 1:] == -1).all()
    assert tb.parents.tolist()[1] == [-1, 0, 1, -1, -1, -1, -1]
    # hand-checked sibling links of HAND: 1 -> 2; 3 -> 4; nothing else
    assert tb.first_child[0].tolist() == [1, 3, 5, 6, -1, -1, -1]
    assert tb.next_sibling[0].tolist() == [-1, 2, -1, 4, -1, -1, -1]
    assert tb.first_child[1].tolist() == [1, 2, -1, -1, -1, -1, -1]
    assert (tb.next_sibling[1:] == -1).all() and (tb.first_child[2] == -1).all()


def test_build_validates_parents():
    tok = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="parents"):
        TreeBatch.build(tok, torch.tensor([[-1, 0, 2]]))
    with pytest.raises(ValueError, match="sizes"):
        TreeBatch.build(tok, torch.tensor([[-1, 0, 1]]), torch.tensor([4]))
    # entries past a tree's size are ignored
    tb = TreeBatch.build(tok, torch.tensor([[-1, 0, 7]]), torch.tensor([2]))
    assert tb.parents.tolist() == [[-1, 0, -1]]


def test_medusa_choices():
    choices = [[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]]
    st = StaticTree.from_choices(choices)
    # sorted by (length, path): (), (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)
    assert st.choices == ((), (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert st.tree.parents == (-1, 0, 0, 0, 1, 1, 2, 4)
    assert (st.num_heads, st.top_k) == (3, 3)
    topk = torch.arange(2 * 4 * 3).view(2, 4, 3)  # [B, heads, K]: head h rank r -> 12 b + 3 h + r
    tok = st.tokens(torch.tensor([100, 200]), topk)
    assert tok.tolist() == [[100, 0, 1, 2, 3, 4, 3, 6], [200, 12, 13, 14, 15, 16, 15, 18]]
    tb = st.batch(torch.tensor([100, 200]), topk)
    assert tb.mask[1].tolist() == st.tree.attention_mask().tolist()
    assert torch.equal(tb.retrieval_indices(0), st.tree.retrieval_indices())
    with pytest.raises(ValueError, match="no parent"):
        StaticTree.from_choices([[0, 0]])
    with pytest.raises(ValueError, match="twice"):
        StaticTree.from_choices([[0], [0]])
    with pytest.raises(ValueError, match="topk_ids"):
        st.tokens(torch.tensor([1, 2]), topk[:, :2])


# --------------------------------------------------------------------------- EAGLE-2
V = 5


def _draft_logprobs(path: tuple[int, ...], seed: int) -> torch.Tensor:
    """A fixed 'draft model': log-probs [V] after the token path (root token first)."""
    g = torch.Generator().manual_seed(hash((seed,) + path) % (2**31))
    return (2.0 * torch.randn(V, generator=g)).log_softmax(dim=-1)


def _brute_force(root: int, seed: int, top_k: int, depth: int, num_draft: int) -> dict:
    """EAGLE-2 by enumeration: every token path up to `depth` with its cumulative log-prob;
    a path is a candidate iff its parent path is expanded (the root, or on the frontier of
    its level) and it is among the parent's top_k children; a level's frontier is its top_k
    candidates; the result is the num_draft best candidates. Returns {path: score}."""
    score = {(): 0.0}
    for n in range(1, depth + 1):
        for path in itertools.product(range(V), repeat=n):
            score[path] = score[path[:-1]] + float(_draft_logprobs((root,) + path[:-1], seed)[path[-1]])
    expanded, candidates = {()}, []
    for n in range(1, depth + 1):
        level = []
        for parent in expanded:
            kids = sorted(range(V), key=lambda t: -score[parent + (t,)])[:top_k]
            level += [parent + (t,) for t in kids]
        candidates += level
        expanded = set(sorted(level, key=lambda p: -score[p])[:top_k])
    best = sorted(candidates, key=lambda p: -score[p])[:num_draft]
    return {p: score[p] for p in best}


def _grow(roots, seeds, top_k, depth, num_draft, backend):
    """kernels/tree_grow.py driven by the same draft model, for a batch: each level fed the k
    best log-probs (clamped to <= 0, descending) after each frontier node, as the runtime's
    kernels/topk.py gives them."""
    def ranked(rows):
        return torch.topk(rows.clamp_max(0.0), top_k, dim=-1)

    bsz = len(roots)
    pool = new_pool(bsz, top_k, depth, "cpu")
    s, t = ranked(torch.stack([_draft_logprobs((r,), sd) for r, sd in zip(roots, seeds)]))
    front = grow(pool, 1, s.view(bsz, 1, top_k), t.view(bsz, 1, top_k), torch.zeros(bsz, 1, 1),
                 roots=torch.tensor(roots), last=depth == 1, backend=backend)
    size = 1 + top_k
    for d in range(1, depth):
        tokens, parents = pool.tokens.tolist(), pool.parents.tolist()
        rows = []
        for b, nodes in enumerate(front.ids.tolist()):
            per = []
            for node in nodes:
                path = []
                while node >= 0:
                    path.append(tokens[b][node])
                    node = parents[b][node]
                per.append(_draft_logprobs(tuple(reversed(path)), seeds[b]))
            rows.append(torch.stack(per))
        s, t = ranked(torch.stack(rows))
        front = grow(pool, size, s, t, torch.zeros(bsz, top_k, 1), front=front, last=d == depth - 1,
                     backend=backend)
        size += top_k * top_k
    return select(pool, num_draft + 1, depth, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("top_k,depth,num_draft", [(2, 3, 1), (2, 3, 4), (2, 3, 10), (3, 3, 7), (3, 2, 12), (1, 4, 4)])
def test_eagle2_matches_brute_force(top_k, depth, num_draft, backend):
    roots, seeds = [3, 1], [10, 11]
    tb = _grow(roots, seeds, top_k, depth, num_draft, backend)
    assert tb.tokens.shape == (2, num_draft + 1)
    for b in range(2):
        expect = _brute_force(roots[b], seeds[b], top_k, depth, num_draft)
        got = {}
        for i in range(1, num_draft + 1):
            path = tb.paths[b, i][tb.paths[b, i] >= 0].tolist()
            assert path[0] == 0 and tb.parents[b, i] == path[-2]  # a tree: every parent kept
            assert tb.parents[b, i] < i  # topological order
            got[tuple(tb.tokens[b, path[1:]].tolist())] = float(tb.scores[b, i])
        assert tb.tokens[b, 0] == roots[b]
        assert set(got) == set(expect)
        for p in got:
            assert got[p] == pytest.approx(expect[p], abs=1e-5)
        assert tb.depths[b].max() <= depth


def test_eagle2_bad_arguments():
    """The runtime's options are checked where the engine is configured (EngineConfig), and
    again by the speculative decoder for direct use."""
    from optllm.kernels import tree_grow
    from optllm.runtime.config import TREE_MAX_NODES, EngineConfig

    assert TREE_MAX_NODES == tree_grow.MAX_NODES

    with pytest.raises(ValueError, match="spec_num_draft=7"):
        EngineConfig(model="m", spec_top_k=2, spec_depth=2, spec_num_draft=7)
    with pytest.raises(ValueError, match="spec_top_k"):
        EngineConfig(model="m", spec_top_k=0, spec_depth=2, spec_num_draft=1)
    with pytest.raises(ValueError, match="spec_num_draft=128"):
        EngineConfig(model="m", spec_top_k=10, spec_depth=3, spec_num_draft=128)
