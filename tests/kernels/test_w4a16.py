"""W4A16 GEMM kernels against the float32 reference, under TRITON_INTERPRET=1 on CPU.

Error bounds (relative, ||y - ref|| / ||ref|| and max|y - ref| / max|ref|): bf16 output
1e-2 (one bf16 rounding is 2^-9; the CPU interpreter truncates instead of rounding, which
doubles it), fp16 2e-3, fp32 1e-5. The reference uses the same bf16/fp16 x and scales.
"""


import pytest
import torch

from optllm.formats.packing import pack_int32
from optllm.kernels import w4a16 as kernels_w4a16
from optllm.kernels.w4a16 import (
    W4A16_CONFIGS,
    W4A16Config,
    default_w4a16_config,
    dequantize_w4a16,
    dequantize_w4a16_triton,
    force_config,
    m_bucket,
    prepack_w4a16,
    w4a16_gemm,
    w4a16_linear,
    w4a16_linear_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _quantized(n, k, group, asym, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(-8, 8, (n, k // group), dtype=torch.int8, generator=g) if asym else None
    x = torch.randn(256, k, generator=g)  # rows sliced per case
    return q.to(DEVICE), scales.to(DEVICE), None if zeros is None else zeros.to(DEVICE), x


def _assert_close(y, ref, dtype):
    assert not torch.isnan(y).any(), "some output element was not written"
    err = (y.float() - ref).abs()
    assert err.norm() / ref.norm() <= BOUND[dtype]
    assert err.max() / ref.abs().max() <= BOUND[dtype]


def _run(m, n, k, group, asym, dtype, seed, config=None, bias=True, n_major=False):
    q, s, z, x = _quantized(n, k, group, asym, dtype, seed)
    x = x[:m].to(DEVICE, dtype)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype) if bias else None
    w = prepack_w4a16(q, s, z, group, n_major=n_major)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    y = w4a16_gemm(x, w, b, config=config, out=out)
    assert y is out
    _assert_close(y, w4a16_linear_ref(x, q, s, z, group, b), dtype)
    assert int(w.locks.abs().sum()) == 0, "split-K counters must return to zero"


# (N, K, group): N 72/96 are not multiples of BLOCK_N; K 192 is not a multiple of BLOCK_K 128
SHAPES = [(64, 128, 32), (96, 192, 64), (72, 256, 128), (72, 192, 192)]


@pytest.mark.parametrize("m", [1, 3, 16, 33, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_major", [False, True])
def test_matches_reference(m, dtype, n_major):
    # rotate shape / group / sym-asym with m so every combination of each axis appears
    for i, (n, k, group) in enumerate(SHAPES):
        _run(m, n, k, group, asym=(i + m) % 2 == 0, dtype=dtype, seed=100 * m + i, n_major=n_major)


@pytest.mark.slow
@pytest.mark.parametrize("m", [1, 3, 16, 33, 128])
@pytest.mark.parametrize("n,k,group", SHAPES + [(64, 256, 64), (96, 128, 128)])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_sweep(m, n, k, group, asym, dtype):
    _run(m, n, k, group, asym, dtype, seed=m * 7 + n + k + group)


@pytest.mark.parametrize("m,n,k,group,config", [
    (1, 72, 256, 32, W4A16Config(16, 32, 64, 3, swap_ab=True)),     # decode, split-K 3, BK > group
    (1, 72, 256, 64, W4A16Config(16, 32, 128, 2, gemv=True)),       # CUDA-core GEMV, split-K 2
    (3, 40, 192, 192, W4A16Config(16, 16, 128, 1, gemv=True)),      # GEMV, 3 rows, per-channel tail
    (2, 72, 512, 64, W4A16Config(16, 32, 64, 2, num_stages=3, gemv=True)),  # GEMV, pipelined
    (1, 40, 192, 192, W4A16Config(16, 16, 64, 2, num_stages=2, gemv=True)),
    (5, 40, 128, 64, W4A16Config(16, 16, 32, 2, swap_ab=True)),     # decode, BK < group
    (3, 96, 256, 128, W4A16Config(16, 64, 256, 1, swap_ab=True)),   # BK halved to the group
    (16, 72, 256, 32, W4A16Config(16, 32, 128, 2)),                 # tiled, split-K
    (16, 64, 512, 256, W4A16Config(16, 64, 128, 4)),                # tiled, split-K 4
    (40, 72, 384, 128, W4A16Config(32, 32, 128, 3, swap_ab=True)),  # swap, 2 row tiles
    (64, 48, 200, 200, W4A16Config(64, 16, 128, 2)),                # per-channel, K tail of 72
    (70, 48, 192, 64, W4A16Config(16, 16, 64, dequant=True)),       # dequantize + cuBLAS path
])
@pytest.mark.parametrize("asym", [False, True])
def test_forced_paths(m, n, k, group, config, asym):
    _run(m, n, k, group, asym, torch.bfloat16, seed=m + n + k, config=config)


@pytest.mark.parametrize("m,n,k,group,config", [
    (1, 72, 256, 64, W4A16Config(1, 32, 128, 2, gemv=True)),        # split-K 2, N tail
    (1, 72, 256, 32, W4A16Config(1, 64, 64, 3, gemv=True)),         # step of 4 word rows = group 32
    (3, 40, 192, 192, W4A16Config(4, 16, 128, 1, gemv=True)),       # 3 of 4 rows, per-channel, K tail
    (5, 72, 512, 64, W4A16Config(8, 32, 64, 2, num_stages=3, gemv=True)),  # pipelined, 5 of 8 rows
    (8, 64, 256, 128, W4A16Config(8, 64, 128, 4, gemv=True)),       # split-K 4, 8 rows
    (9, 48, 128, 64, W4A16Config(4, 16, 64, 2, gemv=True)),         # 3 row tiles of 4
    (1, 40, 200, 200, W4A16Config(1, 16, 256, 1, gemv=True)),       # one step past K
    (3, 96, 256, 128, W4A16Config(16, 64, 256, 1, swap_ab=True)),   # the tiles read N-major too
    (16, 72, 256, 32, W4A16Config(16, 32, 128, 2)),
    (64, 48, 200, 200, W4A16Config(64, 16, 128, 2)),
    (70, 48, 192, 64, W4A16Config(16, 16, 64, dequant=True)),
])
@pytest.mark.parametrize("asym", [False, True])
def test_forced_paths_n_major(m, n, k, group, config, asym):
    _run(m, n, k, group, asym, torch.bfloat16, seed=m + n + k + 1, config=config, n_major=True)


@pytest.mark.parametrize("group,asym", [(32, False), (128, True), (200, True)])
def test_n_major_layout_is_the_transpose(group, asym):
    k = 200 if group == 200 else 256
    q, s, z, _ = _quantized(40, k, group, asym, torch.bfloat16, seed=group + 3)
    wk, wn = prepack_w4a16(q, s, z, group), prepack_w4a16(q, s, z, group, n_major=True)
    assert wn.n_major and not wk.n_major and tuple(wn.packed.shape) == (k // 8, 40)
    assert torch.equal(wn.packed, wk.packed.t())
    assert torch.equal(dequantize_w4a16(wn), dequantize_w4a16(wk))
    assert torch.equal(dequantize_w4a16_triton(wn, torch.bfloat16), dequantize_w4a16_triton(wk, torch.bfloat16))


def test_float32_activations():
    _run(33, 72, 192, 64, True, torch.float32, seed=5)
    _run(1, 72, 192, 64, True, torch.float32, seed=6)
    _run(3, 72, 192, 64, True, torch.float32, seed=7, n_major=True)


@pytest.mark.parametrize("group,asym", [(32, False), (64, True), (128, True), (200, True)])
def test_prepack_dequantize_exact(group, asym):
    k = 200 if group == 200 else 256
    q, s, z, _ = _quantized(48, k, group, asym, torch.bfloat16, seed=group)
    q[0, :8] = torch.tensor([-8, 7, -8, 7, 0, -1, 1, 7], dtype=torch.int8)  # extremes, sign bit
    w = prepack_w4a16(q, s, z, group)
    expect = q.float() if z is None else q.float() - z.float().repeat_interleave(group, 1)
    expect = expect * s.float().repeat_interleave(group, 1)
    assert w.packed.dtype == torch.int32 and tuple(w.packed.shape) == (48, k // 8)
    assert torch.equal(dequantize_w4a16(w), expect)
    assert torch.equal(dequantize_w4a16(w, torch.bfloat16), expect.to(torch.bfloat16))
    dense = dequantize_w4a16_triton(w, torch.bfloat16).float()
    if DEVICE == "cuda":  # the same bits as the checkpoint's bf16 dequantization
        assert torch.equal(dense, expect.to(torch.bfloat16).float())
    else:  # the interpreter truncates to bf16 instead of rounding: within one bf16 ulp
        assert ((dense - expect).abs() <= expect.abs() * 2.0**-7).all()


def test_layout_is_the_checkpoint_packing_with_nibbles_paired():
    # word (n, c) holds k = 8c .. 8c + 7 as q + 8, like compressed-tensors' pack-quantized
    # weight_packed, with the nibbles reordered so that nibbles j and j + 4 are k = 8c + 2j, + 1
    q = torch.randint(-8, 8, (24, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(4))
    q[0, 8 * 3 + 5] = 7
    w = prepack_w4a16(q, torch.ones(24, 4), None, 64)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(w.packed, pack_int32(q.view(24, 32, 8)[:, :, order].reshape(24, 256), 4))
    assert int((w.packed[0, 3] >> 24) & 15) == 15  # k = 8 * 3 + 5 = 8c + 2 * 2 + 1 -> nibble 6


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_linear_batch_dims_and_bias(backend):
    q, s, z, x = _quantized(72, 192, 64, True, torch.float16, seed=11)
    w = prepack_w4a16(q, s, z, 64)
    x = x[:30].reshape(2, 3, 5, 192).to(DEVICE, torch.float16)
    b = torch.randn(72).to(DEVICE, torch.float16)
    y = w4a16_linear(x, w, b, backend=backend)
    assert y.shape == (2, 3, 5, 72) and y.dtype == torch.float16
    ref = w4a16_linear_ref(x, q, s, z, 64, b)
    # the torch backend rounds the dequantized weight to fp16 before the fp16 matmul
    _assert_close(y, ref, torch.float16)
    y1 = w4a16_linear(x[0, 0, 0], w, None, backend=backend)  # 1-D input
    assert y1.shape == (72,)
    _assert_close(y1, w4a16_linear_ref(x[0, 0, 0], q, s, z, 64), torch.float16)


def test_bad_inputs():
    q, s, z, x = _quantized(16, 128, 32, True, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="group_size"):
        prepack_w4a16(q, s[:, :3], None, 48)  # 128 % 48 != 0
    with pytest.raises(ValueError, match="group_size"):
        prepack_w4a16(q[:, :96], s[:, :6], None, 16)  # not a multiple of 32, not K
    with pytest.raises(ValueError, match="K"):
        prepack_w4a16(q[:, :12], s[:, :1], None, 12)  # K % 8 != 0
    with pytest.raises(ValueError, match="q"):
        prepack_w4a16(q.to(torch.int32), s, z, 32)
    with pytest.raises(ValueError, match="q"):
        prepack_w4a16(q * 2, s, z, 32)  # outside [-8, 7]
    with pytest.raises(ValueError, match="scales"):
        prepack_w4a16(q, s[:, :2], z, 32)
    with pytest.raises(ValueError, match="zeros"):
        prepack_w4a16(q, s, z.to(torch.int32), 32)
    w = prepack_w4a16(q, s, z, 32)
    xb = x[:4].to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match="x"):
        w4a16_linear(xb[:, :64], w)
    with pytest.raises(ValueError, match="bias"):
        w4a16_linear(xb, w, torch.zeros(15, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="backend"):
        w4a16_linear(xb, w, backend="cuda")
    with pytest.raises(ValueError, match="x"):
        w4a16_gemm(xb.to(torch.int32), w)
    with pytest.raises(ValueError, match="out"):
        w4a16_gemm(xb, w, out=torch.empty(4, 15, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="zeros"):
        prepack_w4a16(q, s, z * 2, 32)  # outside [-8, 7]
    with pytest.raises(ValueError, match="block_k"):
        W4A16Config(16, 64, 16)
    with pytest.raises(ValueError, match="block_m"):
        W4A16Config(4, 64, 128)
    with pytest.raises(ValueError, match="block_n"):
        W4A16Config(16, 24, 128)


def test_configs_are_valid_data():
    assert [m_bucket(m) for m in (1, 2, 16, 17, 64, 65, 128, 129, 256, 257, 10**5)] == \
        [1, 16, 16, 64, 64, 128, 128, 256, 256, 4096, 4096]
    for (bucket, n, k), cfg in W4A16_CONFIGS.items():
        assert bucket in (1, 16, 64, 128, 256, 4096) and isinstance(cfg, W4A16Config)
        assert cfg.dequant or cfg.swap_ab or cfg.gemv or bucket >= 64
        assert not cfg.gemv or bucket == 1
    for m in (1, 2, 16, 64, 200, 4096):
        assert isinstance(default_w4a16_config(m, 11008, 4096), W4A16Config)


@pytest.mark.parametrize("nk", [(960, 576), (576, 576), (3072, 576), (576, 1536)])
def test_smollm2_gemv_table_entries_equal_the_reference(nk):
    """The tuned M = 1 GEMV configs of SmolLM2's shapes (split 8, one stage) on their own shapes,
    group 64, symmetric (the o shape also asymmetric: the interpreter is slow at these sizes)."""
    n, k = nk
    cfg = W4A16_CONFIGS[(1, n, k)]
    assert cfg.gemv
    for asym in (False, True) if nk == (576, 576) else (False,):
        _run(1, n, k, 64, asym, torch.bfloat16, seed=n + k + asym, config=cfg)


def test_n_major_table_and_lookup():
    from optllm.kernels.w4a16_configs import N_MAJOR_SHAPES, W4A16_CONFIGS_N, gemv_bucket, lookup_w4a16_config

    assert [gemv_bucket(m) for m in (1, 2, 3, 5, 8, 9, 17)] == [1, 2, 4, 8, 8, 16, 64]
    for (bucket, n, k), cfg in W4A16_CONFIGS_N.items():
        assert cfg.gemv and cfg.block_m == bucket == 1 and cfg.block_k // 8 <= 128 // 8  # a step inside g128
    assert all(isinstance(n, int) and isinstance(k, int) for n, k in N_MAJOR_SHAPES)
    # N-major: M = 1 from its own table, M = 2..8 and up the K-major tiles, never the multi-row GEMV
    assert lookup_w4a16_config(1, 4096, 14336, True) == W4A16_CONFIGS_N[(1, 4096, 14336)]
    for m in (2, 5, 8, 16):
        assert lookup_w4a16_config(m, 4096, 14336, True) == W4A16_CONFIGS[(16, 4096, 14336)]
    assert lookup_w4a16_config(3, 1000, 2048, True).swap_ab
    assert lookup_w4a16_config(1, 1000, 2048, True).gemv
    assert lookup_w4a16_config(1, 4096, 14336) == W4A16_CONFIGS[(1, 4096, 14336)]


def test_table_json_round_trip(tmp_path, monkeypatch):
    # what tune_w4a16.py writes is what OPTLLM_W4A16_TABLE reads back (merged into the tables
    # at import, so gemm.py measures a sweep's winners in the same device call)
    import optllm.kernels.w4a16_configs as wc

    entries = {(True, 1, 96, 256): W4A16Config(1, 64, 64, 2, 4, 3, gemv=True),
               (False, 16, 96, 256): W4A16Config(16, 32, 128, 2, swap_ab=True)}
    path = tmp_path / "table.json"
    path.write_text(wc.table_to_json(entries))
    monkeypatch.setenv("OPTLLM_W4A16_TABLE", str(path))
    assert wc._table_from_env() == entries
    monkeypatch.delenv("OPTLLM_W4A16_TABLE")
    assert wc._table_from_env() == {}


@pytest.mark.parametrize("n_major", [False, True])
def test_custom_op_opcheck(n_major):
    q, s, z, x = _quantized(40, 128, 64, True, torch.bfloat16, seed=9)
    w = prepack_w4a16(q, s, z, 64, n_major=n_major)
    args = (x[:3].to(DEVICE, torch.bfloat16), w.packed, w.scales, w.zeros,
            torch.randn(40).to(DEVICE, torch.bfloat16), w.locks, w.K, w.group_size, n_major)
    torch.library.opcheck(torch.ops.optllm.w4a16_gemm.default, args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.optllm.w4a16_gemm(*(mode.from_tensor(a) if isinstance(a, torch.Tensor)
                                             else a for a in args))
    assert fake.shape == (3, 40) and fake.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 64, 128, 256])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("n_major", [False, True])
def test_llama_shapes_gpu(m, n, k, n_major):
    _run(m, n, k, 128, True, torch.bfloat16, seed=m + n, bias=False, n_major=n_major)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("asym", [False, True])
def test_n_major_gemv_gpu(m, asym):
    # the packed-bf16x2 path (USE_ASM), odd N and K tails, every rows-per-program bucket
    for n, k, group in [(6144, 4096, 128), (1000, 1344, 64), (576, 1536, 32)]:
        _run(m, n, k, group, asym, torch.bfloat16, seed=m + k, n_major=True)
        _run(m, n, k, group, asym, torch.bfloat16, seed=m + k, n_major=True,
             config=W4A16Config(m, 256, 128, 3, 2, 3, gemv=True))


def test_wide_swap_ab_tiles_run_unsplit():
    # 128-row swap-AB tiles split over K computed wrong on the H100 (forty-sixth session); 64-row ones keep their split
    from optllm.kernels.w4a16 import _plan

    wide = _plan(256, 256, 1024, 128, False, False, False, torch.bfloat16, False, 1024,
                 W4A16Config(128, 128, 64, 4, 4, 3, swap_ab=True))
    narrow = _plan(256, 256, 1024, 128, False, False, False, torch.bfloat16, False, 1024,
                   W4A16Config(64, 128, 64, 4, 4, 3, swap_ab=True))
    assert wide.after[-1] == 1 and not wide.constexprs["SPLIT"]
    assert narrow.after[-1] == 4 and narrow.constexprs["SPLIT"]


def test_force_config_overrides_the_table():
    q, s, z, x = _quantized(72, 256, 64, True, torch.bfloat16, seed=21)
    w = prepack_w4a16(q, s, z, 64)
    xb = x[:40].to(DEVICE, torch.bfloat16)
    ref = w4a16_linear_ref(xb, q, s, z, 64)
    forced = W4A16Config(16, 32, 128, 2, gemv=True)
    with force_config(forced):
        with force_config(W4A16Config(16, 32, 64, swap_ab=True)):
            _assert_close(w4a16_linear(xb, w), ref, torch.bfloat16)
        assert kernels_w4a16._FORCED == [forced]
        _assert_close(w4a16_linear(xb, w), ref, torch.bfloat16)  # 40 rows through the GEMV
    assert kernels_w4a16._FORCED == []


@pytest.mark.parametrize("asym", [False, True])
def test_pipelined_gemv_is_bit_identical(asym):
    # num_stages only changes where the weight words wait (shared memory), not the arithmetic
    q, s, z, x = _quantized(96, 512, 64, asym, torch.bfloat16, seed=31)
    w = prepack_w4a16(q, s, z, 64)
    xb = x[:1].to(DEVICE, torch.bfloat16)
    outs = [w4a16_gemm(xb, w, config=W4A16Config(16, 32, 128, 2, 4, st, gemv=True)) for st in (1, 2, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    _assert_close(outs[0], w4a16_linear_ref(xb, q, s, z, 64), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", [
    W4A16Config(16, 64, 128, 1, gemv=True), W4A16Config(16, 64, 128, 4, gemv=True),
    W4A16Config(2, 64, 128, 1, gemv=True), W4A16Config(16, 64, 64, 2, swap_ab=True),
    W4A16Config(32, 64, 64, 1), None])
@pytest.mark.parametrize("n_major", [False, True])
def test_direct_launch_equals_the_jit_path_gpu(config, n_major, both_launch_paths):
    # kernels/common.CompiledLaunch: a key's first call compiles through JITFunction.run, later ones
    # call the compiled launcher with the same arguments -- so fresh inputs on the direct path must
    # give JITFunction.run's bits, with and without bias / zero points, for any row stride of x and
    # for an x that is not 16-byte aligned (copied first: the bf16x2 paths read x as int32 words)
    for seed, (m, asym, bias) in enumerate([(1, False, False), (3, True, True), (5, True, False)]):
        q, s, z, x = _quantized(200, 384, 64, asym, torch.bfloat16, seed=40 + seed)
        w = prepack_w4a16(q, s, z, 64, n_major=n_major)
        b = torch.randn(200, device=DEVICE, dtype=torch.bfloat16) if bias else None
        wide = x[:m, :].to(DEVICE, torch.bfloat16)
        wide = torch.cat([wide, wide], dim=1)[:, :384]  # row stride 768
        shifted = x[:m].to(DEVICE, torch.bfloat16).flatten()
        shifted = torch.cat([shifted[:1], shifted])[1:].view(m, 384)  # 2 bytes past an aligned start
        for xi in (x[:m].to(DEVICE, torch.bfloat16), wide, shifted):
            y = both_launch_paths(lambda v: w4a16_gemm(v, w, b, config=config), xi)
            _assert_close(y, w4a16_linear_ref(xi, q, s, z, 64, b), torch.bfloat16)
            assert int(w.locks.abs().sum()) == 0
