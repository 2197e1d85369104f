"""EAGLE-2 growth in depth + 1 launches (kernels/tree_grow.py) against its torch references, a
whole growth at a time: every level's pool columns, frontier (ids, scores, tokens), next input
features and ancestor mask, then the selected trees (tokens, parents, ranks, scores, depths,
mask, paths). Log-probs rounded to quarters so that equal scores are common (ties decide both
top-k choices). Everything is an integer, a bool, a copied feature or one float32 add in the
same order: equality is exact. The references themselves are checked against a brute-force
enumeration in tests/runtime/test_spec_tree.py, and the mask here against the ancestry the pool
records. Under TRITON_INTERPRET=1 on CPU (and on CUDA where present)."""

import pytest
import torch

from optllm.kernels.tree_grow import (
    Pool,
    grow,
    grow_launch,
    new_pool,
    pool_size,
    select,
    select_launch,
    tree_structure_ref,
)
from optllm.runtime.spec.tree import TreeBatch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ranked(g, shape, k, vocab=40, quant=4.0):
    x = torch.log_softmax(torch.randn(*shape, vocab, generator=g) * 2, dim=-1)
    x = (x * quant).round() / quant  # ties
    s, t = torch.topk(x.clamp_max(0.0), k, dim=-1)
    return s.float(), t


