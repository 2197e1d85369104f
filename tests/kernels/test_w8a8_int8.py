"""W8A8-INT8 kernels against float64 torch references.

Without CUDA everything here runs under Triton's CPU interpreter (int8 tl.dot works there).
Bounds: the gemm of given int8 inputs, fp32 out, vs float64: 1e-5 relative (int32 products
are exact, one fp32 rounding of the int32 sum and two of the scaling). bf16/fp16 out: 1e-2,
one output ulp (the interpreter casts fp32 -> bf16 by truncation). The whole pipeline vs the
unquantized float model: 3e-2 (per-token int8 rounding of the activations).
"""


import pytest
import torch

from optllm.kernels import w8a8_int8 as W

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MS = (1, 3, 16, 33, 128)
NKS = ((72, 200), (64, 256), (40, 96))
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def rand_int8(*shape) -> torch.Tensor:
    return torch.randint(-128, 128, shape, dtype=torch.int8, device=DEV)


def operands(m, n, k):
    xq, w = rand_int8(m, k), rand_int8(n, k)
    xs = torch.rand(m, 1, device=DEV) * 0.02 + 1e-3
    ws = torch.rand(n, device=DEV) * 0.02 + 1e-3
    bias = torch.randn(n, device=DEV)
    return xq, xs, w, ws, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 200), (5, 256), (33, 72)])
def test_quantize_bit_exact_and_writes_all(dtype, m, k):
    x = (torch.randn(m, k, device=DEV) * 3).to(dtype)
    x[m // 2] = 0  # zero row: scale must be the floor, values 0, never NaN
    xq = torch.full((m, k), -128, dtype=torch.int8, device=DEV)  # -128 is never produced
    scale = torch.full((m, 1), float("nan"), device=DEV)
    W.launch_quantize_int8(x, xq, scale)
    ref_q, ref_s = W.quantize_per_token_int8_ref(x)
    assert torch.equal(xq, ref_q) and torch.equal(scale, ref_s)
    assert scale[m // 2].item() == pytest.approx(W.SCALE_EPS) and not xq[m // 2].any()
    # rounding to nearest: |x - xq * scale| <= scale / 2 (+ the fp32 rounding of x / scale)
    err = (x.double() - xq.double() * scale.double()).abs()
    assert (err <= scale.double() * (0.5 + 1e-5)).all()
    q2, s2 = W.quantize_per_token_int8(x)
    assert torch.equal(q2, ref_q) and torch.equal(s2, ref_s)


def test_quantize_rounds_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49]], device=DEV)
    xq, scale = W.quantize_per_token_int8(x)
    assert scale.item() == 1.0
    assert xq.tolist() == [[127, 0, 2, 2, 0, -2, -2, 3]]


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", NKS)
def test_gemm_vs_exact_int_reference(m, n, k):
    xq, xs, w, ws, bias = operands(m, n, k)
    cfg = W.INT8_CONFIGS.get((W.m_bucket(m), n, k)) or W.default_int8_config(W.m_bucket(m), n, k)
    out = torch.full((m, n), float("nan"), device=DEV)
    W.scaled_mm_triton(xq, xs, w, ws, bias, torch.float32, cfg, out=out)
    ref = W.w8a8_int8_gemm_ref(xq, xs, w, ws, bias, torch.float64, torch.float64)
    assert not out.isnan().any()
    assert rel(out, ref) < 1e-5


