"""FP8 (E4M3) kernels against float64 torch references.

Without CUDA everything here runs under Triton's CPU interpreter (fp8 tl.dot works there; it
computes in fp32). Bounds, fp32 out vs float64 from the dequantized fp8 values: 1e-5 under
the interpreter; on a GPU 1e-3 where the config promotes partial sums every block_k (2e-4
measured) and 5e-3 from M = 256 up with the fast_accum tiles (sums over all of K in the tensor
core: up to 3e-3 at K = 14336). bf16/fp16 out:
1e-2 (one output ulp). The pipeline vs the unquantized float model: 6e-2 (E4M3 keeps 3
mantissa bits, ~3.6% rms rounding of each activation).
"""


import pytest
import torch

from optllm.kernels import fp8 as F
from optllm.kernels.w8a8_int8 import GemmConfig, m_bucket, scaled_mm_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GEMM_TOL = 1e-3 if DEV == "cuda" else 1e-5
FAST_TOL = 5e-3 if DEV == "cuda" else 1e-5  # fast_accum tiles (M >= 256 unless OPTLLM_FP8_FAST_ACCUM=0)
MS = (1, 3, 16, 33, 128)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def rand_fp8(*shape) -> torch.Tensor:
    # spread over many binades (subnormals included) but within the finite range
    x = torch.randn(shape, device=DEV) * torch.exp2(torch.randint(-8, 6, shape, device=DEV).float())
    return x.clamp(-448, 448).to(F.FP8_DTYPE)


def w_scales(n, per_channel):
    return torch.rand(n if per_channel else 1, device=DEV) * 0.02 + 1e-3


