"""AWQ's clip search: never worse than no clipping, scored on the checkpoint's grid, and its two
scoring paths (per-group Gram matrices, a token sample) agree."""

import pytest
import torch

from optllm.formats.args import QuantArgs
from optllm.quant import observers
from optllm.quant.awq import AWQOptions
from optllm.quant.awq_clip import ClipStats, search_clip
from optllm.quant.rtn import rtn_quantize

ARGS = QuantArgs(num_bits=4, group_size=32, symmetric=True)


def test_clip_search_never_worse_than_no_clip():
    torch.manual_seed(3)
    w = torch.randn(32, 128)
    w[:, 5] *= 8  # an outlier weight column makes clipping worthwhile
    x = torch.randn(256, 128)
    ratio = search_clip(w, x, ARGS, AWQOptions())
    assert ratio.shape == (32, 4) and float(ratio.min()) >= 0.5 and float(ratio.max()) <= 7.5 / 7 + 1e-6
    assert float(ratio.min()) < 1.0

    def err(r):
        q = observers.fake_quantize(w, ARGS, clip_ratio=r)
        return float((x @ (q - w).T).pow(2).mean())

    assert err(ratio) <= err(None) + 1e-9


@pytest.mark.parametrize("bits", [4, 3])
def test_expanded_ranges_help_a_symmetric_grid_and_leave_an_asymmetric_one(bits):
    """Symmetric grids: the min-max scale absmax / ((qmax - qmin) / 2) cuts a group's +absmax to
    qmax / 7.5 of itself at 4 bits (3 / 3.5 at 3); ratios up to (qmax - qmin) / 2 / qmax put it on
    qmax exactly. With them every group's error is at most the narrower search's, and strictly
    lower where the group's salient weight (a large input channel's) is its positive maximum.
    Asymmetric grids get no ratio above 1 and the same result."""
    from optllm.quant.awq_clip import expanded_ratios

    args = QuantArgs(num_bits=bits, group_size=32, symmetric=True)
    top = (args.qmax - args.qmin) / 2 / args.qmax
    assert expanded_ratios(args, 20)[-1] == pytest.approx(top) and all(1 < r <= top for r in expanded_ratios(args, 20))
    torch.manual_seed(5)
    w = torch.randn(64, 128) * 0.1
    w[:, 7] = w[:, 7].abs() + 0.5  # channel 7: positive and the largest of its group
    x = torch.randn(512, 128)
    x[:, 7] *= 10  # and the input it multiplies is the loudest
    wide = search_clip(w, x, args, AWQOptions(clip_expand=True))
    narrow = search_clip(w, x, args, AWQOptions(clip_expand=False))
    assert float(narrow.max()) <= 1.0 and float(wide.max()) == pytest.approx(top)
    e_wide = _group_errors(w, x, args, wide, None)
    e_narrow = _group_errors(w, x, args, narrow, None)
    assert bool((e_wide <= e_narrow * (1 + 1e-5) + 1e-12).all())
    assert float(e_wide[:, 0].sum()) < 0.7 * float(e_narrow[:, 0].sum())  # group 0 holds channel 7
    asym = QuantArgs(num_bits=bits, group_size=32, symmetric=False)
    assert expanded_ratios(asym, 20) == []
    assert torch.equal(search_clip(w, x, asym, AWQOptions(clip_expand=True)),
                       search_clip(w, x, asym, AWQOptions(clip_expand=False)))


