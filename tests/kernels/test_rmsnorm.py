"""RMSNorm kernel (plain and fused with the residual add) against the torch reference and
HF's LlamaRMSNorm, under TRITON_INTERPRET=1 on CPU.

Bounds, elementwise |out - ref| <= tol * |ref| + tiny: float32 2e-6 (the sum of squares
in another order, rsqrt within an ulp or two); fp16 2^-9 and bf16 2^-6, two ulps: where a
last-bit difference of the fp32 scale flips the rounding of the normalised value, the product
with the weight can round one more ulp apart. The CPU interpreter truncates to bf16 instead of
rounding, so each of the kernel's two bf16 roundings may be one ulp off: 3 * 2^-7 there.
Measured under the interpreter: fp32 2.4e-7, fp16 bit-exact, bf16 1.5e-2. new_residual is
x + residual rounded once: bit-exact except for the interpreter's bf16 truncation (one ulp).
"""


import pytest
import torch

from optllm.kernels.rmsnorm import rms_norm, rms_norm_pair, rms_norm_pair_ref, rms_norm_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-6, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6 if DEV == "cuda" else 3 * 2.0**-7}
TINY = {torch.float32: 1e-30, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-120}


def _data(shape, dtype, seed, residual=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(DEV, dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(DEV, dtype)
    r = torch.randn(shape, generator=g).to(DEV, dtype) if residual else None
    return x, w, r


def _close(y, ref):
    assert y.dtype == ref.dtype and y.shape == ref.shape
    err = (y.float() - ref.float()).abs()
    assert (err <= TOL[y.dtype] * ref.float().abs() + TINY[y.dtype]).all(), float(err.max())


def _exact_or_ulp(h, ref):
    if DEV == "cuda" or h.dtype != torch.bfloat16:
        assert torch.equal(h, ref)
    else:  # the interpreter truncates to bf16
        assert ((h.float() - ref.float()).abs() <= ref.float().abs() * 2.0**-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 64), (37, 16), (3, 1000), (2, 4096), (1, 16384), (64,)])
def test_matches_reference(shape, dtype):
    x, w, _ = _data(shape, dtype, seed=sum(shape))
    y = rms_norm(x, w, 1e-6)
    assert y.is_contiguous()
    _close(y, rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 128), (300, 64), (2, 3, 96)])