def ref_config(m, n, k):
    return F.FP8_CONFIGS.get((m_bucket(m), n, k)) or F.default_fp8_config(m_bucket(m), n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m,k", [(1, 200), (6, 256)])
def test_quantize_bit_exact_and_writes_all(dtype, static, m, k):
    x = (torch.randn(m, k, device=DEV) * torch.exp2(torch.randint(-6, 6, (m, k), device=DEV).float())).to(dtype)
    if m > 1:
        x[m // 2] = 0
    xq = torch.full((m, k), float("nan"), device=DEV).to(F.FP8_DTYPE)
    if static:  # a scale that saturates the largest values: they must clamp to +-448
        scale = torch.tensor([x.float().abs().max().item() / 600], device=DEV)
        F.launch_quantize_fp8(x, xq, scale, static=True)
    else:
        scale = torch.full((m, 1), float("nan"), device=DEV)
        F.launch_quantize_fp8(x, xq, scale, static=False)
    ref_q, ref_s = F.quantize_fp8_ref(x, scale if static else None)
    assert not xq.float().isnan().any()
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_s)
    if static:
        assert xq.float().abs().max().item() == 448.0
    elif m > 1:
        assert scale[m // 2].item() == pytest.approx(F.SCALE_EPS)
    q2, s2 = F.quantize_fp8(x, scale if static else None)
    assert torch.equal(q2.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s2, ref_s)


def test_quantize_rounds_half_to_even_on_the_e4m3_grid():
    # E4M3 steps: 1/8 in [1, 2), 2 in [16, 32), 32 in [256, 448]
    x = torch.tensor([[1.0625, 1.1875, 17.0, 19.0, 31.0, 272.0, 500.0, -1.0625]], device=DEV)
    xq, _ = F.quantize_fp8(x, torch.tensor(1.0))
    assert xq.float().tolist() == [[1.0, 1.25, 16.0, 20.0, 32.0, 256.0, 448.0, -1.0]]


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", [(72, 200), (64, 256)])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("per_token", [True, False])
def test_gemm_vs_reference(m, n, k, per_channel, per_token):
    xq, w = rand_fp8(m, k), rand_fp8(n, k)
    xs = torch.rand(m if per_token else 1, 1, device=DEV) + 0.5
    ws, bias = w_scales(n, per_channel), torch.randn(n, device=DEV)
    out = torch.full((m, n), float("nan"), device=DEV)
    scaled_mm_triton(xq, xs, w, ws, bias, torch.float32, ref_config(m, n, k), out=out)
    assert not out.isnan().any()
    assert rel(out, F.fp8_gemm_ref(xq, xs, w, ws, bias, torch.float64, torch.float64)) < GEMM_TOL


@pytest.mark.parametrize("cfg", [GemmConfig(16, 16, 64, 1, swap_ab=True), GemmConfig(16, 32, 32, 4),
                                 GemmConfig(64, 16, 128, 3), GemmConfig(32, 64, 64, 2, fast_accum=True)])
def test_gemm_every_tiling(cfg):
    m, n, k = 33, 40, 96
    xq, w, xs, ws = rand_fp8(m, k), rand_fp8(n, k), torch.rand(m, 1, device=DEV), w_scales(n, True)
    out = torch.full((m, n), float("nan"), device=DEV)
    scaled_mm_triton(xq, xs, w, ws, None, torch.float32, cfg, out=out)
    assert rel(out, F.fp8_gemm_ref(xq, xs, w, ws, None, torch.float64, torch.float64)) < GEMM_TOL


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_gemm_half_outputs(out_dtype):
    xq, w, xs, ws = rand_fp8(16, 200), rand_fp8(72, 200), torch.rand(16, 1, device=DEV), w_scales(72, True)
    y = F.fp8_gemm(xq, xs, w, ws.reshape(-1, 1), None, out_dtype)
    assert y.dtype == out_dtype and y.shape == (16, 72)
    assert rel(y, F.fp8_gemm_ref(xq, xs, w, ws, None, torch.float64, torch.float64)) < 1e-2


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("per_channel", [True, False])
def test_linear_pipeline(m, static, per_channel):
    n, k = 72, 200
    w_f = torch.randn(n, k, device=DEV)
    ws = w_f.abs().amax(1, keepdim=True) / 448 if per_channel else w_f.abs().max().reshape(1) / 448
    weight = F.prepack_fp8((w_f / ws.reshape(-1, 1)).to(F.FP8_DTYPE), ws)
    assert weight.per_channel == per_channel
    x = torch.randn(2, m, k, device=DEV, dtype=torch.bfloat16)
    input_scale = (x.float().abs().max() / 448).reshape(1) if static else None
    bias = torch.randn(n, device=DEV)
    y = F.fp8_linear(x, weight, input_scale, bias)
    assert y.shape == (2, m, n) and y.dtype == torch.bfloat16
    assert rel(y, F.fp8_linear_ref(x, weight, input_scale, bias, torch.float64)) < 1e-2
    w_deq = weight.weight.double() * weight.scale.double().reshape(-1, 1)
    assert rel(y, x.double() @ w_deq.t() + bias.double()) < 6e-2


def test_cpu_without_interpreter_falls_back_to_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def boom(*args):
        raise AssertionError("the Triton op must not run")

    monkeypatch.setattr(F, "_quantize_op", boom)
    monkeypatch.setattr(F, "_gemm_op", boom)
    weight = F.prepack_fp8(rand_fp8(24, 64).cpu(), 0.01)
    x = torch.randn(3, 64)
    for s in (None, torch.tensor([0.01])):
        assert torch.equal(F.fp8_linear(x, weight, s), F.fp8_linear_ref(x, weight, s))
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        F.fp8_linear(x, weight, backend="triton")


def test_bad_inputs():
    xq, w = rand_fp8(4, 64), rand_fp8(24, 64)
    xs, ws = torch.rand(4, 1, device=DEV), w_scales(24, True)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        F.fp8_gemm(xq.to(torch.float8_e5m2), xs, w, ws)
    with pytest.raises(ValueError, match="K > 0"):
        F.fp8_gemm(xq, xs, w[:, :32], ws)
    with pytest.raises(ValueError, match="w_scale has 5"):
        F.fp8_gemm(xq, xs, w, ws[:5])
    with pytest.raises(ValueError, match="x_scale.dtype"):
        F.fp8_gemm(xq, xs.double(), w, ws)
    with pytest.raises(ValueError, match="w_fp8"):
        F.prepack_fp8(w.float(), ws)
    with pytest.raises(ValueError, match="w_scale"):
        F.prepack_fp8(w, ws[:3])
    weight = F.prepack_fp8(w, ws)
    with pytest.raises(ValueError, match="in_features=64"):
        F.fp8_linear(torch.randn(4, 63, device=DEV), weight)
    with pytest.raises(ValueError, match="input scale"):
        F.fp8_linear(torch.randn(4, 64, device=DEV), weight, torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="bias.shape"):
        F.fp8_linear(torch.randn(4, 64, device=DEV), weight, bias=torch.ones(23, device=DEV))
    with pytest.raises(ValueError, match="x.dtype"):
        F.quantize_fp8(torch.ones(4, 64, dtype=torch.int32, device=DEV))


def test_ops_registered_with_fake_impls():
    xq, w = rand_fp8(5, 64), rand_fp8(24, 64)
    xs, ws, x = torch.rand(5, 1, device=DEV), w_scales(1, False), torch.randn(5, 64, device=DEV)
    # opcheck's schema test does arithmetic on the fp8 inputs itself, which torch lacks
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.optllm.fp8_gemm.default, (xq, xs, w, ws, None, torch.bfloat16), test_utils=utils)
    torch.library.opcheck(torch.ops.optllm.quantize_fp8_dynamic.default, (x,))
    torch.library.opcheck(torch.ops.optllm.quantize_fp8_static.default, (x, torch.tensor([0.01], device=DEV)))


@pytest.mark.parametrize("static", [False, True])
def test_torch_compile_sees_the_ops(static):
    from torch._dynamo.testing import CompileCounterWithBackend

    weight = F.prepack_fp8(rand_fp8(24, 64), w_scales(24, True))
    x, s = torch.randn(3, 64, device=DEV), (torch.tensor([0.01], device=DEV) if static else None)
    cnt = CompileCounterWithBackend("eager")
    y = torch.compile(lambda t: F.fp8_linear(t, weight, s), fullgraph=True, backend=cnt)(x)
    assert torch.equal(y, F.fp8_linear(x, weight, s))
    targets = {str(n.target) for n in cnt.graphs[0].graph.nodes if n.op == "call_function"}
    quant = "optllm.quantize_fp8_static.default" if static else "optllm.quantize_fp8_dynamic.default"
    assert {quant, "optllm.fp8_gemm.default"} <= targets


@pytest.mark.parametrize("fast", [False, True])
def test_fast_accum_only_from_m_256_and_only_when_asked(fast):
    """Below M = 256 every config promotes its partial sums; from 256 up, fast_accum tiles
    exactly when fast is on (OPTLLM_FP8_FAST_ACCUM, default on), tiles of at most 128 x 128 that
    promote when off."""
    table = F.fp8_configs(fast)
    for bucket in (16, 32, 64, 128, 256, 512, 1024, 4096):
        for n, k in ((576, 576), (3072, 576), (4096, 14336), (28672, 4096)):
            cfg = table.get((bucket, n, k)) or F.default_fp8_config(bucket, n, k, fast=fast)
            assert cfg.fast_accum == (fast and bucket >= 256), (bucket, n, k)
            if not cfg.fast_accum and bucket >= 256:
                assert cfg.block_m * cfg.block_n <= 128 * 128, (bucket, n, k)
    assert F.FP8_CONFIGS == F.fp8_configs(F.FAST_ACCUM)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 200, 1024, 4096])