def _group_errors(w, x, args, ratio, scale_dtype):
    """Per-group mean squared output error [N, groups] of the checkpoint's weights (RTN with
    the clip ratio, scales in scale_dtype, dequantized as stored)."""
    q = rtn_quantize(w, args, clip_ratio=ratio, scale_dtype=scale_dtype).dequantize(torch.float32)
    n, k = w.shape
    g = args.groups(k)
    d = (q - w).reshape(n, g, k // g)
    xg = x.reshape(-1, g, k // g)
    return torch.einsum("tgc,ngc->tng", xg, d).pow(2).mean(0)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_clip_search_scores_with_the_checkpoint_scale_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 128, generator=g) * 0.02
    w[:, 7] *= 10
    x = torch.randn(512, 128, generator=g) * torch.exp(torch.randn(128, generator=g))
    opts = AWQOptions()
    grid = [1.0 - i / opts.clip_grid for i in range(int(opts.max_shrink * opts.clip_grid) + 1)]
    errs = torch.stack([_group_errors(w, x, ARGS, r, dtype) for r in grid])  # [R, N, groups]
    best = errs.min(dim=0).values

    chosen = search_clip(w, x, ARGS, opts, scale_dtype=dtype)
    got = _group_errors(w, x, ARGS, chosen, dtype)
    assert torch.all(got <= best * (1 + 1e-5) + 1e-12)
    # scoring with float32 scales (the old behaviour) picks a worse ratio for some groups
    f32 = _group_errors(w, x, ARGS, search_clip(w, x, ARGS, opts, scale_dtype=None), dtype)
    worse = int((f32 > best * (1 + 1e-5) + 1e-12).sum())
    print(f"{dtype}: float32 scoring not optimal in {worse} of {best.numel()} groups")
    assert worse > 0


@pytest.mark.parametrize("args", (QuantArgs(4, 32, True), QuantArgs(4, 32, False), QuantArgs(3, None, True)))
def test_clip_stats_gram_and_token_sample_agree(args):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, 128, generator=g)  # three batches, 120 tokens in all
    d = torch.randn(20, 128, generator=g)
    stats = {}
    for gram in (True, False):
        s = ClipStats(128, args, clip_tokens=1000, total_tokens=120, gram=gram)
        for batch in x:
            s.add(batch)
        stats[gram] = s.errors(d)
    assert stats[True].shape == (20, args.groups(128))
    assert torch.allclose(stats[True], stats[False], rtol=1e-4, atol=1e-7)


def test_clip_stats_token_sample_is_strided_across_batches():
    s = ClipStats(4, QuantArgs(4, None, True), clip_tokens=10, total_tokens=30, gram=False)
    assert s.step == 3
    tokens = torch.arange(30, dtype=torch.float32)[:, None].repeat(1, 4)
    for batch in (tokens[:7], tokens[7:19], tokens[19:]):  # uneven batches
        s.add(batch)
    assert torch.cat(s.rows)[:, 0].tolist() == [float(t) for t in range(0, 30, 3)]


@pytest.mark.parametrize("gram", [True, False])
def test_token_cap_weights_the_massive_token_in_both_scoring_paths(gram):
    """With a massive token, the capped statistics equal the uncapped ones of inputs whose
    massive row is scaled by sqrt(weight); a cap no token reaches changes nothing."""
    torch.manual_seed(5)
    x = torch.randn(256, 64)
    x[0] *= 50.0
    sq = x.pow(2).sum(1)
    weight = (4.0 * sq.median() / sq).clamp(max=1.0)
    assert int((weight < 1).sum()) == 1
    d = torch.randn(8, 64)
    capped = ClipStats(64, ARGS, clip_tokens=256, total_tokens=256, gram=gram, token_cap=4.0)
    capped.add(x)
    scaled = ClipStats(64, ARGS, clip_tokens=256, total_tokens=256, gram=gram)
    scaled.add(x * weight.sqrt()[:, None])
    a, b = capped.errors(d), scaled.errors(d)
    if gram:  # normalised by the weighted token count instead of the plain one
        b = b * 256 / float(weight.sum())
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    roomy = ClipStats(64, ARGS, clip_tokens=256, total_tokens=256, gram=gram, token_cap=1e6)
    plain = ClipStats(64, ARGS, clip_tokens=256, total_tokens=256, gram=gram)
    roomy.add(x)
    plain.add(x)
    torch.testing.assert_close(roomy.errors(d), plain.errors(d), rtol=1e-6, atol=0)


@pytest.mark.parametrize("shrink", [0.3, 1.0])
def test_clip_stats_shrink_matches_the_shrunk_quadratic_form(shrink):
    """With shrink λ, a weight change d of a group costs (1-λ)·mean((x_g·d_g)²) + λ·Σ_j mean(x_j²) d_j²,
    the same in the Gram and the token-sample paths; λ = 1 ignores how channels co-vary."""
    args = QuantArgs(4, 32, True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(90, 128, generator=g) @ torch.randn(128, 128, generator=g)  # correlated channels
    d = torch.randn(12, 128, generator=g)
    xg = x.reshape(90, 4, 32)
    dg = d.reshape(12, 4, 32)
    full = torch.einsum("tgk,mgk->tmg", xg, dg).pow(2).mean(0)
    diag = torch.einsum("gk,mgk->mg", xg.pow(2).mean(0), dg.pow(2))
    want = (1 - shrink) * full + shrink * diag
    for gram in (True, False):
        s = ClipStats(128, args, clip_tokens=1000, total_tokens=90, gram=gram, shrink=shrink)
        s.add(x[:50])
        s.add(x[50:])
        torch.testing.assert_close(s.errors(d), want, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(s.errors(d), want, rtol=1e-4, atol=1e-3)  # a second call: unchanged
    assert not torch.allclose(full, diag, rtol=0.05)  # the cross terms matter on these inputs
