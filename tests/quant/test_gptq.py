"""GPTQ: the Hessian, the algorithm's invariants, and that it beats RTN on correlated inputs; the
same on the FP8 (E4M3) grid."""

from __future__ import annotations

import math

import pytest
import torch

from optllm.formats.args import QuantArgs
from optllm.formats.float_quantized import E4M3, FloatQuantizedWeight
from optllm.formats.qweight import QuantizedWeight
from optllm.quant.fp8 import fp8_quantize_weight
from optllm.quant.gptq import HessianAccumulator, _gptq, gptq_quantize
from optllm.quant.rtn import rtn_quantize

N, K = 128, 256


def _layer(seed: int = 0, n_calib: int = 3072, n_eval: int = 2048):
    """Weight [N, K] and calibration / held-out inputs shaped like LLM activations.

    X = (Z · spectrum) · A: iid Z, a power-law spectrum (activations live near a
    low-dimensional subspace), a random mixing A (every channel correlated with every
    other), and a few outlier channels 20× larger than the rest.
    """
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=g) / K**0.5
    spectrum = torch.arange(1, K + 1, dtype=torch.float32) ** -0.5
    channel = torch.exp(0.5 * torch.randn(K, generator=g))
    channel[torch.randperm(K, generator=g)[:4]] *= 20.0

    def sample(m: int) -> torch.Tensor:
        return (torch.randn(m, K, generator=g) * spectrum) @ mix * channel

    w = torch.randn(N, K, generator=g) * 0.02
    return w, sample(n_calib), sample(n_eval)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x)
    return acc.hessian