def test_gpu_llama_shapes_and_scaled_mm(m):
    shapes = {(n, k) for (_, n, k) in F.FP8_CONFIGS} | {(4096, 4096)}
    for n, k in sorted(shapes):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        w, ws = rand_fp8(n, k), w_scales(n, False)
        xq, xs = F.quantize_fp8(x)
        y = F.fp8_gemm(xq, xs, w, ws, None, torch.float32)
        cfg = F.FP8_CONFIGS.get((m_bucket(m), n, k)) or F.default_fp8_config(m_bucket(m), n, k)
        tol = FAST_TOL if cfg.fast_accum else GEMM_TOL
        assert rel(y, F.fp8_gemm_ref(xq, xs, w, ws, None, torch.float64, torch.float64)) < tol, (m, n, k)
        if m % 16 == 0:  # the peer, rowwise activation scales
            peer = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.expand(n).reshape(1, n).contiguous(),
                                    out_dtype=torch.bfloat16)
            assert rel(y, peer) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [4096, 14336, 20000])  # rows held in registers, and two-pass rows
def test_quantize_bit_exact_large_gpu(k, heavy_tailed_rows):
    # GPU path: reciprocal + one FMA correction (scaled_mm.div_rn) and the hardware RN cast
    m = 256
    x, g = heavy_tailed_rows(m, k, seed=k)
    for dtype in (torch.bfloat16, torch.float32):
        for static in (None, torch.tensor([x.abs().max().item() / 300], device="cuda")):
            xq, s = F.quantize_fp8(x.to(dtype), static)
            rq, rs = F.quantize_fp8_ref(x.to(dtype), static)
            assert torch.equal(s, rs) and torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))
    # scale 3 (row absmax 1344): x / scale lands exactly halfway between E4M3 neighbours
    grid = torch.arange(0, 127, device="cuda", dtype=torch.uint8).view(F.FP8_DTYPE).float()
    mids = (grid[:-1] + grid[1:]) / 2
    pick = torch.randint(0, mids.numel(), (m, k), device="cuda", generator=g)
    sign = torch.randint(0, 2, (m, k), device="cuda", generator=g).float() * 2 - 1
    ties = 3 * mids[pick] * sign
    ties[:, 0] = 1344.0
    xq, s = F.quantize_fp8(ties)
    rq = F.quantize_fp8_ref(ties)[0]
    assert (s == 3.0).all() and torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("static", [False, True])
def test_direct_launch_equals_the_jit_path_gpu(static, both_launch_paths):
    # kernels/common.CompiledLaunch, for the quantize kernel and the scaled GEMM: fresh inputs on a
    # key's direct path give JITFunction.run's bits (an unaligned x goes through JITFunction.run)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(200, 384, generator=g)
    sc = w.abs().amax(1) / 448
    weight = F.prepack_fp8((w / sc[:, None]).to(torch.float8_e4m3fn).cuda(), sc.cuda())
    scale = torch.tensor([0.02], device="cuda") if static else None
    for m in (1, 3, 64):
        x = torch.randn(m + 1, 384, generator=g).to("cuda", torch.bfloat16)
        for xi in (x[:m], x.flatten()[1:1 + m * 384].view(m, 384)):
            y = both_launch_paths(lambda v: F.fp8_linear(v, weight, scale), xi)
            ref = F.fp8_linear_ref(xi, weight, scale)
            assert (y.float() - ref.float()).norm() <= 1e-2 * ref.float().norm()
