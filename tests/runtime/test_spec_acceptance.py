"""Tree acceptance (runtime/spec/acceptance.py).

Greedy: constructed cases checked exactly (full accept, none, the deeper branch, ties), in
one padded batch of trees of different sizes.

Lossless: the statistical test draws T independent verification steps at once (one per
batch row) on a vocabulary of 6 with target p != draft q. Each step emits its tokens; when it
emitted only one, the second is drawn from the target directly (what the next step would
do), so the first two tokens of every row must follow p(a) p(b | a) exactly. Pearson's
chi-square over the 36 pairs (cells expected below 5 pooled) must not reject at
significance 0.001; the generators are seeded, so the test is deterministic. The same test
run on deliberately broken variants (no residual update after a rejection; siblings drawn
without replacement but q not renormalised) must reject with p-value < 1e-6, which shows
that T gives it the power to see those mistakes.
"""

import pytest
import torch
from scipy.stats import chisquare

from optllm.runtime import sampler as sampler_mod
from optllm.runtime.sampling_params import SamplingParams
from optllm.runtime.sequence import Sequence
from optllm.runtime.spec import acceptance
from optllm.runtime.spec.acceptance import (
    AcceptResult,
    draw,
    greedy_accept,
    rejection_accept,
    sampling_logits,
    target_probs,
)
from optllm.runtime.spec.tree import TokenTree, TreeBatch

HAND = TokenTree((-1, 0, 0, 1, 1, 2, 3))  # 0 -> (1, 2); 1 -> (3, 4); 2 -> 5; 3 -> 6


def _ids(rows, n):
    """int64 [B, n] from rows padded with 0."""
    return torch.tensor([r + [0] * (n - len(r)) for r in rows])


# --------------------------------------------------------------------------- greedy
def test_greedy_constructed_cases():
    chain = TokenTree((-1, 0, 1, 2))
    trees = [chain, HAND, HAND, HAND, HAND]
    tokens = [
        [9, 5, 7, 2],  # full accept
        [9, 1, 2, 3, 4, 5, 6],  # none: the root's argmax is 8
        [9, 1, 2, 3, 4, 5, 6],  # branch: node 2 matches, then node 5
        [9, 2, 2, 3, 4, 5, 6],  # both children match; node 1's branch goes deeper (1 -> 3 -> 6)
        [9, 2, 2, 3, 4, 5, 6],  # both children match to depth 1 only: the lower index wins
    ]
    tb = TreeBatch.from_trees(trees, tokens)
    target = _ids([
        [5, 7, 2, 4],
        [8, 0, 0, 0, 0, 0, 0],
        [2, 0, 5, 0, 0, 1, 0],
        [2, 3, 0, 6, 0, 0, 11],
        [2, 7, 8, 0, 0, 0, 0],
    ], 7)
    r = greedy_accept(tb, target)
    assert r.num_accepted.tolist() == [3, 0, 2, 3, 1]
    assert r.num_tokens.tolist() == [4, 1, 3, 4, 2]
    assert r.accepted.tolist() == [
        [0, 1, 2, 3, -1, -1, -1],
        [0, -1, -1, -1, -1, -1, -1],
        [0, 2, 5, -1, -1, -1, -1],
        [0, 1, 3, 6, -1, -1, -1],
        [0, 1, -1, -1, -1, -1, -1],
    ]
    assert r.tokens.tolist() == [
        [5, 7, 2, 4, -1, -1, -1],  # accepted drafts, then the bonus (argmax at the leaf)
        [8, -1, -1, -1, -1, -1, -1],
        [2, 5, 1, -1, -1, -1, -1],
        [2, 3, 6, 11, -1, -1, -1],
        [2, 7, -1, -1, -1, -1, -1],
    ]


def test_greedy_logit_ties_follow_the_sampler():
    """Equal top logits: the sampler's argmax takes the lowest id; so does acceptance."""
    tb = TreeBatch.from_trees([TokenTree((-1, 0, 0))], [[0, 4, 2]])
    logits = torch.zeros(1, 3, 6)
    logits[0, 0, [2, 4]] = 3.0  # a tie at the root
    logits[0, 2, 5] = 1.0
    sampler = sampler_mod.Sampler(6, frozenset())
    seq = Sequence("r", [1], SamplingParams(temperature=0.0))
    assert int(sampler(logits[:, 0], [seq]).token_ids[0]) == 2
    r = greedy_accept(tb, logits.argmax(dim=-1))
    assert r.accepted[0, :2].tolist() == [0, 2] and r.tokens[0, :2].tolist() == [2, 5]


