"""The one-launch tree structure (depths, ancestor-or-self mask, root-to-node paths) against the
node-by-node torch reference and against TreeBatch.build, the tensor-op path it stands in for in a
speculative step: integer outputs, so equality is exact. Under TRITON_INTERPRET=1 on CPU (and on
CUDA where present)."""

import pytest
import torch

from optllm.kernels.tree_struct import tree_struct, tree_struct_ref
from optllm.runtime.spec.tree import TreeBatch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _random_parents(bsz: int, n: int, seed: int, chain: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    par = torch.full((bsz, n), -1, dtype=torch.int64)
    for i in range(1, n):
        par[:, i] = i - 1 if chain else torch.randint(0, i, (bsz,), generator=g)
    return par


@pytest.mark.parametrize("bsz, n, chain", [(3, 9, False), (2, 41, False), (1, 1, False), (4, 6, True), (5, 64, False)])
def test_matches_the_reference_and_tree_batch(bsz, n, chain):
    par = _random_parents(bsz, n, seed=n, chain=chain)
    ref = tree_struct_ref(par)
    depth = int(ref[0].max())
    got = tree_struct(par.to(DEV), depth, backend="triton")
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and torch.equal(g.cpu(), r)
    tb = TreeBatch.build(torch.zeros_like(par), par, validate=True)
    assert torch.equal(tb.depths, ref[0]) and torch.equal(tb.mask, ref[1]) and torch.equal(tb.paths, ref[2])
    # a looser bound (the builder's depth) changes nothing
    looser = tree_struct(par.to(DEV), n + 3, backend="triton")
    assert all(torch.equal(a.cpu(), b) for a, b in zip(looser, ref))


def test_hand_built_tree():
    par = torch.tensor([[-1, 0, 0, 1, 3, 2]])
    depths, mask, paths = tree_struct(par.to(DEV), 3, backend="triton")
    assert depths.tolist() == [[0, 1, 1, 2, 3, 2]]
    assert mask[0, 4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert paths[0, 4].tolist() == [0, 1, 3, 4, -1, -1] and paths[0, 5].tolist() == [0, 2, 5, -1, -1, -1]


def test_bad_inputs_are_one_error():
    with pytest.raises(ValueError, match="parents"):
        tree_struct(torch.zeros(3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="parents"):
        tree_struct(torch.zeros(1, 3, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="max_depth"):
        tree_struct(torch.tensor([[-1, 0]]), -1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bsz, n", [(1, 41), (64, 41), (8, 21)])
def test_cuda_trees_of_a_speculative_step(bsz, n):
    par = _random_parents(bsz, n, seed=bsz + n)
    ref = tree_struct_ref(par)
    got = tree_struct(par.cuda(), int(ref[0].max()))
    assert all(torch.equal(g.cpu(), r) for g, r in zip(got, ref))
