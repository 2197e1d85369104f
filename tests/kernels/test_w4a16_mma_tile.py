"""kernels/w4a16_mma_tile: the small-batch tensor-core tiles. On the CPU: every variant builds for sm_90
(NVRTC, then Triton's ptxas) without spills, the configs' checks and the split-K sizing; on the GPU: the
kernel against a float32 reference of the same bf16-rounded weights, tails of M and N, asymmetric groups,
bias, split-K determinism, graph replays."""

from __future__ import annotations

import pytest
import torch
from test_w4a16_mma import _nvrtc, _quantized  # noqa: E402

from optllm.kernels import w4a16 as w4k
from optllm.kernels import w4a16_mma as mk
from optllm.kernels import w4a16_mma_tile as tk

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ref(x, q, s, z, group, bias=None):
    """float32 x @ W^T with W rounded to bf16 as the kernel rounds it: bf16((q - z) * scale), one rounding."""
    zz = 0 if z is None else z.float().repeat_interleave(group, dim=1)
    w = ((q.float() - zz) * s.float().repeat_interleave(group, dim=1)).to(torch.bfloat16).float()
    y = x.float() @ w.t()
    return y if bias is None else y + bias.float()


def test_rounded_reference_is_the_dequantized_weight_rounded_once():
    q, s, z = _quantized(32, 256, 64, True, seed=3)
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, 64, dtype=torch.bfloat16))
    x = torch.eye(256).to(torch.bfloat16)
    assert torch.equal(_ref(x, q, s, z, 64), mk.dequantize_mma(w).to(torch.bfloat16).float().t())


BUILT = [tk.TileConfig(), tk.TileConfig(split_k=4), tk.TileConfig(8, 2, 8), tk.TileConfig(4, 1, 16),
         tk.TileConfig(4, 2, 4, stages=3), tk.TileConfig(8, 1, 8, unroll=4), tk.TileConfig(2, 2, 2, stages=2),
         tk.TileConfig(4, 2, 8, ablate=True)]


@pytest.mark.parametrize("cfg", BUILT, ids=repr)
def test_cuda_source_builds_for_hopper_without_spills(cfg, tmp_path):
    """Compiled on the CPU as the GPU would (NVRTC to PTX, Triton's sm_90 ptxas): it builds, spills nothing,
    and 8 warps of it (two CTAs of 4, one of 8) fit an SM's 64 K registers."""
    import re
    import subprocess
    from pathlib import Path

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's ptxas is not in this installation")
    lib = _nvrtc()
    for cpg, zeros, bias in ((1, False, False), (2, True, True)):
        src = tmp_path / f"k{cpg}.ptx"
        src.write_text(mk.nvrtc_ptx(lib, tk.cuda_source(cfg, cpg, zeros, bias), "compute_90"))
        out = subprocess.run([str(ptxas), "-arch=sm_90", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
        spills = [int(v) for v in re.findall(r"(\d+) bytes spill", out)]
        assert spills and not any(spills), out
        regs = max(int(v) for v in re.findall(r"Used (\d+) registers", out))
        assert regs * 32 * max(8, cfg.warps) <= 65536, (cfg, regs)


def test_configs_checks_and_split_k_sizing():
    with pytest.raises(ValueError, match="rt \\* nt <= 16"):
        tk.TileConfig(rt=2, nt=9)
    with pytest.raises(ValueError, match="warps=3"):
        tk.TileConfig(warps=3)
    with pytest.raises(ValueError, match="96 KiB"):
        tk.TileConfig(nt=16, rt=1, stages=8)
    with pytest.raises(ValueError, match="split_k=17"):
        tk.TileConfig(split_k=17)
    cfg = tk.TileConfig()
    assert (cfg.bn, cfg.bm, cfg.smem()) == (128, 64, 4 * 64 * 144)
    assert tk.grid(cfg, 65, 4096) == (2, 32, 1)
    # 8B shapes at M = 64: o / down (32 CTAs) split until 2 CTAs an SM or 8 splits; gate_up (224) not at all;
    # qkv (48) into 8; a short K is never split below 4 groups-of-two chunks a split
    assert tk.config_for(4096, 4096, 64).split_k == 8
    assert tk.config_for(4096, 14336, 64).split_k == 8
    assert tk.config_for(28672, 4096, 64).split_k == 2
    assert tk.config_for(28672, 4096, 256).split_k == 1
    assert tk.config_for(6144, 4096, 64).split_k == 8
    assert tk.config_for(576, 576, 64).split_k == 2  # 9 chunks: 4.5 a split at 2, 2.25 at 4
    assert tk.workspace_floats(tk.TileConfig(split_k=4), 64, 4096) == 4 * 32 * 128 * 64
    assert tk.workspace_floats(cfg, 64, 4096) == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [tk.TileConfig(), tk.TileConfig(split_k=3), tk.TileConfig(8, 2, 8, stages=2),
                                 tk.TileConfig(4, 1, 16, unroll=4), tk.TileConfig(2, 2, 2, stages=3, split_k=2),
                                 None])
@pytest.mark.parametrize("asym", [False, True])
def test_kernel_gpu(cfg, asym):
    assert mk.available(), mk._UNAVAILABLE
    for n, k, group in ((64, 256, 64), (960, 576, 64), (272, 1024, 128), (128, 512, 512), (48, 320, 64),
                        (4096, 1024, 128)):
        q, s, z = _quantized(n, k, group, asym, seed=n + k, device="cuda")
        w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, group, dtype=torch.bfloat16))
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        for m in (1, 7, 17, 64, 65, 130, 256):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for b in (None, bias):
                ref = _ref(x, q, s, z, group, b)
                y = tk.w4a16_mma_tile(x, w, b, cfg)
                # the same bf16 weights: fp32 sums in another order and one bf16 rounding of y (2^-9 relative
                # at most an element); a misplaced nibble, x pair or scale is O(1)
                err = (y.float() - ref).abs()
                assert err.max() <= 2 ** -8 * ref.abs().max() and (y.float() - ref).norm() <= 3e-3 * ref.norm(), \
                    (n, k, group, m, b is None, float(err.max()))
                assert torch.equal(y, tk.w4a16_mma_tile(x, w, b, cfg))  # deterministic (split-K too)
        xb = torch.randn(70, k + 64, device="cuda").to(torch.bfloat16)  # strided x rows read the same
        assert torch.equal(tk.w4a16_mma_tile(xb[:, :k], w, None, cfg), tk.w4a16_mma_tile(xb[:, :k].contiguous(), w,
                                                                                         None, cfg))
    assert set(mk.COMPILED_BY) == {"nvrtc"}, mk.COMPILED_BY


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [tk.TileConfig(), tk.TileConfig(split_k=4)])
def test_kernel_gpu_graph_and_errors(cfg):
    """Replays follow x, and the split-K counters are back at zero after every call."""
    q, s, z = _quantized(512, 1024, 128, False, seed=2, device="cuda")
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, 128, dtype=torch.bfloat16))
    x = torch.randn(64, 1024, device="cuda").to(torch.bfloat16)
    eager = tk.w4a16_mma_tile(x, w, None, cfg)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.w4a16_mma_tile(x, w, None, cfg)
    for _ in range(3):
        x.copy_(torch.randn(64, 1024, device="cuda").to(torch.bfloat16))
        graph.replay()
        assert torch.equal(out, tk.w4a16_mma_tile(x, w, None, cfg)) and not torch.equal(out, eager)
    assert int(tk._counters(x.device).abs().sum()) == 0
    with pytest.raises(ValueError, match="bf16"):
        tk.w4a16_mma_tile(torch.zeros(20, 1024, device="cuda"), w)
    with pytest.raises(ValueError, match="1024"):
        tk.w4a16_mma_tile(torch.zeros(20, 512, device="cuda", dtype=torch.bfloat16), w)