@pytest.mark.parametrize("cfg", [
    W.GemmConfig(16, 16, 64, 1, swap_ab=True), W.GemmConfig(32, 64, 64, 2, swap_ab=True),
    W.GemmConfig(16, 32, 32, 4), W.GemmConfig(64, 16, 128, 3),
])
@pytest.mark.parametrize("m,n,k", [(3, 72, 200), (33, 40, 96), (70, 72, 64)])
def test_gemm_every_tiling(cfg, m, n, k):
    xq, xs, w, ws, bias = operands(m, n, k)
    out = torch.full((m, n), float("nan"), device=DEV)
    W.scaled_mm_triton(xq, xs, w, ws, None, torch.float32, cfg, out=out)
    assert rel(out, W.w8a8_int8_gemm_ref(xq, xs, w, ws, None, torch.float64, torch.float64)) < 1e-5


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_gemm_half_outputs(out_dtype):
    xq, xs, w, ws, bias = operands(33, 72, 200)
    y = W.w8a8_int8_gemm(xq, xs, w, ws.reshape(-1, 1), bias, out_dtype)
    assert y.dtype == out_dtype and y.shape == (33, 72)
    assert rel(y, W.w8a8_int8_gemm_ref(xq, xs, w, ws, bias, torch.float64, torch.float64)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", MS)
def test_linear_pipeline(dtype, m):
    n, k = 72, 200
    w_f = torch.randn(n, k, device=DEV)
    ws = w_f.abs().amax(1) / 127
    weight = W.prepack_w8a8(torch.round(w_f / ws[:, None]).to(torch.int8), ws)
    x = torch.randn(m, k, device=DEV).to(dtype).reshape(1, m, k)
    bias = torch.randn(n, device=DEV)
    y = W.w8a8_int8_linear(x, weight, bias)
    assert y.shape == (1, m, n) and y.dtype == dtype
    pipe = W.w8a8_int8_linear_ref(x, weight, bias, compute_dtype=torch.float64)
    assert rel(y, pipe) < (1e-5 if dtype == torch.float32 else 1e-2)
    w_deq = weight.weight.double() * weight.scale.double()[:, None]
    model = x.double() @ w_deq.t() + bias.double()
    assert rel(y, model) < 3e-2


def test_cpu_without_interpreter_falls_back_to_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def boom(*args):
        raise AssertionError("the Triton op must not run")

    monkeypatch.setattr(W, "_quantize_op", boom)
    monkeypatch.setattr(W, "_gemm_op", boom)
    weight = W.prepack_w8a8(rand_int8(24, 64).cpu(), torch.rand(24) + 0.1)
    x = torch.randn(2, 3, 64)
    assert torch.equal(W.w8a8_int8_linear(x, weight), W.w8a8_int8_linear_ref(x, weight))
    xq, xs = W.quantize_per_token_int8(x[0])
    assert torch.equal(xq, W.quantize_per_token_int8_ref(x[0])[0])
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        W.w8a8_int8_linear(x, weight, backend="triton")


def test_bad_inputs():
    xq, xs, w, ws, bias = operands(4, 24, 64)
    with pytest.raises(ValueError, match="int8"):
        W.w8a8_int8_gemm(xq.float(), xs, w, ws)
    with pytest.raises(ValueError, match="K > 0"):
        W.w8a8_int8_gemm(xq[:, :32], xs, w, ws)
    with pytest.raises(ValueError, match="x_scale"):
        W.w8a8_int8_gemm(xq, xs[:2], w, ws)
    with pytest.raises(ValueError, match="w_scale.dtype"):
        W.w8a8_int8_gemm(xq, xs, w, ws.half())
    with pytest.raises(ValueError, match="bias.shape"):
        W.w8a8_int8_gemm(xq, xs, w, ws, bias[:3])
    with pytest.raises(ValueError, match="out_dtype"):
        W.w8a8_int8_gemm(xq, xs, w, ws, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="backend"):
        W.w8a8_int8_gemm(xq, xs, w, ws, backend="cuda")
    with pytest.raises(ValueError, match="w_int8"):
        W.prepack_w8a8(w.float(), ws)
    with pytest.raises(ValueError, match="w_scale"):
        W.prepack_w8a8(w, ws[:5])
    weight = W.prepack_w8a8(w, ws)
    with pytest.raises(ValueError, match="in_features=64"):
        W.w8a8_int8_linear(torch.randn(4, 65, device=DEV), weight)
    with pytest.raises(ValueError, match="x.dtype"):
        W.w8a8_int8_linear(torch.randn(4, 64, device=DEV).double(), weight)
    with pytest.raises(ValueError, match="2-D"):
        W.quantize_per_token_int8(torch.randn(2, 2, 64, device=DEV))
    with pytest.raises(ValueError, match="block_n"):
        W.GemmConfig(16, 24, 32)


def test_ops_registered_with_fake_impls():
    xq, xs, w, ws, bias = operands(5, 24, 64)
    torch.library.opcheck(torch.ops.optllm.w8a8_int8_gemm.default, (xq, xs, w, ws, bias, torch.bfloat16))
    torch.library.opcheck(torch.ops.optllm.quantize_per_token_int8.default, (torch.randn(5, 64, device=DEV),))


def test_torch_compile_sees_the_ops():
    from torch._dynamo.testing import CompileCounterWithBackend

    weight = W.prepack_w8a8(rand_int8(24, 64), torch.rand(24, device=DEV) + 0.1)
    x = torch.randn(3, 64, device=DEV)
    cnt = CompileCounterWithBackend("eager")
    y = torch.compile(lambda t: W.w8a8_int8_linear(t, weight), fullgraph=True, backend=cnt)(x)
    assert torch.equal(y, W.w8a8_int8_linear(x, weight))
    targets = {str(n.target) for n in cnt.graphs[0].graph.nodes if n.op == "call_function"}
    assert {"optllm.quantize_per_token_int8.default", "optllm.w8a8_int8_gemm.default"} <= targets


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 200, 1024])
def test_gpu_llama_shapes_and_int_mm(m):
    # every configured (bucket, N, K) plus the default heuristic on a Llama-like shape
    shapes = {(n, k) for (_, n, k) in W.INT8_CONFIGS} | {(4096, 4096)}
    for n, k in sorted(shapes):
        xq, xs, w, ws, bias = operands(m, n, k)
        y = W.w8a8_int8_gemm(xq, xs, w, ws, bias, torch.float32)
        ref = W.w8a8_int8_gemm_ref(xq, xs, w, ws, bias, torch.float64, torch.float64)
        assert rel(y, ref) < 1e-5, (m, n, k)
        if m > 16:  # the peer: exact int32 products, then our scaling
            acc = torch._int_mm(xq, w.t()).double()
            assert rel(y, acc * xs.double() * ws.double() + bias.double()) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [4096, 14336, 20000])  # rows held in registers, and two-pass rows
