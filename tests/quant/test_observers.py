import pytest
import torch

from optllm.formats.args import QuantArgs
from optllm.quant import observers
from optllm.quant.rtn import rtn_quantize


@pytest.mark.parametrize("scale_dtype", (None, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("args", (QuantArgs(4, 32, True), QuantArgs(4, 64, False), QuantArgs(3, None, False),
                                  QuantArgs(8, 32, True)))
@pytest.mark.parametrize("clip", (None, 0.8, "per-group"))
def test_fake_quantize_is_the_checkpoint_weight_bit_for_bit(args, scale_dtype, clip):
    """What the AWQ searches score is exactly what the checkpoint will hold: RTN's codes on
    the grid with scales rounded to the checkpoint dtype, dequantized in that dtype."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) * torch.exp(torch.randn(128, generator=g))
    if clip == "per-group":
        clip = 0.5 + 0.5 * torch.rand(48, args.groups(128), generator=g)
    fq = observers.fake_quantize(w, args, clip_ratio=clip, scale_dtype=scale_dtype)
    ref = rtn_quantize(w, args, clip_ratio=clip, scale_dtype=scale_dtype or torch.float32).dequantize(torch.float32)
    assert fq.dtype == torch.float32 and torch.equal(fq, ref)
    if scale_dtype is not None:  # and rounding the scale does change the values
        assert not torch.equal(fq, observers.fake_quantize(w, args, clip_ratio=clip))


def test_fake_quantize_leaves_its_input_alone():
    w = torch.randn(8, 64)
    w0 = w.clone()
    observers.fake_quantize(w, QuantArgs(4, 32, False))
    assert torch.equal(w, w0)


def _group_err(w: torch.Tensor, args: QuantArgs, scale, zero, c: torch.Tensor | None, norm: float,
               sdt=torch.bfloat16) -> torch.Tensor:
    """Σ_j c_j |w_j - ŵ_j|^norm per group [N, groups], by a loop of plain arithmetic."""
    n, k = w.shape
    ng = args.groups(k)
    gs = k // ng
    out = torch.empty(n, ng, dtype=torch.float64)
    for g in range(ng):
        cols = w[:, g * gs:(g + 1) * gs].double()
        s = scale[:, g].to(sdt).double().unsqueeze(1)
        z = 0.0 if zero is None else zero[:, g].double().unsqueeze(1)
        q = torch.clamp(torch.round(cols / s) + z, args.qmin, args.qmax)
        e = ((q - z) * s - cols).abs() ** norm
        if c is not None:
            e = e * c[g * gs:(g + 1) * gs].double()
        out[:, g] = e.sum(1)
    return out


@pytest.mark.parametrize("args", (QuantArgs(4, 32, True), QuantArgs(4, 64, False), QuantArgs(3, 64, False),
                                  QuantArgs(4, None, True)))
@pytest.mark.parametrize("weighted", (False, True))
def test_mse_grid_is_the_best_shrink_of_the_minmax_range(args, weighted):
    """mse_qparams picks, per group, the candidate range of least weighted error: never worse
    than min-max, strictly better on heavy-tailed weights, and equal to a brute force over the
    same candidates scored by a plain loop."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 128, generator=g) ** 3  # heavy tails: clipping pays
    c = torch.exp(torch.randn(128, generator=g)) if weighted else None
    norm = 2.0 if weighted else 2.4
    s, z = observers.mse_qparams(w, args, col_weight=c, norm=norm, scale_dtype=torch.bfloat16)
    s0, z0 = observers.minmax_qparams(w, args)
    e = _group_err(w, args, s, z, c, norm)
    e0 = _group_err(w, args, s0, z0, c, norm)
    assert (e <= e0 * (1 + 1e-9)).all()
    assert e.sum() < 0.97 * e0.sum()
    # brute force over the ratios 1, 0.99, ..., 0.21
    best = torch.full_like(e, float("inf"))
    wmin, wmax = torch.aminmax(w.reshape(40, args.groups(128), -1), dim=-1)
    for i in range(80):
        p = 1 - i / 100
        sp, zp = observers.qparams_from_minmax(wmin * p, wmax * p, args)
        best = torch.minimum(best, _group_err(w, args, sp, zp, c, norm))
    torch.testing.assert_close(e, best, rtol=1e-5, atol=0)


def test_mse_grid_with_one_step_is_minmax():
    args = QuantArgs(4, 32, False)
    w = torch.randn(16, 64)
    s, z = observers.mse_qparams(w, args, steps=1)
    s0, z0 = observers.minmax_qparams(w, args)
    assert torch.equal(s, s0) and torch.equal(z, z0)
    with pytest.raises(ValueError, match="norm"):
        observers.mse_qparams(w, args, norm=0)
    with pytest.raises(ValueError, match="max_shrink"):
        observers.mse_qparams(w, args, max_shrink=1.0)
