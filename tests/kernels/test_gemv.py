"""Dense decode GEMV against a float64 reference (TRITON_INTERPRET=1 on CPU, set by conftest).

Bounds, relative Frobenius error of y: fp32 1e-5 (fp32 sums in another order); bf16 / fp16
1e-2 (the output is rounded once to a 8- / 11-bit mantissa: <= 2^-8 relative per element).
Every output element is written (outputs start as NaN where the kernel allocates).
"""

from __future__ import annotations

import pytest
import torch

from optllm.kernels.gemv import GemvConfig, gemv, gemv_ref, linear

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("n, k", [(1, 8), (37, 100), (64, 576), (129, 1000)])
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("cfg", [GemvConfig(16, 64, 4, 1), GemvConfig(8, 128, 2, 2)])
def test_gemv_matches_float64(n, k, dtype, bound, cfg):
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, k, generator=g).to(DEV, dtype)
    w = torch.randn(n, k, generator=g).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    ref = x.double() @ w.double().t() + b.double()
    y = gemv(x, w, b, config=cfg)
    assert y.shape == (1, n) and y.dtype == dtype and torch.isfinite(y).all()
    assert rel(y, ref) < bound
    assert rel(gemv(x, w, None, config=cfg), x.double() @ w.double().t()) < bound


def test_strided_rows_and_errors():
    w = torch.randn(40, 96)[:, :64]  # row stride 96
    x = torch.randn(1, 64)
    assert rel(gemv(x, w, config=GemvConfig(16, 32)), x.double() @ w.double().t()) < 1e-5
    with pytest.raises(ValueError, match="x:"):
        gemv(torch.randn(2, 64), w)
    with pytest.raises(ValueError, match="w:"):
        gemv(x, torch.randn(40, 63))
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.randn(3))
    with pytest.raises(ValueError, match="block_n"):
        GemvConfig(block_n=12)


def test_linear_keeps_cublas_for_shapes_not_tuned():
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(gemv_ref(x, w), (x @ w.t()))
