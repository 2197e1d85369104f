"""silu_and_mul kernel against the torch reference (HF's act_fn(gate) * up), under
TRITON_INTERPRET=1 on CPU.

Bounds, elementwise |out - ref| <= tol * |ref| + tiny: float32 1e-6 (exp within an ulp or two);
fp16 2^-9 and bf16 2^-6, two ulps: a last-bit difference of the fp32 silu can flip its rounding
to x.dtype, and the product then rounds one more ulp apart. The CPU interpreter truncates to
bf16 instead of rounding: 3 * 2^-7 there. Measured under the interpreter: fp32 3.1e-7, fp16
1.0e-3 (one ulp, 1 element in 7000), bf16 1.5e-2.
"""


import pytest
import torch

from optllm.kernels.activation import silu_and_mul, silu_and_mul_ref

# exp(-g) overflows to inf for g < -88 on purpose (silu -> -0); numpy warns about it
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6 if DEV == "cuda" else 3 * 2.0**-7}
TINY = {torch.float32: 1e-30, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-120}


def _x(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 4
    x.view(-1)[:4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])  # exp overflow, saturation, zero
    return x.to(DEV, dtype)


def _close(y, ref):
    assert y.dtype == ref.dtype and y.shape == ref.shape
    err = (y.float() - ref.float()).abs()
    assert (err <= TOL[y.dtype] * ref.float().abs() + TINY[y.dtype]).all(), float(err.max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2 * 3000), (5, 2 * 64), (70, 2 * 40), (2, 3, 2 * 100)])
def test_matches_reference(shape, dtype):
    x = _x(shape, dtype, seed=sum(shape))
    y = silu_and_mul(x)
    assert y.is_contiguous() and y.shape == (*shape[:-1], shape[-1] // 2)
    _close(y, silu_and_mul_ref(x))


def test_reference_is_hf_llama_mlp_activation():
    from transformers.activations import ACT2FN

    x = _x((4, 2 * 32), torch.bfloat16, seed=1)
    assert torch.equal(silu_and_mul(x, backend="torch"), ACT2FN["silu"](x[:, :32]) * x[:, 32:])


def test_row_strided_input():
    # the gate|up half of a wider fused output: rows 3 * 2I apart
    base = _x((6, 3 * 96), torch.float32, seed=5)
    x = base[:, 96:]
    y = silu_and_mul(x)
    _close(y, silu_and_mul_ref(x.contiguous()))


def test_empty_and_bad_inputs():
    assert silu_and_mul(torch.empty(0, 8, device=DEV)).shape == (0, 4)
    with pytest.raises(ValueError, match="x"):
        silu_and_mul(torch.zeros(3, 7, device=DEV))
    with pytest.raises(ValueError, match="x"):
        silu_and_mul(torch.zeros(3, 8, device=DEV, dtype=torch.int32))
    with pytest.raises(ValueError, match="stride"):
        silu_and_mul(torch.zeros(8, 3, device=DEV).t(), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        silu_and_mul(torch.zeros(3, 8, device=DEV), backend="cuda")