def test_greedy_target_rows_make_rejection_sampling_greedy():
    g = torch.Generator().manual_seed(0)
    trees = [HAND, TokenTree((-1, 0, 1, 1)), TokenTree((-1,))] * 4
    tokens = [torch.randint(0, 3, (t.size,), generator=g).tolist() for t in trees]
    tb = TreeBatch.from_trees(trees, tokens)
    logits = torch.randn(len(trees), 7, 3, generator=g)
    probs = target_probs(logits, [SamplingParams(temperature=0.0)] * len(trees))
    expect = greedy_accept(tb, logits.argmax(dim=-1))
    assert 0 < int(expect.num_accepted.sum()) < int(tb.depths.amax(1).sum())  # a mix of outcomes
    draft = torch.softmax(torch.randn(len(trees), 7, 3, generator=g), dim=-1)
    for q in (None, draft):
        got = rejection_accept(tb, probs, q, generator=g)
        assert torch.equal(got.accepted, expect.accepted) and torch.equal(got.tokens, expect.tokens)


# --------------------------------------------------------------------------- lossless
V = 6
T = 40_000


def _dist(shape, g, sharp=1.5):
    return torch.softmax(sharp * torch.randn(*shape, V, generator=g, dtype=torch.float64), dim=-1)


def _chi2_pvalue(t1, t2, p0, p1):
    """Pearson chi-square p-value of the pairs (t1, t2) against p0(a) p1[a](b)."""
    counts = torch.bincount(t1 * V + t2, minlength=V * V).double()
    expected = (p0[:, None] * p1).reshape(-1) * len(t1)
    small = expected < 5
    if small.any():  # pool the sparse cells into one
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a pair the target cannot produce"
    return chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue


def _first_two(result, p1, g):
    """The first two emitted tokens; a step that emitted one is completed from the target."""
    t1 = result.tokens[:, 0]
    fill = torch.multinomial(p1[t1].float(), 1, generator=g)[:, 0]
    return t1, torch.where(result.num_tokens >= 2, result.tokens[:, 1], fill)


def _run(shape: str, sampled: bool, seed: int, p=None, verify=None):
    """One batch of T verification steps; returns the chi-square p-value of the first two tokens.

    shape "chain": root -> x1 -> x2; "tree": root -> (c1, c2, c3), c1 -> (d1, d2).
    sampled: drafts drawn from q (without replacement among siblings) and q passed along;
    else the draft's top choices, with draft_probs None. verify(tree, target_probs, generator):
    instead of rejection_accept (point-mass drafts only)."""
    g = torch.Generator().manual_seed(seed)
    p0, p1, p2 = p if p is not None else (_dist((), g), _dist((V,), g), _dist((V, V), g))
    q0, q1, q2 = _dist((), g), _dist((V,), g), _dist((V, V), g)
    width = 1 if shape == "chain" else 3
    sub = 1 if shape == "chain" else 2
    if sampled:
        kids = torch.multinomial(q0.float().expand(T, V), width, replacement=False, generator=g)
        grand = torch.multinomial(q1[kids[:, 0]].float(), sub, replacement=False, generator=g)
    else:
        kids = q0.topk(width).indices.expand(T, width)
        grand = q1[kids[:, 0]].topk(sub, dim=-1).indices
    parents = (-1, 0) + (0,) * (width - 1) + (1,) * sub
    tokens = torch.cat([torch.zeros(T, 1, dtype=torch.int64), kids, grand], dim=1)
    tb = TreeBatch.build(tokens, torch.tensor(parents).expand(T, -1).contiguous())
    c1 = kids[:, 0]
    tp = torch.cat([p0.expand(T, 1, V), p1[kids], p2[c1[:, None], grand]], dim=1)
    dp = torch.cat([q0.expand(T, 1, V), q1[kids], q2[c1[:, None], grand]], dim=1) if sampled else None
    if verify is None:
        res = rejection_accept(tb, tp.float(), None if dp is None else dp.float(), generator=g)
    else:  # another verification of the same point-mass drafts
        res = verify(tb, tp.float(), g)
    assert (res.tokens[torch.arange(T), res.num_accepted] >= 0).all()
    return _chi2_pvalue(*_first_two(res, p1, g), p0, p1)


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("sampled", [True, False])
def test_rejection_sampling_reproduces_the_target(shape, sampled):
    assert _run(shape, sampled, seed=1) > 1e-3