def _out_err(w: torch.Tensor, wq: torch.Tensor, x: torch.Tensor) -> float:
    ref = x.double() @ w.double().T
    return ((ref - x.double() @ wq.double().T).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def layer():
    w, xc, xe = _layer()
    return w, _hessian(xc), xe


def test_hessian_accumulator_matches_float64():
    g = torch.Generator().manual_seed(1)
    k = 48
    chunks = [
        torch.randn(3, 17, k, generator=g) * 4.0 + 1.0,
        torch.randn(50, k, generator=g),
        torch.randn(1, 1, k, generator=g) * 100.0,
        torch.randn(2, 0, k, generator=g),
        torch.randn(2, 5, 3, k, generator=g).to(torch.bfloat16),
    ]
    acc = HessianAccumulator(k)
    for c in chunks:
        acc.add(c)
    x = torch.cat([c.reshape(-1, k).double() for c in chunks])
    ref = 2.0 / x.shape[0] * x.T @ x
    assert acc.num_samples == x.shape[0] == 51 + 17 * 3 + 30
    h = acc.hessian
    assert h.dtype == torch.float32 and h.shape == (k, k)
    rel = ((h.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-6, rel


def test_hessian_accumulator_errors():
    acc = HessianAccumulator(8)
    with pytest.raises(RuntimeError, match="no calibration samples"):
        acc.hessian
    with pytest.raises(ValueError, match="in_features=8"):
        acc.add(torch.randn(4, 9))
    with pytest.raises(ValueError, match="in_features"):
        HessianAccumulator(0)


# Static act-order visits the 20x outlier channels first and wins far more than plain GPTQ.
@pytest.mark.parametrize("actorder", [None, "static"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, None])
@pytest.mark.parametrize("bits", [4, 3])
def test_gptq_beats_rtn_on_correlated_inputs(layer, bits, group_size, symmetric, actorder):
    w, h, x_eval = layer
    args = QuantArgs(num_bits=bits, group_size=group_size, symmetric=symmetric, actorder=actorder)
    qw, loss = gptq_quantize(w, h, args)
    rtn = rtn_quantize(w, args)

    assert qw.q.dtype == torch.int8 and qw.q.shape == (N, K)
    assert qw.scale.shape == rtn.scale.shape and qw.scale.dtype == w.dtype
    assert int(qw.q.min()) >= args.qmin and int(qw.q.max()) <= args.qmax
    if symmetric:
        assert qw.zero is None
    else:
        assert qw.zero.dtype == torch.int8 and qw.zero.shape == rtn.zero.shape

    e_gptq = _out_err(w, qw.dequantize(torch.float32), x_eval)
    e_rtn = _out_err(w, rtn.dequantize(torch.float32), x_eval)
    ratio = e_gptq / e_rtn
    print(f"w{bits} g{group_size} sym={symmetric} actorder={actorder}: "
          f"gptq {e_gptq:.4f} rtn {e_rtn:.4f} ratio {ratio:.3f} loss {loss:.3e}")
    margin = 0.45 if actorder == "static" else 0.75
    assert ratio < margin, (e_gptq, e_rtn)


def test_loss_is_the_damped_quadratic_error(layer):
    """½ Σ (w - ŵ)² / d² over the columns is exactly ½ tr(ΔW H_damped ΔWᵀ) (OBS identity)."""
    w, h, _ = layer
    for args in (QuantArgs(4, 64, False), QuantArgs(3, None, True, "static")):
        qw, loss = gptq_quantize(w, h, args, dampening=0.01)
        hd = h.double() + 0.01 * torch.diagonal(h).double().mean() * torch.eye(K, dtype=torch.float64)
        dw = w.double() - qw.dequantize(torch.float64)
        ref = 0.5 * torch.einsum("nk,kl,nl->", dw, hd, dw).item()
        assert loss == pytest.approx(ref, rel=1e-5)


def _naive_obs(w: torch.Tensor, h: torch.Tensor, args: QuantArgs, damp: float = 0.01):
    """The paper's Eq. (2)-(3) taken literally, in float64: fix one column at a time and move
    the free ones by -(w_q - ŵ_q)/[H_F⁻¹]_qq · (H_F⁻¹)_{:,q}, inverting H_F afresh each step.
    Only for grids fixed up front (per-channel or static act-order)."""
    rtn = rtn_quantize(w, args)
    k = w.shape[1]
    s = rtn.scale.double().repeat_interleave(k // rtn.scale.shape[1], dim=1)
    z = None if rtn.zero is None else rtn.zero.double().repeat_interleave(k // rtn.zero.shape[1], dim=1)
    h = h.double() + damp * torch.diagonal(h).double().mean() * torch.eye(k, dtype=torch.float64)
    order = list(range(k))
    if args.actorder == "static":
        order = torch.argsort(torch.diagonal(h), descending=True, stable=True).tolist()
    wf = w.double().clone()
    q = torch.empty_like(wf)
    loss = 0.0
    for t, c in enumerate(order):
        free = order[t:]
        hinv = torch.linalg.inv(h[free][:, free])
        code = torch.round(wf[:, c] / s[:, c]) + (0 if z is None else z[:, c])
        code = code.clamp(args.qmin, args.qmax)
        deq = (code - (0 if z is None else z[:, c])) * s[:, c]
        e = (wf[:, c] - deq) / hinv[0, 0]
        loss += 0.5 * (e.square() * hinv[0, 0]).sum().item()
        wf[:, free] -= e[:, None] * hinv[0][None, :]
        q[:, c] = code
    return q.to(torch.int8), loss


@pytest.mark.parametrize("args", [QuantArgs(4, None, True), QuantArgs(3, None, False),
                                  QuantArgs(4, 16, False, "static")])
def test_matches_literal_obs_updates(args):
    """The Cholesky rows + lazy blocks give the same codes as the paper's explicit updates."""
    g = torch.Generator().manual_seed(5)
    k = 64
    x = torch.randn(512, k, generator=g) @ (torch.randn(k, k, generator=g) / 8) * torch.exp(torch.randn(k, generator=g))
    w = torch.randn(24, k, generator=g) * 0.02
    h = _hessian(x)
    ref_q, ref_loss = _naive_obs(w, h, args)
    qw, loss = gptq_quantize(w, h, args, block_size=16)
    mismatch = (qw.q != ref_q).float().mean().item()
    assert mismatch < 0.01, mismatch  # float32 vs float64: a rare rounding-boundary flip
    assert loss == pytest.approx(ref_loss, rel=1e-3)


@pytest.mark.parametrize("grid", ["minmax", "hmse", "mse"])
@pytest.mark.parametrize("args", [QuantArgs(4, 32, True), QuantArgs(3, 64, False, "static"), QuantArgs(4, None, False)])
def test_dequantize_is_what_the_algorithm_propagated(layer, args, grid):
    """Scales rounded to bf16 before coding: QuantizedWeight.dequantize() reproduces, bit for
    bit, the weight whose errors GPTQ pushed onto the later columns (whatever sets the grid)."""
    w, h, _ = layer
    wb = w.to(torch.bfloat16)
    res = _gptq(wb, h, args, grid=grid)
    assert res.scale.dtype == torch.bfloat16
    qw = QuantizedWeight(q=res.q, scale=res.scale, zero=res.zero, args=args)  # as the checkpoint holds it
    assert torch.equal(qw.dequantize(torch.float32), res.dq)
    assert torch.equal(qw.dequantize(), res.dq.to(torch.bfloat16))
    # The loss is ½ tr(ΔW H_damped ΔWᵀ) of the values the loop propagated (OBS identity), so
    # it matches the checkpoint's values only if those are what was propagated. Measured: they
    # agree to 2e-8..8e-8; the unrounded float32 products (q - z)·s would be off by 5e-5..4e-4.
    hd = h.double() + 0.01 * torch.diagonal(h).double().mean() * torch.eye(K, dtype=torch.float64)
    dw = wb.double() - qw.dequantize(torch.float64)
    assert res.loss == pytest.approx(0.5 * torch.einsum("nk,kl,nl->", dw, hd, dw).item(), rel=1e-6)


@pytest.mark.parametrize("args", [QuantArgs(4, 32, True), QuantArgs(3, 64, False), QuantArgs(4, None, False, "static"),
                                  QuantArgs(3, 32, True, "static")])
def test_identity_hessian_reduces_to_rtn(args):
    """Uncorrelated inputs: nothing to propagate, so GPTQ is RTN, for any block size."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, K, generator=g) * 0.02
    rtn = rtn_quantize(w, args)
    x = torch.randn(1024, K, generator=g)
    e_rtn = _out_err(w, rtn.dequantize(torch.float32), x)
    for block_size in (1, 128):
        qw, loss = gptq_quantize(w, torch.eye(K), args, block_size=block_size)
        assert _out_err(w, qw.dequantize(torch.float32), x) <= 1.05 * e_rtn
        assert torch.equal(qw.q, rtn.q) and torch.equal(qw.scale, rtn.scale)
        if not args.symmetric:
            assert torch.equal(qw.zero, rtn.zero)
        # H⁻¹ = I/1.01, so each column's loss is 1.01·|w - ŵ|²/2.
        dw = w.double() - qw.dequantize(torch.float64)
        assert loss == pytest.approx(0.5 * 1.01 * dw.square().sum().item(), rel=1e-5)


@pytest.mark.parametrize("args", [QuantArgs(4, 32, True), QuantArgs(3, 32, False), QuantArgs(4, None, True, "static")])
def test_block_size_only_reorders_the_arithmetic(layer, args):
    """Lazy batch updates are exact: block sizes 1, 48 (groups span blocks) and 128 agree."""
    w, h, x_eval = layer
    base, base_loss = gptq_quantize(w, h, args, block_size=128)
    base_err = _out_err(w, base.dequantize(torch.float32), x_eval)
    for block_size in (1, 48):
        qw, loss = gptq_quantize(w, h, args, block_size=block_size)
        mismatch = (qw.q != base.q).float().mean().item()
        # float rounding may flip a code sitting on a rounding boundary (and what follows it)
        assert mismatch < 0.02, mismatch
        assert loss == pytest.approx(base_loss, rel=1e-2)
        assert _out_err(w, qw.dequantize(torch.float32), x_eval) == pytest.approx(base_err, rel=1e-2)


@pytest.mark.parametrize("args", [QuantArgs(4, 32, True), QuantArgs(4, 32, False), QuantArgs(3, None, False, "static"),
                                  QuantArgs(4, 64, False, "static")])
def test_dead_input_channels(args):
    w, xc, xe = _layer(seed=3, n_calib=1024, n_eval=512)
    dead = [5, 77, 200]
    xc[:, dead] = 0.0
    xe[:, dead] = 0.0
    h = _hessian(xc)
    qw, loss = gptq_quantize(w, h, args)
    dq = qw.dequantize(torch.float32)
    assert torch.isfinite(dq).all() and torch.isfinite(qw.scale).all() and math.isfinite(loss)
    gsize = args.group_size or K
    for c in dead:
        code0 = torch.zeros(N, dtype=torch.int8) if qw.zero is None else qw.zero[:, c // gsize]
        assert torch.equal(qw.q[:, c], code0)
        assert torch.equal(dq[:, c], torch.zeros(N))
    rtn = rtn_quantize(w, args)
    assert _out_err(w, dq, xe) < _out_err(w, rtn.dequantize(torch.float32), xe)


def test_indefinite_hessian_retries_with_more_dampening():
    g = torch.Generator().manual_seed(4)
    k = 64
    # Pairs of channels with correlation 2 > 1: indefinite, as float32 round-off can make
    # a near-singular Hessian. Dampening must grow to ~10x the mean diagonal.
    h = torch.kron(torch.eye(k // 2), torch.tensor([[1.0, 2.0], [2.0, 1.0]]))
    w = torch.randn(16, k, generator=g)
    with pytest.warns(UserWarning, match="not positive definite"):
        qw, loss = gptq_quantize(w, h, QuantArgs(4, 32, True))
    assert torch.isfinite(qw.dequantize(torch.float32)).all() and math.isfinite(loss)


def test_input_errors():
    w = torch.randn(16, 96)
    with pytest.raises(ValueError, match="group_size=64 does not divide in_features=96"):
        gptq_quantize(w, torch.eye(96), QuantArgs(4, 64))
    with pytest.raises(ValueError, match="hessian shape"):
        gptq_quantize(w, torch.eye(95), QuantArgs(4, 32))
    with pytest.raises(ValueError, match="hessian shape"):
        gptq_quantize(w, torch.eye(96)[None], QuantArgs(4, 32))
    with pytest.raises(ValueError, match="block_size"):
        gptq_quantize(w, torch.eye(96), QuantArgs(4, 32), block_size=0)
    with pytest.raises(ValueError, match="dampening"):
        gptq_quantize(w, torch.eye(96), QuantArgs(4, 32), dampening=-0.1)
    bad = torch.eye(96)
    bad[3, 4] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        gptq_quantize(w, bad, QuantArgs(4, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("args", [QuantArgs(4, 32, False), QuantArgs(4, 128, True, "static")])
def test_cuda_matches_cpu(layer, args):
    w, h, x_eval = layer
    cpu, cpu_loss = gptq_quantize(w, h, args)
    acc = HessianAccumulator(K)
    acc.add(torch.randn(64, K, device="cuda"))
    assert acc.hessian.device.type == "cuda"
    qw, loss = gptq_quantize(w.cuda(), h.cuda(), args)
    assert qw.q.device.type == "cuda" and qw.scale.device.type == "cuda"
    mismatch = (qw.q.cpu() != cpu.q).float().mean().item()
    assert mismatch < 0.02, mismatch
    assert loss == pytest.approx(cpu_loss, rel=1e-2)
    e_cpu = _out_err(w, cpu.dequantize(torch.float32), x_eval)
    assert _out_err(w, qw.dequantize(torch.float32).cpu(), x_eval) == pytest.approx(e_cpu, rel=1e-2)


def _domain_shift(seed: int, k: int = 128, n: int = 64, t: int = 4096, window: int = 256, scale: float = 3e4):
    """Calibration inputs whose first token of every window carries a massive activation
    (two channels at ~scale, as SmolLM2's layers 11 and 28 down_proj: > 99.9 % of Σ‖x‖²);
    test inputs of the same ordinary, correlated distribution without them."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    mix = torch.randn(k, k, generator=gen) * (torch.arange(k) + 1.0).pow(-0.3)[:, None]
    mix = mix / mix.pow(2).sum(0).mean().sqrt()
    sink = torch.cat([torch.ones(2), 0.05 * torch.randn(k - 2, generator=gen)])
    calib = torch.randn(t, k, generator=gen) @ mix
    calib[::window] = sink * scale + 0.3 * torch.randn(t // window, k, generator=gen)
    test = torch.randn(t, k, generator=gen) @ mix
    return w, calib, test


def _output_error(w, w_hat, x):
    return float((x @ (w - w_hat).T).pow(2).sum() / (x @ w.T).pow(2).sum())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_cap_keeps_gptq_ahead_of_rtn_under_a_domain_shift(seed):
    """Plain GPTQ, fitted where a few massive tokens own the Hessian, loses to RTN on inputs
    without them (measured over seeds 0-5: 1.02-1.07x RTN's output error); with the token cap it
    keeps most of GPTQ's gain (0.41-0.43x RTN)."""
    w, calib, test = _domain_shift(seed)
    args = QuantArgs(4, 32, True, "static")
    rtn = _output_error(w, rtn_quantize(w, QuantArgs(4, 32, True)).dequantize(torch.float32), test)
    errors = {}
    for cap in (None, 16.0):
        acc = HessianAccumulator(w.shape[1], token_cap=cap)
        for batch in calib.split(512):
            acc.add(batch)
        qw, _ = gptq_quantize(w, acc.hessian, args)
        errors[cap] = _output_error(w, qw.dequantize(torch.float32), test)
    assert errors[None] > 1.02 * rtn  # the failure this guards against is real in this setting
    assert errors[16.0] < 0.5 * rtn


def test_token_cap_weights_only_the_outlying_tokens():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=gen)
    x[5] *= 40.0  # one massive token
    sq = x.pow(2).sum(1)
    plain, capped = HessianAccumulator(16), HessianAccumulator(16, token_cap=4.0)
    plain.add(x)
    capped.add(x)
    weight = (4.0 * sq.median() / sq).clamp(max=1.0)
    assert int((weight < 1).sum()) == 1  # only the massive token is down-weighted
    expected = 2 * (x * weight[:, None]).T @ x / 64
    torch.testing.assert_close(capped.hessian, expected, rtol=1e-5, atol=1e-6)
    roomy = HessianAccumulator(16, token_cap=float(sq.max() / sq.median()) * 1.01)
    roomy.add(x)
    torch.testing.assert_close(roomy.hessian, plain.hessian, rtol=1e-6, atol=0)  # a cap no token reaches: H as is
    with pytest.raises(ValueError, match="token_cap"):
        HessianAccumulator(16, token_cap=0.0)


def test_shrink_is_gptq_on_the_blended_hessian():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=gen)
    x = torch.randn(256, 64, generator=gen) @ torch.randn(64, 64, generator=gen)
    h = 2 * x.T @ x / 256
    args = QuantArgs(4, 32, True, "static")
    blended = 0.7 * h + 0.3 * torch.diag(torch.diagonal(h))
    a, _ = gptq_quantize(w, h, args, shrink=0.3)
    b, _ = gptq_quantize(w, blended, args)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)
    with pytest.raises(ValueError, match="shrink"):
        gptq_quantize(w, h, args, shrink=1.0)


# --------------------------------------------------------------------------- the FP8 (E4M3) grid
FP8 = QuantArgs(num_bits=8, group_size=None, type="float", strategy="channel")
FP8_TENSOR = QuantArgs(num_bits=8, group_size=None, type="float", strategy="tensor")


@pytest.mark.parametrize("args", [FP8, FP8_TENSOR])
def test_identity_hessian_is_rtn_on_the_e4m3_grid(args):
    """Uncorrelated inputs leave nothing to compensate: GPTQ's values are RTN's, bit for bit,
    under the very scales fp8_quantize_weight chooses (a wrong scale or rounding differs)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g) * torch.exp(torch.randn(64, 1, generator=g))
    qw, _ = gptq_quantize(w, torch.eye(96), args, scale_dtype=torch.bfloat16)
    rtn = fp8_quantize_weight(w, args, torch.bfloat16)
    assert isinstance(qw, FloatQuantizedWeight) and qw.q.dtype == E4M3
    assert qw.scale.shape == rtn.scale.shape == ((64, 1) if args.strategy == "channel" else (1,))
    assert torch.equal(qw.scale, rtn.scale)
    assert torch.equal(qw.q.view(torch.uint8), rtn.q.view(torch.uint8))


@pytest.mark.parametrize("actorder", [None, "static"])
def test_fp8_dequantize_is_what_gptq_propagated(layer, actorder):
    w, h, _ = layer
    args = QuantArgs(num_bits=8, group_size=None, type="float", strategy="channel", actorder=actorder)
    res = _gptq(w, h, args, scale_dtype=torch.bfloat16)
    qw = FloatQuantizedWeight(q=res.q, scale=res.scale, zero=None, args=args)
    assert torch.equal(qw.dequantize(torch.float32), res.dq)
    # every value on the grid: |q| <= 448 and finite (saturated, never NaN)
    assert torch.isfinite(res.q.float()).all() and res.q.float().abs().max() <= 448


@pytest.mark.parametrize("actorder", [None, "static"])
def test_fp8_gptq_beats_rtn_on_correlated_inputs(layer, actorder):
    """Held-out output error of GPTQ on the E4M3 grid against RTN's on the same grid.
    Measured (this layer, bf16 scales): RTN 0.0255; GPTQ 0.0163 (natural order), 0.0092
    (act-order). Bound: at most 0.75 x RTN's."""
    w, h, xe = layer
    args = QuantArgs(num_bits=8, group_size=None, type="float", strategy="channel", actorder=actorder)
    qw, _ = gptq_quantize(w, h, args, scale_dtype=torch.bfloat16)
    rtn = fp8_quantize_weight(w, FP8, torch.bfloat16)
    e_gptq = _out_err(w, qw.dequantize(torch.float32), xe)
    e_rtn = _out_err(w, rtn.dequantize(torch.float32), xe)
    assert e_gptq < 0.75 * e_rtn, (e_gptq, e_rtn)


@pytest.mark.parametrize("args", [QuantArgs(4, 64, True), QuantArgs(4, 64, False), QuantArgs(3, 64, False, "static"),
                                  QuantArgs(3, 32, True, "static")])
def test_searched_grid_lowers_the_output_error(layer, args):
    """A grid shrunk to each group's least (Hessian-weighted) weight error leaves GPTQ less
    output error to cancel: lower on the calibration Hessian and on held-out inputs."""
    w, h, xe = layer
    losses, errs = {}, {}
    for grid in ("minmax", "hmse"):
        qw, losses[grid] = gptq_quantize(w, h, args, grid=grid)
        errs[grid] = _out_err(w, qw.dequantize(torch.float32), xe)
    assert losses["hmse"] < 0.97 * losses["minmax"]
    assert errs["hmse"] < errs["minmax"]


def test_grid_option_errors():
    from optllm.quant.gptq import GPTQOptions

    with pytest.raises(ValueError, match="GPTQ grid 'absmax' is not allowed; allowed: minmax, mse, hmse"):
        GPTQOptions(grid="absmax")
    with pytest.raises(ValueError, match="grid"):
        gptq_quantize(torch.zeros(4, 32), torch.eye(32), QuantArgs(4, 32, True), grid="nope")