def test_fused_residual(shape, dtype):
    x, w, r = _data(shape, dtype, seed=3 + shape[0], residual=True)
    y, h = rms_norm(x, w, 1e-5, residual=r)
    y_ref, h_ref = rms_norm_ref(x, w, 1e-5, r)
    _exact_or_ulp(h, h_ref)
    # normalise the kernel's own sum, so the interpreter's bf16 truncation counts once
    _close(y, rms_norm_ref(h, w, 1e-5))
    if dtype != torch.bfloat16 or DEV == "cuda":
        _close(y, y_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_view_of_fused_qkv(dtype):
    # Qwen3's q/k norm: [T, heads, head_dim] views of a [T, (nq + 2 nkv) * hd] qkv output
    t, nq, nkv, hd = 9, 4, 2, 64
    qkv, _, _ = _data((t, (nq + 2 * nkv) * hd), dtype, seed=11)
    w = (1 + 0.1 * torch.randn(hd, generator=torch.Generator().manual_seed(1))).to(DEV, dtype)
    q = qkv[:, : nq * hd].view(t, nq, hd)
    k = qkv[:, nq * hd: (nq + nkv) * hd].view(t, nkv, hd)
    assert not q.is_contiguous() and not k.is_contiguous()
    before = qkv.clone()
    for v in (q, k):
        y = rms_norm(v, w, 1e-6)
        assert y.shape == v.shape and y.is_contiguous()
        _close(y, rms_norm_ref(v.contiguous(), w, 1e-6))
    assert torch.equal(qkv, before)  # inputs untouched


def test_strided_rows_with_residual_and_batch_dims():
    x, w, r = _data((2, 3, 5, 48), torch.float32, seed=4, residual=True)
    xs = torch.randn(2, 3, 5, 80, device=DEV)[..., 8:56]  # row stride 80, leading dims merge
    xs.copy_(x)
    y, h = rms_norm(xs, w, 1e-6, residual=r.transpose(0, 1).contiguous().transpose(0, 1))
    y_ref, h_ref = rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(h, h_ref)
    _close(y, y_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf_llama_rmsnorm(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, w, r = _data((6, 256), dtype, seed=8, residual=True)
    hf = LlamaRMSNorm(256, eps=1e-5).to(DEV, dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        expect = hf(x + r)
    y_ref, _ = rms_norm(x, w, 1e-5, residual=r, backend="torch")
    assert torch.equal(y_ref, expect)  # the reference is HF's arithmetic
    y, h = rms_norm(x, w, 1e-5, residual=r)
    _close(y, rms_norm_ref(h, w, 1e-5))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_residual_into_a_column_block(dtype, backend):
    """residual_out: x + residual written into a [T, H] column block of a wider buffer (EAGLE-3's aux
    streams: row stride 3H), returned as that view; the buffer's other columns untouched, out as
    without it."""
    t, h = 13, 96
    x, w, r = _data((t, h), dtype, seed=11, residual=True)
    buf = torch.full((t, 3 * h), 7.0, device=DEV, dtype=dtype)
    view = buf[:, h:2 * h]
    y, got = rms_norm(x, w, 1e-5, residual=r, residual_out=view, backend=backend)
    y0, h0 = rms_norm(x, w, 1e-5, residual=r, backend=backend)
    assert got.data_ptr() == view.data_ptr() and got.stride() == (3 * h, 1)
    assert torch.equal(got, h0) and torch.equal(y, y0)
    assert (buf[:, :h] == 7).all() and (buf[:, 2 * h:] == 7).all()
    _exact_or_ulp(got, rms_norm_ref(x, w, 1e-5, r)[1])
    with pytest.raises(ValueError, match="residual_out"):
        rms_norm(x, w, 1e-5, residual_out=view, backend=backend)  # no residual to add
    with pytest.raises(ValueError, match="residual_out"):
        rms_norm(x, w, 1e-5, residual=r, residual_out=buf[:, :h].t(), backend=backend)


def test_empty_and_torch_backend():
    x, w, r = _data((0, 32), torch.bfloat16, seed=2, residual=True)
    y, h = rms_norm(x, w, 1e-6, residual=r)
    assert y.shape == (0, 32) and h.shape == (0, 32)
    x, w, _ = _data((4, 32), torch.float16, seed=2)
    assert torch.equal(rms_norm(x, w, 1e-6, backend="torch"), rms_norm_ref(x, w, 1e-6))


def test_bad_inputs():
    x, w, r = _data((4, 32), torch.bfloat16, seed=1, residual=True)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:16], 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w.float(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, residual=r[:2])
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, residual=r.half())
    with pytest.raises(ValueError, match="x"):
        rms_norm(x.to(torch.int32), w, 1e-6)
    with pytest.raises(ValueError, match="x"):
        rms_norm(torch.zeros(2, 16385, device=DEV), torch.zeros(16385, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="stride"):
        rms_norm(x.t(), torch.ones(4, device=DEV, dtype=x.dtype), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        rms_norm(x, w, 1e-6, backend="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("t, h", [(7, 64), (33, 576), (1, 1000)])
def test_pair_side_by_side(t, h, gather, dtype):
    """EAGLE-3's input: [norm(embedding rows) * wa, norm(b) * wb] in one launch, against the
    reference (an embedding lookup, two norms, a concatenation) and against two rms_norm calls;
    a table kept in float32 with bf16 features is cast first, as the draft casts its embedding."""
    g = torch.Generator().manual_seed(t * h)
    b, wb, _ = _data((t, h), dtype, seed=t + h)
    wa = (1 + 0.2 * torch.randn(h, generator=g)).to(DEV, dtype)
    if gather:
        a = (torch.randn(50, h, generator=g) * 2).to(DEV)  # float32 table
        ids = torch.randint(0, 50, (t,), generator=g).to(DEV)
        rows = a[ids].to(dtype)
    else:
        a, ids = (torch.randn(t, h, generator=g) * 2).to(DEV, dtype), None
        rows = a
    got = rms_norm_pair(a, wa, b, wb, 1e-5, ids, backend="triton")
    ref = rms_norm_pair_ref(a, wa, b, wb, 1e-5, ids)
    assert got.shape == (t, 2 * h)
    _close(got, ref)
    _close(got[:, :h], rms_norm_ref(rows, wa, 1e-5))
    _close(got[:, h:], rms_norm_ref(b, wb, 1e-5))
    two = torch.cat([rms_norm(rows, wa, 1e-5, backend="triton"), rms_norm(b, wb, 1e-5, backend="triton")], dim=-1)
    _close(got, two)


def test_pair_bad_inputs_are_one_error():
    b, w = torch.randn(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match="a:"):
        rms_norm_pair(torch.randn(4, 8), w, b, w, 1e-5)
    with pytest.raises(ValueError, match="ids"):
        rms_norm_pair(torch.randn(10, 8), w, b, w, 1e-5, ids=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="wa"):
        rms_norm_pair(torch.randn(3, 8), torch.ones(7), b, w, 1e-5)