class _FakeDriver:
    """cuLaunchKernel / cuFuncSetAttribute as the tiles call them through ctypes: each launch's grid, block,
    dynamic shared memory, stream and argument values (8 pointers, then five ints)."""

    def __init__(self):
        self.launches, self.attributes = [], []

    def cuFuncSetAttribute(self, func, attribute, value):
        self.attributes.append((attribute, value))
        return 0

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, shm, stream, argv, extra):
        import ctypes

        vals = [ctypes.cast(argv[i], ctypes.POINTER(ctypes.c_void_p)).contents.value or 0 for i in range(8)]
        vals += [ctypes.cast(argv[i], ctypes.POINTER(ctypes.c_int)).contents.value for i in range(8, 13)]
        self.launches.append(((gx, gy, gz), bx, shm, stream.value or 0, tuple(vals)))
        return 0


@pytest.mark.parametrize("cfg", [tk.TileConfig(), tk.TileConfig(8, 1, 16, stages=5, split_k=3)])
@pytest.mark.parametrize("asym,with_bias", [(False, False), (True, True)])
def test_a_launch_sends_every_argument(monkeypatch, cfg, asym, with_bias):
    """The grid (column blocks, row blocks, splits), block, the x ring's dynamic shared memory (opted in past
    48 KiB), the current stream and every pointer and size the kernel reads; the split-K form's workspace
    and counters, none without it. On the CPU through a stand-in driver."""

    n, k, group = 272, 512, 128
    q, s, z = _quantized(n, k, group, asym, seed=7)
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, group, dtype=torch.bfloat16))
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    driver = _FakeDriver()

    class Kernel:
        func = None

    monkeypatch.setattr(tk.mk, "_compile", lambda source, name: Kernel())
    monkeypatch.setattr("torch.cuda._utils._get_gpu_runtime_library", lambda: driver)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 55, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(tk, "_KERNELS", {})
    monkeypatch.setattr(tk, "_COUNTERS", {})
    monkeypatch.setattr(tk, "_WORKSPACES", {})
    xb = torch.randn(100, k + 64).to(torch.bfloat16)
    for m in (1, 17, 100):
        x = xb[:m, :k]
        y = tk.w4a16_mma_tile(x, w, bias, cfg)
        grid, block, shm, stream, vals = driver.launches[-1]
        assert y.shape == (m, n) and stream == 55 and block == 32 * cfg.warps and shm == cfg.smem()
        assert grid == (-(-m // cfg.bm), -(-n // cfg.bn), cfg.split_k)
        assert vals[:6] == (w.words.data_ptr(), x.data_ptr(), w.scales.data_ptr(),
                            (w.zeros if asym else w.scales).data_ptr(), (bias if with_bias else y).data_ptr(),
                            y.data_ptr())
        assert vals[8:] == (m, n, k, k + 64, n)
        if cfg.split_k > 1:
            ws = tk._WORKSPACES[None][-1]
            assert vals[6] == ws.data_ptr() and vals[7] == tk._COUNTERS[None].data_ptr()
            assert ws.numel() >= cfg.split_k * grid[0] * grid[1] * cfg.bn * cfg.bm
        else:
            assert vals[6:8] == (0, 0)
    assert driver.attributes == ([(8, cfg.smem())] if cfg.smem() > 48 * 1024 else [])