def test_quantize_bit_exact_large_gpu(k, heavy_tailed_rows):
    # the GPU divides by a reciprocal with one FMA correction (scaled_mm.div_rn): it must give
    # torch's correctly rounded x / scale everywhere, exact ties included
    m = 256
    x, g = heavy_tailed_rows(m, k, seed=k)
    for dtype in (torch.bfloat16, torch.float32):
        xq, s = W.quantize_per_token_int8(x.to(dtype))
        rq, rs = W.quantize_per_token_int8_ref(x.to(dtype))
        assert torch.equal(s, rs) and torch.equal(xq, rq)
    # scale 3 (row absmax 381): x / scale = j + 1/2 exactly, ties to even
    ties = 3 * (torch.randint(-127, 127, (m, k), device="cuda", generator=g).float() + 0.5)
    ties[:, 0] = 381.0
    xq, s = W.quantize_per_token_int8(ties)
    assert (s == 3.0).all() and torch.equal(xq, W.quantize_per_token_int8_ref(ties)[0])


# ----------------------------------------------------------------------- asymmetric activations
def test_azp_quantizer_hand_values():
    """Row [-1, 0, 3]: scale 4/255, azp round(-128 + 255/4) = round(-64.25) = -64; codes
    round(x / scale) + azp: -1 -> -64 - 64 = -128, 0 -> -64, 3 -> 191 - 64 = 127. A constant
    row [0.5, 0.5] spans [0, 0.5] (zero stays in the range): scale 0.5/255, azp -128, codes 127.
    An all-zero row keeps the smallest scale and codes at its zero point."""
    x = torch.tensor([[-1.0, 0.0, 3.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])
    xq, s, azp = W.quantize_per_token_int8_azp_ref(x)
    assert torch.allclose(s[0], torch.tensor([4 / 255]))
    assert azp[0].item() == -64
    assert xq[0].tolist() == [-128, -64, 127]
    assert torch.allclose(s[1], torch.tensor([0.5 / 255])) and azp[1].item() == -128
    assert xq[1].tolist() == [127, 127, 127]
    assert s[2].item() == pytest.approx(W.SCALE_EPS) and xq[2].tolist() == [azp[2].item()] * 3
    assert xq.dtype == torch.int8 and azp.dtype == torch.float32


@pytest.mark.parametrize("shift", [0.0, 3.0])
def test_azp_quantizer_round_trip_and_range(shift):
    """(xq - azp) * scale is within half a step of x everywhere, every code is in [-128, 127],
    and both ends of each row's range [min(min, 0), max(max, 0)] are used."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 200, generator=g) + shift
    x[:, 7] *= 40  # an outlier channel
    xq, s, azp = W.quantize_per_token_int8_azp_ref(x)
    back = (xq.float() - azp) * s
    assert ((back - x).abs() <= s * 0.5 + 1e-6 * x.abs()).all()
    assert xq.min() >= -128 and xq.max() <= 127
    assert (xq.amax(1) >= 126).all()  # the top of each row's range
    crosses = x.amin(1) < 0
    assert crosses.any() and (xq.amin(1)[crosses] <= -127).all()  # and its bottom, where below zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", MS)
def test_azp_linear_pipeline(dtype, m):
    """The Triton GEMM plus the zero-point correction against the float64 pipeline reference
    (1e-5 fp32 out: the correction adds two fp32 roundings of terms as large as the product), and
    closer to the float model than the symmetric pipeline on rows with an offset and an outlier."""
    n, k = 72, 200
    g = torch.Generator(device=DEV).manual_seed(m)
    w_f = torch.randn(n, k, device=DEV, generator=g)
    ws = w_f.abs().amax(1) / 127
    weight = W.prepack_w8a8(torch.round(w_f / ws[:, None]).to(torch.int8), ws)
    sums = W.int8_code_sums(weight)
    assert torch.equal(sums, weight.weight.double().sum(1).float() * weight.scale)
    x = torch.randn(m, k, device=DEV, generator=g) + 2.0
    x[:, 3] = 30.0
    x = x.to(dtype).reshape(1, m, k)
    bias = torch.randn(n, device=DEV, generator=g)
    y = W.w8a8_int8_azp_linear(x, weight, sums, bias)
    assert y.shape == (1, m, n) and y.dtype == dtype
    xq, s, azp = W.quantize_per_token_int8_azp_ref(x.reshape(m, k))
    w_deq = weight.weight.double() * weight.scale.double()[:, None]
    pipe = ((xq.double() - azp.double()) * s.double()) @ w_deq.t() + bias.double()
    assert rel(y.reshape(m, n), pipe) < (1e-5 if dtype == torch.float32 else 1e-2)
    ref = W.w8a8_int8_azp_linear_ref(x, weight, bias)
    assert rel(y, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    model = x.double().reshape(m, k) @ w_deq.t() + bias.double()
    sym = W.w8a8_int8_linear_ref(x, weight, bias, compute_dtype=torch.float64).reshape(m, n)
    if dtype == torch.float32:
        assert rel(y.reshape(m, n), model) < 0.6 * rel(sym, model)


def test_azp_bad_inputs():
    weight = W.prepack_w8a8(rand_int8(8, 32), torch.ones(8, device=DEV))
    x = torch.randn(2, 32, device=DEV)
    with pytest.raises(ValueError, match="code_sums must be float32"):
        W.w8a8_int8_azp_linear(x, weight, torch.ones(7, device=DEV))
    with pytest.raises(ValueError, match=r"bias.shape=\(3,\)"):
        W.w8a8_int8_azp_linear(x, weight, W.int8_code_sums(weight), torch.ones(3, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_direct_launch_equals_the_jit_path_gpu(both_launch_paths):
    # kernels/common.CompiledLaunch for the int8 quantize kernel and the scaled GEMM (see test_fp8.py)
    g = torch.Generator().manual_seed(8)
    w = torch.randn(200, 384, generator=g)
    sc = w.abs().amax(1) / 127
    weight = W.prepack_w8a8(torch.round(w / sc[:, None]).to(torch.int8).cuda(), sc.cuda())
    for m in (1, 3, 64):
        x = torch.randn(m + 1, 384, generator=g).to("cuda", torch.bfloat16)
        for xi in (x[:m], x.flatten()[1:1 + m * 384].view(m, 384)):
            y = both_launch_paths(lambda v: W.w8a8_int8_linear(v, weight), xi)
            ref = W.w8a8_int8_linear_ref(xi, weight)
            assert (y.float() - ref.float()).norm() <= 1e-2 * ref.float().norm()