def test_rejection_sampling_under_temperature_and_top_p():
    """Target probabilities through target_probs (temperature 0.7, top_p 0.8: zeros in p)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1 + V + V * V, V, generator=g) * 2
    params = SamplingParams(temperature=0.7, top_p=0.8)
    p = target_probs(logits[None], [params])[0].double()
    p = p / p.sum(dim=-1, keepdim=True)
    assert (p == 0).any()
    assert _run("tree", True, seed=2, p=(p[0], p[1:1 + V], p[1 + V:].view(V, V, V))) > 1e-3


@pytest.mark.parametrize("broken,shape,sampled", [
    ("_residual", "chain", True),  # on rejection p stays p: over-samples the rejected token
    ("_residual", "tree", False),
    ("_without", "tree", True),  # siblings without replacement, yet q not renormalised
])
def test_broken_variants_fail_the_same_test(monkeypatch, broken, shape, sampled):
    if broken == "_residual":
        monkeypatch.setattr(acceptance, "_residual", lambda p, q: p)
    else:
        monkeypatch.setattr(acceptance, "_without", lambda q, x: q)
    assert _run(shape, sampled, seed=1) < 1e-6


def _sample_then_match(tb: TreeBatch, tp: torch.Tensor, g, first_match: bool = True) -> AcceptResult:
    """What a sampled speculative step's graph does (runtime/spec_runner.py): one token drawn from
    the target at every node, then kernels/spec_accept.py's matching (its torch reference), with
    caches of one float per slot."""
    from optllm.kernels.spec_accept import greedy_accept_move_ref

    t, n, v = tp.shape
    drawn = draw(tp.reshape(t * n, v), g).view(t, n)
    tables = torch.arange(t, dtype=torch.int32)[:, None]
    caches = [torch.zeros(1, t, 1, 8, 1), torch.zeros(1, t, 1, 8, 1)]
    acc, num, out, _, _ = greedy_accept_move_ref(tb.tokens, tb.parents, tb.depths, tb.mask, tb.paths, tb.sizes,
                                                 drawn, tables, torch.zeros(t, dtype=torch.int64), *caches,
                                                 first_match=first_match)
    return AcceptResult(acc, num, out)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_draw_at_every_node_matched_reproduces_the_target(shape):
    """Point-mass drafts (the draft's top tokens): drawing the target's token at every node and
    taking the child that equals it is the rejection rule in another form -- lossless."""
    assert _run(shape, sampled=False, seed=1, verify=_sample_then_match) > 1e-3


@pytest.mark.parametrize("first_match", [True, False])
def test_a_repeated_sibling_token_matches_at_its_first_node_only(first_match):
    """Root -> (a, a), each a with its own child (d1 under the first, d2 under the second): with
    first_match only the first a is taken, lossless; letting the deepest path choose between the
    two a's independent draws over-samples {d1, d2} after a, which the test rejects."""
    g = torch.Generator().manual_seed(8)
    p0, p1, p2 = _dist((), g), _dist((V,), g), _dist((V, V), g)
    a = int(p0.argmax())
    d1, d2 = [int(x) for x in p1[a].topk(2).indices]
    tokens = torch.tensor([0, a, a, d1, d2]).expand(T, -1).contiguous()
    tb = TreeBatch.build(tokens, torch.tensor([-1, 0, 0, 1, 2]).expand(T, -1).contiguous())
    tp = torch.stack([p0, p1[a], p1[a], p2[a, d1], p2[a, d2]])[None].expand(T, -1, -1).float().contiguous()
    res = _sample_then_match(tb, tp, g, first_match=first_match)
    pvalue = _chi2_pvalue(*_first_two(res, p1, g), p0, p1)
    assert (pvalue > 1e-3) if first_match else (pvalue < 1e-6), pvalue


def test_rejection_is_deterministic_per_generator():
    g = torch.Generator().manual_seed(3)
    tb = TreeBatch.from_trees([HAND] * 64, [torch.randint(0, V, (7,), generator=g).tolist() for _ in range(64)])
    tp = _dist((64, 7), g).float()
    a = rejection_accept(tb, tp, generator=torch.Generator().manual_seed(9))
    b = rejection_accept(tb, tp, generator=torch.Generator().manual_seed(9))
    c = rejection_accept(tb, tp, generator=torch.Generator().manual_seed(10))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.accepted, b.accepted)
    assert not torch.equal(a.tokens, c.tokens)