def _inputs(bsz, k, depth, h, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    roots = torch.randint(0, 40, (bsz,), generator=g)
    states = torch.randn(bsz, h, generator=g).to(dtype)
    levels = [_ranked(g, (bsz,), k)] + [_ranked(g, (bsz, k), k) for _ in range(depth - 1)]
    outs = [torch.randn(bsz, k, h, generator=g).to(dtype) for _ in range(depth - 1)]
    return roots, states, levels, outs


def _growth(inputs, k, depth, n, backend, dev="cpu"):
    roots, states, levels, outs = (x.to(dev) if torch.is_tensor(x) else [tuple(t.to(dev) for t in y)
                                   if isinstance(y, tuple) else y.to(dev) for y in x] for x in inputs)
    bsz, h = states.shape
    # the roots as a step graph gives them: the last column of its [B, G] token window
    roots = torch.stack([torch.zeros_like(roots), roots], dim=1)[:, -1]
    pool = new_pool(bsz, k, depth, dev)
    s, t = levels[0]
    fronts = [grow(pool, 1, s.view(bsz, 1, k), t.view(bsz, 1, k), states.view(bsz, 1, h), roots=roots,
                   last=depth == 1, backend=backend)]
    size = 1 + k
    for d in range(1, depth):
        s, t = levels[d]
        fronts.append(grow(pool, size, s, t, outs[d - 1], front=fronts[-1], last=d == depth - 1, backend=backend))
        size += k * k
    assert size == pool_size(k, depth) == pool.tokens.shape[1]
    return pool, fronts, select(pool, n, depth, backend=backend)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("bsz, k, depth, n, h", [(3, 4, 4, 12, 6), (2, 8, 5, 20, 16), (4, 3, 3, 21, 5),
                                                 (2, 1, 6, 6, 3), (1, 5, 1, 4, 7), (2, 2, 2, 1, 4),
                                                 (3, 10, 3, 64, 300), (2, 16, 2, 30, 8), (1, 12, 2, 128, 4)])
def test_a_whole_growth_equals_the_references(bsz, k, depth, n, h):
    inputs = _inputs(bsz, k, depth, h, seed=bsz * 100 + k * 10 + depth)
    ref_pool, ref_fronts, ref_tree = _growth(inputs, k, depth, n, "torch")
    pool, fronts, tree = _growth(inputs, k, depth, n, "triton", DEV)
    for a, b in zip(pool, ref_pool):
        _same(a, b)
    assert fronts[-1] is None and ref_fronts[-1] is None
    for f, rf in zip(fronts[:-1], ref_fronts[:-1]):
        for a, b in zip(f, rf):
            _same(a, b)
    for a, b in zip(tree, ref_tree):
        _same(a, b)
    # the selected trees are trees, their structure what TreeBatch.build computes
    tb = TreeBatch.build(ref_tree.tokens, ref_tree.parents, validate=True)
    assert torch.equal(tb.depths, ref_tree.depths) and torch.equal(tb.mask, ref_tree.mask)
    assert torch.equal(tb.paths, ref_tree.paths) and int(tb.depths.max()) <= depth
    # the ranks order the kept scores (descending, ties by creation)
    order = torch.sort(ref_tree.scores, dim=1, descending=True, stable=True).indices
    assert torch.equal(torch.argsort(order, dim=1), ref_tree.ranks)


def test_frontier_features_and_mask_follow_the_pool():
    """Independently of the references: each frontier node's features are its parent's draft
    output row, and its mask row marks exactly its ancestors-or-self among the draft's scratch
    rows (row (d - 1) k + j holds level d's frontier node j)."""
    bsz, k, depth, h = 3, 4, 5, 8
    inputs = _inputs(bsz, k, depth, h, seed=7)
    pool, fronts, _ = _growth(inputs, k, depth, 17, "triton", DEV)
    pool = [x.cpu() for x in pool]
    states, outs = inputs[1], inputs[3]
    ids = [f.ids.cpu() for f in fronts[:-1]]
    for d, f in enumerate(fronts[:-1], start=1):  # f: level d's rows
        assert f.mask.shape == (bsz, k, d * k)
        for b in range(bsz):
            for j in range(k):
                node = int(ids[d - 1][b, j])
                parent = int(pool[2][b, node])
                prev = states[b] if d == 1 else outs[d - 2][b, ids[d - 2][b].tolist().index(parent)]
                assert torch.equal(f.features[b, j].cpu(), prev)
                assert int(f.tokens[b, j]) == int(pool[0][b, node]) and float(f.scores[b, j]) == float(pool[1][b, node])
                want, a = set(), node  # the scratch rows of node's ancestors-or-self (the root has none)
                while a > 0:
                    lv = next(e for e in range(d) if a in ids[e][b].tolist())
                    want.add(lv * k + ids[lv][b].tolist().index(a))
                    a = int(pool[2][b, a])
                assert set(f.mask[b, j].nonzero().flatten().tolist()) == want


def test_bf16_features_and_every_tie():
    """bf16 draft outputs are copied bit for bit; all log-probs 0 (every candidate ties): the
    kept set is the first candidates created, a tree."""
    bsz, k, depth = 2, 2, 3
    roots = torch.tensor([3, 4])
    states = torch.randn(bsz, 5).bfloat16()
    zeros = (torch.zeros(bsz, k), torch.arange(k).expand(bsz, k).contiguous())
    lv = (torch.zeros(bsz, k, k), torch.arange(k).expand(bsz, k, k).contiguous())
    outs = [torch.randn(bsz, k, 5).bfloat16() for _ in range(depth - 1)]
    for be, dev in (("torch", "cpu"), ("triton", DEV)):
        _, fronts, tree = _growth((roots, states, [zeros, lv, lv], outs), k, depth, 6, be, dev)
        assert tree.parents.tolist() == [[-1, 0, 0, 1, 1, 2]] * 2  # pool 3, 4: children of 1; 5: of 2
        assert fronts[0].features.dtype == torch.bfloat16 and torch.equal(fronts[0].features[:, 0].cpu(), states)


def test_nan_scores_count_as_minus_infinity():
    """A frontier node's children with NaN log-probs (a broken draft row) score -inf in the pool
    and are not kept while finite candidates remain, in the kernels and the references alike."""
    bsz, k, depth = 2, 3, 2
    inputs = list(_inputs(bsz, k, depth, 4, seed=3))
    s, t = inputs[2][1]
    s = s.clone()
    s[0, 1, :] = float("nan")  # sequence 0, frontier node 1's children: pool columns 1 + k + k .. + k
    inputs[2] = [inputs[2][0], (s, t)]
    ref_pool, _, ref = _growth(inputs, k, depth, 8, "torch")
    pool, _, got = _growth(inputs, k, depth, 8, "triton", DEV)
    for a, b in zip(list(got) + list(pool), list(ref) + list(ref_pool)):
        _same(a, b)
    assert torch.isneginf(ref_pool.scores[0, 1 + 2 * k:1 + 3 * k]).all()
    assert torch.isfinite(ref.scores).all()  # 10 finite candidates for 8 places


@pytest.mark.parametrize("n", [1, 4, 5, 7])
def test_select_ranks_signed_zeros_ties_and_minus_infinity(n):
    """The kernel's sort keys: -0.0 ties with 0.0 (the earlier first, as torch's stable sort has
    it), equal scores keep pool order, -inf comes last; every output equals the reference's."""
    scores = torch.tensor([[0.0, -0.0, 0.0, -1.0, -1.0, float("-inf"), -0.5]] * 2)
    scores[1] = torch.tensor([0.0, -2.0, -0.25, -2.0, -0.25, -0.25, -3.0])
    parents = torch.tensor([[-1, 0, 0, 1, 2, 1, 0], [-1, 0, 0, 1, 2, 2, 3]])
    tokens = torch.arange(14).view(2, 7) + 100
    ref = select(Pool(tokens, scores, parents), n, 3, backend="torch")
    got = select(Pool(tokens.to(DEV), scores.to(DEV), parents.to(DEV)), n, 3, backend="triton")
    for a, b in zip(got, ref):
        _same(a, b)
    if n == 5:
        assert ref.tokens[0].tolist() == [100, 101, 102, 103, 106] and ref.ranks[0].tolist() == [0, 1, 2, 4, 3]


def test_structure_reference_on_hand_built_trees():
    par = torch.tensor([[-1, 0, 0, 1, 3, 2]])
    depths, mask, paths = tree_structure_ref(par)
    assert depths.tolist() == [[0, 1, 1, 2, 3, 2]]
    assert mask[0, 4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert paths[0, 4].tolist() == [0, 1, 3, 4, -1, -1] and paths[0, 5].tolist() == [0, 2, 5, -1, -1, -1]
    g = torch.Generator().manual_seed(0)
    par = torch.full((3, 30), -1, dtype=torch.int64)
    for i in range(1, 30):
        par[:, i] = torch.randint(0, i, (3,), generator=g)
    tb = TreeBatch.build(torch.zeros_like(par), par, validate=True)
    depths, mask, paths = tree_structure_ref(par)
    assert torch.equal(tb.depths, depths) and torch.equal(tb.mask, mask) and torch.equal(tb.paths, paths)


def test_bad_inputs_are_one_error():
    bsz, k = 2, 3
    pool = new_pool(bsz, k, 2, "cpu")
    s, t = torch.zeros(bsz, 1, k), torch.zeros(bsz, 1, k, dtype=torch.int64)
    prev, roots = torch.zeros(bsz, 1, 4), torch.zeros(bsz, dtype=torch.int64)
    with pytest.raises(ValueError, match="lp, tokens"):
        grow(pool, 1, s.double(), t, prev, roots=roots)
    with pytest.raises(ValueError, match="root level"):
        grow(pool, 1, s, t, prev)
    with pytest.raises(ValueError, match="prev"):
        grow(pool, 1, s, t, torch.zeros(bsz, 4), roots=roots)
    with pytest.raises(ValueError, match="pool"):
        grow((pool[0], pool[1].double(), pool[2]), 1, s, t, prev, roots=roots)
    front = grow(pool, 1, s, t, prev, roots=roots)
    with pytest.raises(ValueError, match="do not fit"):
        grow(pool, 12, torch.zeros(bsz, k, k), torch.zeros(bsz, k, k, dtype=torch.int64), torch.zeros(bsz, k, 4),
             front=front)
    with pytest.raises(ValueError, match="n=0"):
        select(pool, 0, 2)
    with pytest.raises(ValueError, match="n=14"):
        select(pool, 14, 2)
    with pytest.raises(ValueError, match="max_depth"):
        select(pool, 3, -1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bsz, n", [(1, 41), (64, 41), (8, 20), (32, 64)])
def test_cuda_growth_of_a_speculative_step(bsz, n):
    """The runtime's shapes on the GPU (top-k 8, depth 5, SmolLM2's 576-wide bf16 features),
    each launch inside a CUDA graph as a speculative step runs it."""
    k, depth = 8, 5
    inputs = _inputs(bsz, k, depth, 576, seed=bsz + n, dtype=torch.bfloat16)
    ref = _growth(inputs, k, depth, n, "torch")
    _growth(inputs, k, depth, n, "triton", "cuda")  # compiles
    dev_inputs = [x.cuda() if torch.is_tensor(x) else [tuple(t.cuda() for t in y) if isinstance(y, tuple)
                                                        else y.cuda() for y in x] for x in inputs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _growth(dev_inputs, k, depth, n, "triton", "cuda")
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(got[0], ref[0]):
        _same(a, b)
    for f, rf in zip(got[1][:-1], ref[1][:-1]):
        for a, b in zip(f, rf):
            _same(a, b)
    for a, b in zip(got[2], ref[2]):
        _same(a, b)


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from optllm.kernels import tree_grow
name, sig, const, warps, out = json.loads(sys.argv[1])
fn = getattr(tree_grow, name)
sig = {**sig, **{k: "constexpr" for k in const}}
src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
open(out, "w").write(k.asm["ptx"])
"""


def _sm90_resources(name: str, signature: dict, constexprs: dict, num_warps: int, tmp_path) -> tuple[int, int]:
    """(registers, spill bytes) of kernels/tree_grow.py's kernel `name` compiled on the CPU for
    sm_90: Triton's compiler in a process of its own (not under TRITON_INTERPRET, which this one
    runs), then its bundled ptxas, whichever takes the PTX's version."""
    import json
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    import triton

    ptx = tmp_path / "k.ptx"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    built = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([name, signature, constexprs, num_warps,
                                                                         str(ptx)])], env=env, capture_output=True,
                           text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    out = None
    for tool in ("ptxas", "ptxas-blackwell"):
        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
        if path.exists():
            run = subprocess.run([str(path), "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "k.cubin")],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                out = run.stderr
                break
    if out is None:
        pytest.skip("no bundled ptxas takes this Triton's PTX")
    return (max(int(v) for v in re.findall(r"Used (\d+) registers", out)),
            sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", out)))


@pytest.mark.parametrize("n", [20, 41, 128])
def test_select_builds_for_hopper_without_spills(n, tmp_path):
    """The selection kernel at the runtime's tree sizes, compiled on the CPU as the GPU would: no
    spills (its first form, whole [64, 64] structure matrices, took 255 registers and spilled at
    n = 41)."""
    sig = {"ptok_ptr": "*i64", "pscore_ptr": "*fp32", "ppar_ptr": "*i64", "tok_ptr": "*i64", "par_ptr": "*i64",
           "rank_ptr": "*i64", "score_ptr": "*fp32", "depth_ptr": "*i64", "mask_ptr": "*i1", "path_ptr": "*i64",
           "at_ptr": "*i32", "P": "i32", "N": "i32"}
    regs, spills = _sm90_resources("_select_kernel", sig, *select_launch(n, pool_size(8, 5), 5), tmp_path)
    assert spills == 0 and regs <= 255, (regs, spills)


@pytest.mark.parametrize("k", [8, 16])
def test_grow_builds_for_hopper_without_spills(k, tmp_path):
    sig = {"root_ptr": "*i64", "fs_ptr": "*fp32", "fid_ptr": "*i64", "lp_ptr": "*fp32", "tok_ptr": "*i64",
           "prev_ptr": "*bf16", "mcur_ptr": "*i1", "ptok_ptr": "*i64", "pscore_ptr": "*fp32", "ppar_ptr": "*i64",
           "nid_ptr": "*i64", "nscore_ptr": "*fp32", "ntok_ptr": "*i64", "feat_ptr": "*bf16", "mnext_ptr": "*i1",
           "P": "i32", "SIZE": "i32", "H": "i32", "M": "i32", "SR": "i32"}
    regs, spills = _sm90_resources("_grow_kernel", sig, *grow_launch(k, k, 4 * k, 576, False, False), tmp_path)
    assert spills == 0, (regs, spills)
