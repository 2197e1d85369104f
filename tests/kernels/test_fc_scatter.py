"""The fused linear + scatter of EAGLE-3's feature store (kernels/fc_scatter.py) against float64
math and its torch reference, under TRITON_INTERPRET=1 on CPU (and on CUDA where present).

Rows go to their slots, slot -1 to the table's last (dump) row, and no other row of the table is
touched. Bounds against the float64 product, |y - ref| <= tol * (|x| @ |W|^T) (the sum of the
terms' magnitudes, which bounds any summation order's error): float32 1e-5 (K <= 1728 terms in
fp32, ~K * 2^-24 worst case), bf16 2^-7 (the output's one rounding, plus the interpreter's
truncation)."""

import pytest
import torch

from optllm.kernels.fc_scatter import fc_scatter, fc_scatter_ref, fc_scatter_tiles

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}


def _case(t, n, k, slots_total, dtype, seed, index_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, dtype)
    perm = torch.randperm(slots_total, generator=g)[:t]
    slots = perm.clone()
    slots[::5] = -1  # padding rows: the dump row
    out = torch.full((slots_total + 1, n), 7.0, dtype=dtype).to(DEV)
    return x, w, slots.to(DEV, index_dtype), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,n,k", [(1, 48, 96), (8, 40, 200), (20, 64, 136), (70, 80, 72)])
def test_rows_land_at_their_slots(t, n, k, dtype):
    x, w, slots, out = _case(t, n, k, 3 * t + 5, dtype, seed=t + n)
    before = out.clone()
    y = fc_scatter(x, w, slots, out)
    assert y is out
    ref = x.double() @ w.double().t()
    bound = x.double().abs() @ w.double().abs().t()
    live = slots >= 0
    rows = slots[live].long()
    err = (out[rows].double() - ref[live]).abs()
    assert (err <= TOL[dtype] * bound[live] + 1e-30).all(), float((err / bound[live]).max())
    # every slot no row names is untouched; the dump row holds one of the padding rows
    untouched = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
    untouched[rows] = False
    untouched[-1] = False
    assert torch.equal(out[untouched], before[untouched])
    pads = (~live).nonzero().view(-1)
    assert any(torch.allclose(out[-1].double(), ref[p], rtol=TOL[dtype] * 4, atol=TOL[dtype] * 4) for p in pads)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_the_torch_reference(index_dtype):
    x, w, slots, out = _case(12, 48, 160, 40, torch.float32, seed=3, index_dtype=index_dtype)
    slots[slots < 0] = 39  # (the reference writes the dump row last-writer-wins too: keep the slots distinct)
    slots = torch.randperm(40)[:12].to(DEV, index_dtype)
    a = fc_scatter(x, w, slots, out.clone())
    b = fc_scatter_ref(x, w, slots, out.clone())
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tiles_and_bad_inputs():
    assert fc_scatter_tiles(1)[:2] == (16, 16) and fc_scatter_tiles(64)[0] == 64
    x, w, slots, out = _case(4, 32, 64, 10, torch.float32, seed=1)
    with pytest.raises(ValueError, match="one dtype"):
        fc_scatter(x, w.double(), slots, out)
    with pytest.raises(ValueError, match="slots"):
        fc_scatter(x, w, slots[:3], out)
    with pytest.raises(ValueError, match="out"):
        fc_scatter(x, w, slots, out[:, :16])
    assert fc_scatter(x[:0], w, slots[:0], out) is out