# --------------------------------------------------------------------------- target distribution
PARAMS = [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.1, top_k=10, top_p=0.9),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=0.9, top_k=3, top_p=0.5),
]


def test_sampling_logits_are_what_the_sampler_races():
    """The sampler draws argmax(x - log E), E ~ Exp(1) from its seeded generator, x its masked
    logits; the same E on sampling_logits must give the same token in every row."""
    v, seed = 50, 123
    g = torch.Generator().manual_seed(0)
    params = [PARAMS[i % len(PARAMS)] for i in range(60)]
    seqs = [Sequence("r", [1], p) for p in params]
    sampler = sampler_mod.Sampler(v, frozenset(), seed=seed)
    noise = torch.Generator().manual_seed(seed)  # the sampler's shared generator, replayed
    for _ in range(3):
        logits = (torch.randn(len(params), v, generator=g) * 3).round(decimals=1)  # rounding makes ties
        got = sampler(logits, seqs).token_ids
        e = torch.empty(len(params), v).exponential_(generator=noise).clamp_min_(torch.finfo(torch.float32).tiny)
        x = sampling_logits(logits[:, None], params)[:, 0]
        assert torch.equal((x - e.log()).argmax(dim=-1), got)
        cut = torch.tensor([p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params])
        assert torch.equal(torch.isinf(x).any(dim=-1), cut)  # the truncating rows did cut


def test_target_probs_support_and_values():
    logits = torch.tensor([[[2.0, 2.0, 1.0, 0.0, -1.0]]])
    p = target_probs(logits.expand(3, 1, 5), [SamplingParams(temperature=1.0, top_k=1),
                                              SamplingParams(temperature=0.0),
                                              SamplingParams(temperature=2.0)])
    assert p[0, 0].tolist() == pytest.approx([0.5, 0.5, 0, 0, 0])  # top_k keeps ties with the k-th
    assert p[1, 0].tolist() == [1.0, 0, 0, 0, 0]  # greedy: the lowest id of the tied maximum
    assert p[2, 0].tolist() == pytest.approx(torch.softmax(logits[0, 0] / 2, dim=-1).tolist())
    with pytest.raises(ValueError, match="penalties"):
        target_probs(logits, [SamplingParams(repetition_penalty=1.2)])


def test_draw_follows_the_row_probabilities():
    """The exponential race (the final token's draw, graph-safe): 60,000 draws from each of two
    unnormalised rows, one with zeros, against their normalised probabilities (chi-square, must not
    reject at 0.001); zero-probability tokens never drawn. A race that forgot to divide by the
    noise (always the argmax) or divided p by E twice fails it."""
    g = torch.Generator().manual_seed(11)
    rows = torch.tensor([[3.0, 1.0, 0.5, 0.5, 2.0, 1.0], [0.0, 2.0, 0.0, 1.0, 0.0, 0.25]])
    n = 60_000
    got = draw(rows.repeat_interleave(n, dim=0), g).view(2, n)
    for r in range(2):
        counts = torch.bincount(got[r], minlength=V).double()
        p = rows[r].double() / rows[r].sum()
        assert counts[p == 0].sum() == 0
        keep = p > 0
        assert chisquare(counts[keep].numpy(), (p[keep] * n).numpy()).pvalue > 1e-3


def test_temperature_only_rows():
    """Rows a sampled step graph serves: a temperature and nothing else (top_k = vocabulary: off)."""
    params = [SamplingParams(temperature=t) for t in (0.0, 0.7, 1.0, 1.8)]
    assert all(p.temperature_only(50) for p in params)
    assert SamplingParams(temperature=1.0, top_k=50).temperature_only(50)  # top_k = vocabulary: off
    for p in (SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(min_p=0.1),
              SamplingParams(repetition_penalty=1.1)):
        assert not p.temperature_only(50)
