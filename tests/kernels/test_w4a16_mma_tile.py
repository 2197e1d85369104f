"""kernels/w4a16_mma_tile: the small-batch tensor-core tiles. On the CPU: every variant builds for sm_90
(NVRTC, then Triton's ptxas) without spills, the configs' checks and the split-K sizing; on the GPU: the
kernel against a float32 reference of the same bf16-rounded weights, tails of M and N, asymmetric groups,
bias, split-K determinism, graph replays."""

from __future__ import annotations

import pytest
import torch
from test_w4a16_mma import _nvrtc, _quantized, replays_follow_x  # noqa: E402

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
         tk.TileConfig(4, 2, 8, ablate=True), tk.TileConfig(4, 1, 5, stages=2),
         tk.TileConfig(4, 2, 8, stages=6, wgmma=True), tk.TileConfig(4, 1, 16, stages=6, split_k=4, wgmma=True),
         tk.TileConfig(4, 2, 4, stages=4, split_k=4, wgmma=True), tk.TileConfig(4, 1, 3, stages=3, wgmma=True),
         tk.TileConfig(4, 2, 16, stages=4, wgmma=True), tk.TileConfig(4, 1, 32, stages=4, split_k=2, wgmma=True)]


@pytest.mark.parametrize("cfg", BUILT, ids=repr)
def test_cuda_source_builds_for_hopper_without_spills(cfg, tmp_path):
    """Compiled on the CPU as the GPU would (NVRTC to PTX, Triton's sm_90 ptxas; sm_90a for the wgmma form): it builds,
    spills nothing, and 8 warps of it (two CTAs of 4, one of 8) fit an SM's 64 K registers; the wgmma form's wgmmas
    are not serialized (ptxas would wait out each before the next: it warns when it does)."""
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
        arch = "90a" if cfg.wgmma else "90"
        src.write_text(mk.nvrtc_ptx(lib, tk.cuda_source(cfg, cpg, zeros, bias), f"compute_{arch}"))
        out = subprocess.run([str(ptxas), f"-arch=sm_{arch}", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
        assert "serialized" not in out and "warning" not in out.lower(), out
        spills = [int(v) for v in re.findall(r"(\d+) bytes spill", out)]
        assert spills and not any(spills), out
        regs = max(int(v) for v in re.findall(r"Used (\d+) registers", out))
        assert regs * 32 * max(8, cfg.warps) <= 65536, (cfg, regs)


def test_configs_checks_and_split_k_sizing():
    with pytest.raises(ValueError, match="rt \\* nt <= 16"):
        tk.TileConfig(rt=2, nt=9)
    with pytest.raises(ValueError, match="rt \\* nt <= 32"):
        tk.TileConfig(rt=2, nt=17, wgmma=True)
    with pytest.raises(ValueError, match="warps=4"):
        tk.TileConfig(8, 2, 8, wgmma=True)
    with pytest.raises(ValueError, match="stages >= 3"):
        tk.TileConfig(4, 2, 8, stages=2, wgmma=True)
    assert tk.TileConfig(4, 2, 8, stages=6, wgmma=True).smem() == 6 * (64 * 128 + 2 * (2048 + 128 + 64))
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


def test_tuned_table_rows_route_and_config(monkeypatch):
    a, b = tk.TileConfig(4, 2, 4, split_k=4), tk.TileConfig(8, 2, 8, unroll=4)
    monkeypatch.setattr(tk, "TILE_TABLE", {(4096, 4096): ((32, 32, a), (96, 128, b), (250, 300, b)),
                                           (64, 64): ((1, 20, a),)})
    assert tk.route_rows(4096, 4096) == frozenset([32, *range(96, 129), *range(250, 257)])  # up to TILE_MAX_M
    assert tk.route_rows(64, 64) == frozenset(range(17, 21))  # from RUNTIME_MIN_M: below, the GEMV's
    assert tk.route_rows(4096, 14336) == frozenset()
    assert [tk.config_for(4096, 4096, m) for m in (32, 96, 128)] == [a, b, b]
    assert tk.config_for(4096, 4096, 129) == tk.TileConfig(split_k=4)  # outside the table: the default (96 CTAs)
    assert tk.config_for(4096, 14336, 64).split_k == 8  # other shapes: the default, sized


def test_wgmma_rows_route_only_where_the_device_runs_them(monkeypatch):
    """A table row in the wgmma form goes to the tiles on sm_90 only; elsewhere its M stays on the Triton path and
    config_for gives the mma.sync form."""
    wg, plain = tk.TileConfig(4, 2, 8, stages=6, split_k=2, wgmma=True), tk.TileConfig(4, 2, 4, split_k=4)
    monkeypatch.setattr(tk, "TILE_TABLE", {(4096, 4096): ((64, 64, wg), (96, 96, plain))})
    assert tk.route_rows(4096, 4096, wgmma=True) == {64, 96} and tk.route_rows(4096, 4096, wgmma=False) == {96}
    assert tk.config_for(4096, 4096, 64, wgmma=True) == wg
    assert not tk.config_for(4096, 4096, 64, wgmma=False).wgmma
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (8, 0))
    assert tk.route_rows(4096, 4096) == {96}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    assert tk.route_rows(4096, 4096) == {64, 96} and tk.config_for(4096, 4096, 64) == wg


def test_the_shipped_table_is_measured_rows_in_valid_configs():
    """Every entry: a shape the runtime has, rows inside RUNTIME_MIN_M..TILE_MAX_M, a config that builds (its
    checks ran at import), and a split that leaves each CTA four chunks at least."""
    assert tk.TILE_TABLE, "the tuned table is empty"
    for (n, k), entries in tk.TILE_TABLE.items():
        assert n % 16 == 0 and k % 64 == 0
        for lo, hi, cfg in entries:
            assert tk.RUNTIME_MIN_M <= lo <= hi <= tk.TILE_MAX_M
            assert isinstance(cfg, tk.TileConfig) and not cfg.ablate and (k // 64) // cfg.split_k >= 4


# the wgmma form (sm_90a): one and two 64-row tiles a CTA, BM 8 .. 128, split-K, ring depths 3 .. 6
WGMMA_GPU = [tk.TileConfig(4, 2, 8, stages=6, wgmma=True), tk.TileConfig(4, 1, 3, stages=3, split_k=3, wgmma=True),
             tk.TileConfig(4, 1, 16, stages=4, split_k=2, wgmma=True), tk.TileConfig(4, 2, 1, stages=5, wgmma=True),
             tk.TileConfig(4, 2, 16, stages=4, wgmma=True)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [tk.TileConfig(), tk.TileConfig(split_k=3), tk.TileConfig(8, 2, 8, stages=2),
                                 tk.TileConfig(4, 1, 16, unroll=4), tk.TileConfig(2, 2, 2, stages=3, split_k=2),
                                 tk.TileConfig(4, 1, 5, stages=2), None, *WGMMA_GPU])
@pytest.mark.parametrize("asym", [False, True])
def test_kernel_gpu(cfg, asym):
    assert mk.available(), mk._UNAVAILABLE
    if cfg is not None and cfg.wgmma and not tk.wgmma_here():
        pytest.skip("the wgmma form needs sm_90a")
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
def test_wgmma_descriptor_offsets_gpu(monkeypatch):
    """The x descriptor's two byte offsets (X_LBO, X_SBO) as the hardware reads them: where the wgmma form computes
    wrong, the failure says whether the swapped pair computes right (the one reading of PTX the transcription
    cannot check), so that one device call answers it."""
    if not tk.wgmma_here():
        pytest.skip("the wgmma form needs sm_90a")
    cfg = WGMMA_GPU[0]
    q, s, z = _quantized(256, 512, 128, False, seed=5, device="cuda")
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, 128, dtype=torch.bfloat16))
    x = torch.randn(64, 512, device="cuda").to(torch.bfloat16)
    ref = _ref(x, q, s, z, 128, None)

    def rel() -> float:
        y = tk.w4a16_mma_tile(x, w, None, cfg)
        return float((y.float() - ref).norm() / ref.norm())

    lbo, sbo = tk.X_LBO, tk.X_SBO
    got = rel()
    if got > 3e-3:
        monkeypatch.setattr(tk, "X_LBO", sbo)
        monkeypatch.setattr(tk, "X_SBO", lbo)
        pytest.fail(f"the wgmma form's relative error is {got:.3g} with X_LBO {lbo}, X_SBO {sbo}; with them swapped "
                    f"it is {rel():.3g}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [tk.TileConfig(), tk.TileConfig(split_k=4), WGMMA_GPU[1]])
def test_kernel_gpu_graph_and_errors(cfg):
    """Replays follow x, and the split-K counters are back at zero after every call."""
    if cfg.wgmma and not tk.wgmma_here():
        pytest.skip("the wgmma form needs sm_90a")
    q, s, z = _quantized(512, 1024, 128, False, seed=2, device="cuda")
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, 128, dtype=torch.bfloat16))
    x = torch.randn(64, 1024, device="cuda").to(torch.bfloat16)
    replays_follow_x(lambda x_: tk.w4a16_mma_tile(x_, w, None, cfg), x)
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


@pytest.mark.parametrize("cfg", [tk.TileConfig(), tk.TileConfig(8, 1, 16, stages=5, split_k=3),
                                 tk.TileConfig(4, 2, 8, stages=6, split_k=2, wgmma=True)])
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

    compiled = []
    monkeypatch.setattr(tk.mk, "_compile",
                        lambda source, name, arch_suffix="": compiled.append(arch_suffix) or Kernel())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("torch.cuda._utils._get_gpu_runtime_library", lambda: driver)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 55, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(tk, "_KERNELS", {})
    monkeypatch.setattr(tk, "_COUNTERS", {})
    monkeypatch.setattr(tk.mk, "_WORKSPACES", {})
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
            ws = tk.mk._WORKSPACES[None][-1]
            assert vals[6] == ws.data_ptr() and vals[7] == tk._COUNTERS[None].data_ptr()
            assert ws.numel() >= cfg.split_k * grid[0] * grid[1] * cfg.bn * cfg.bm
        else:
            assert vals[6:8] == (0, 0)
    assert driver.attributes == ([(8, cfg.smem())] if cfg.smem() > 48 * 1024 else [])
    assert compiled and set(compiled) == {"a" if cfg.wgmma else ""}  # wgmma: compute_90a


def _bf16_pairs(u32: torch.Tensor) -> torch.Tensor:
    """int64 words holding two bf16 (low half first) -> float64 [..., 2]."""
    lo, hi = u32 & 0xFFFF, (u32 >> 16) & 0xFFFF
    return torch.stack([lo, hi], -1).to(torch.int32).mul(1 << 16).view(torch.float32).double()


def _emulate_tile(x, w, cfg, bias=None):
    """The kernel transcribed to the CPU, CTA by CTA and warp by warp with the 32 lanes as vectors: the x ring
    as bytes (cp.async done at issue: a refill of the slot being read would corrupt it), the weight registers
    loaded `unroll` chunks ahead, each lane's A and B fragment registers taken where the kernel takes them and
    placed where the PTX tables put them (m16n8k16 .bf16: A row g / g + 8, columns 2t, 2t + 1 (+ 8); B rows 2t,
    2t + 1 (+ 8), column g; D rows g / g + 8, columns 2t, 2t + 1), the split-K partials summed in split order,
    and the stores' rows and columns. float64 products of the kernel's bf16 operands."""
    m_rows, k = x.shape
    n, chunks, cpg = w.N, k // 64, w.group_size // 64
    tiles, xrow, bm, stages = n // 16, tk.XROW, cfg.bm, cfg.stages
    words = w.words.to(torch.int64) & 0xFFFFFFFF
    xbytes = x.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF  # bf16 bits [M, K]
    lane = torch.arange(32)
    g, t = lane >> 2, lane & 3
    gx, gy, gz = tk.grid(cfg, m_rows, n)
    y = torch.zeros(m_rows, n, dtype=torch.float64)
    for bx, by in ((a, b) for b in range(gy) for a in range(gx)):
        m0 = bx * bm
        total = {}  # (warp, r, j) -> [32, 4], summed over the splits in order
        for bz in range(gz):
            groups = chunks // cpg
            c0, c1 = (bz * groups // cfg.split_k) * cpg, ((bz + 1) * groups // cfg.split_k) * cpg
            ring = torch.full((stages, bm * xrow // 2), -1, dtype=torch.int64)  # bf16 bits a slot, 2-byte units

            threads = 32 * cfg.warps
            xp = -(-bm * 8 // threads)  # XP: pieces a thread

            def load_x(s, c):
                for tid in range(threads):  # thread tid's piece i: q = tid + i * THREADS while q < BM * 8
                    for i in range(xp):
                        q = tid + i * threads
                        if q >= bm * 8:
                            continue
                        mm = min(m0 + (q >> 3), m_rows - 1)  # x_pieces: the source row, made once
                        dst = (tid >> 3) * xrow + (tid & 7) * 16 + i * (threads // 8) * xrow  # bytes in the slot
                        ring[s, dst // 2:dst // 2 + 8] = xbytes[mm, c * 64 + (q & 7) * 8:c * 64 + (q & 7) * 8 + 8]

            for s in range(stages - 1):
                if c0 + s < c1:
                    load_x(s, c0 + s)
            acc = {(wp, r, j): torch.zeros(32, 4, dtype=torch.float64) for wp in range(cfg.warps)
                   for r in range(cfg.rt) for j in range(cfg.nt)}
            tl = {(wp, r): (by * cfg.warps + wp) * cfg.rt + r for wp in range(cfg.warps) for r in range(cfg.rt)}
            tc = {key: min(v, tiles - 1) for key, v in tl.items()}
            buf = {}  # (u, warp, r) -> the chunk index its registers hold
            for u in range(cfg.unroll):
                if c0 + u < c1:
                    for key in tc:
                        buf[(u, *key)] = c0 + u
            slot = 0
            for cb in range(c0, c1, cfg.unroll):
                for u in range(cfg.unroll):
                    c = cb + u
                    if c >= c1:
                        continue
                    cur = {}
                    for key in tc:
                        cur[key] = buf[(u, *key)]
                        if c + cfg.unroll < c1:
                            buf[(u, *key)] = c + cfg.unroll
                    fill = stages - 1 if slot == 0 else slot - 1
                    if c + stages - 1 < c1:
                        load_x(fill, c + stages - 1)
                    for (wp, r), tcur in tc.items():
                        assert cur[(wp, r)] == c  # the registers hold this chunk's weights
                        wd = words[tcur, c, :, :]  # [32 lanes, 4 words]
                        n0 = tcur * 16 + g
                        gi = c // cpg
                        s0, s1 = w.scales[gi, n0].double(), w.scales[gi, n0 + 8].double()
                        z0 = 0.0 if w.zeros is None else w.zeros[gi, n0].double()
                        z1 = 0.0 if w.zeros is None else w.zeros[gi, n0 + 8].double()
                        for i in range(4):
                            a = torch.zeros(16, 16, dtype=torch.float64)
                            for jr in range(4):  # register jr: nibble pair jr, jr + 4 of word i >> 4 jr
                                lo = (wd[:, i] >> (4 * jr)) & 15
                                hi = (wd[:, i] >> (4 * jr + 16)) & 15
                                sc, zz = (s0, z0) if jr % 2 == 0 else (s1, z1)
                                vals = [((v.double() - 8 - zz) * sc).to(torch.bfloat16).double() for v in (lo, hi)]
                                row, col = g + 8 * (jr & 1), 2 * t + 8 * (jr >> 1)
                                a[row, col], a[row, col + 1] = vals
                            for j in range(cfg.nt):
                                base = (slot * bm * xrow + (8 * j + g) * xrow + 32 * t) // 2  # 2-byte units
                                off = base + (0 if i < 2 else 8) + 4 * (i % 2)  # xa (.a .b | .c .d), xb (...)
                                b0 = torch.stack([ring.view(-1)[off], ring.view(-1)[off + 1]], -1)
                                b1 = torch.stack([ring.view(-1)[off + 2], ring.view(-1)[off + 3]], -1)
                                assert (b0 >= 0).all() and (b1 >= 0).all()  # read only what a copy wrote
                                b = torch.zeros(16, 8, dtype=torch.float64)
                                b0v = _bf16_pairs(b0[:, 0] | (b0[:, 1] << 16))
                                b1v = _bf16_pairs(b1[:, 0] | (b1[:, 1] << 16))
                                b[2 * t, g], b[2 * t + 1, g] = b0v[:, 0], b0v[:, 1]
                                b[2 * t + 8, g], b[2 * t + 9, g] = b1v[:, 0], b1v[:, 1]
                                d = a @ b
                                acc[(wp, r, j)] += torch.stack([d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t],
                                                                d[g + 8, 2 * t + 1]], -1)
                    slot = 0 if slot + 1 == stages else slot + 1
            for key, v in acc.items():
                total[key] = total.get(key, 0) + v
        for (wp, r, j), v in total.items():
            if tl[(wp, r)] >= tiles:
                continue
            na = tc[(wp, r)] * 16 + g
            for q, (dm, dn) in enumerate(((0, 0), (1, 0), (0, 8), (1, 8))):
                mm = m0 + 8 * j + 2 * t + dm
                keep = mm < m_rows
                bb = 0.0 if bias is None else bias[na + dn].double()
                y[mm[keep], (na + dn)[keep]] = (v[:, q] + bb)[keep] if bias is not None else v[keep, q]
    return y


@pytest.mark.parametrize("cfg,n,k,group,m,asym", [
    (tk.TileConfig(2, 2, 2, stages=2), 80, 256, 64, 20, False),
    (tk.TileConfig(1, 1, 3, stages=3, unroll=4, split_k=3), 48, 512, 64, 30, True),
    (tk.TileConfig(2, 4, 1, stages=4, unroll=1, split_k=2), 96, 384, 128, 9, True),
    (tk.TileConfig(1, 2, 2, stages=3, unroll=2), 32, 320, 64, 16, False),
    (tk.TileConfig(4, 1, 5, stages=2), 128, 256, 64, 45, True),  # 320 x pieces over 128 threads: the last partial
    (tk.TileConfig(8, 1, 1, stages=2, split_k=2), 160, 256, 128, 7, False),  # 64 pieces, 256 threads
])
def test_the_kernels_index_arithmetic_computes_the_linear(cfg, n, k, group, m, asym):
    """The transcription above, over M and N tails (columns past M and row tiles past N computed from copies,
    never stored), split-K with uneven splits, ring depths 2-4, unroll 1-4: within float64 rounding of the
    reference on the same bf16 weights (one placement off is O(1)); x chunks of more pieces than threads, fewer,
    and not a multiple of them."""
    _transcription_computes_the_linear(_emulate_tile, cfg, n, k, group, m, asym)


def _transcription_computes_the_linear(emulate, cfg, n, k, group, m, asym):
    q, s, z = _quantized(n, k, group, asym, seed=n + m)
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, group, dtype=torch.bfloat16))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    for b in (None, bias):
        ref = _ref(x, q, s, z, group, b).double()
        got = emulate(x, w, cfg, b)
        assert (got - ref).norm() <= 1e-5 * ref.norm(), (got - ref).abs().max()


def _emulate_wgmma(x, w, cfg, bias=None):
    """The wgmma form transcribed to the CPU: the ring as bytes (x pieces, each warp's words, the group's scales and
    zeros, at the offsets the copies write; cp.async done at issue, and a refill never of the slot being read nor
    of the one the wgmmas still in flight read), each warp's A fragments from its own words and rows of the scales,
    B read through the descriptor as PTX defines the no-swizzle K-major canonical layout (element (k, n) of a k16
    step at start + (k / 8) LBO + (n / 8) SBO + 16 (n % 8) + 2 (k % 8)), D placed by wgmma's fragment layout (warp w:
    rows 16 w + g (+ 8), columns 8 j + 2 t (+ 1)), the split-K partials summed in split order, and the stores.
    float64 products of the kernel's bf16 operands."""
    m_rows, k = x.shape
    n, chunks, cpg = w.N, k // 64, w.group_size // 64
    tiles, bm, bn, rt, stages = n // 16, cfg.bm, cfg.bn, cfg.rt, cfg.stages
    xbytes_n, wbytes = bm * 128, rt * 4 * 512
    sbase, zbase = xbytes_n + wbytes, xbytes_n + wbytes + rt * 128
    x8 = x.contiguous().view(torch.uint8).to(torch.int64)  # [M, 2K]
    w8 = w.words.contiguous().view(torch.uint8).to(torch.int64).view(tiles, chunks, 32, 16)
    s8 = w.scales.contiguous().view(torch.uint8).to(torch.int64)  # [groups, 2N]
    z8 = None if w.zeros is None else w.zeros.contiguous().view(torch.uint8).to(torch.int64)
    lane = torch.arange(32)
    g, t = lane >> 2, lane & 3
    gx, gy, gz = tk.grid(cfg, m_rows, n)
    xpw = -(-bm * 8 // 128)
    y = torch.zeros(m_rows, n, dtype=torch.float64)

    def u32(b):  # [..., 4] bytes -> int64 little-endian words
        return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)

    for bx, by in ((a, b) for b in range(gy) for a in range(gx)):
        m0, nb = bx * bm, by * bn
        total = {}
        for bz in range(gz):
            groups = chunks // cpg
            c0, c1 = (bz * groups // cfg.split_k) * cpg, ((bz + 1) * groups // cfg.split_k) * cpg
            ring = torch.full((stages, cfg.slot()), -1, dtype=torch.int64)

            def load(s, c):
                for tid in range(128):
                    for i in range(xpw):
                        q = tid + 128 * i
                        if q >= bm * 8:
                            continue
                        mm = min(m0 + 8 * (q >> 6) + (q & 7), m_rows - 1)
                        kb = (q >> 3) & 7
                        ring[s, 16 * q:16 * q + 16] = x8[mm, 2 * (c * 64 + 8 * kb):2 * (c * 64 + 8 * kb) + 16]
                    for r in range(rt):
                        tl = by * rt * 4 + tid // 32 + 4 * r
                        p = tid + 128 * r
                        dst = xbytes_n + 16 * ((p >> 5) * 32 + (p & 3) * 8 + ((p >> 2) & 7))  # lane (g, t): 32 lt+8 t+g
                        ring[s, dst:dst + 16] = w8[min(tl, tiles - 1), c, tid % 32]
                    gi = c // cpg
                    if tid < bn // 8:
                        sp = nb + 8 * tid if nb + 8 * tid + 8 <= n else n - 8
                        ring[s, sbase + 16 * tid:sbase + 16 * tid + 16] = s8[gi, 2 * sp:2 * sp + 16]
                    if z8 is not None and tid < bn // 16:
                        zp = nb + 16 * tid if nb + 16 * tid + 16 <= n else n - 16
                        ring[s, zbase + 16 * tid:zbase + 16 * tid + 16] = z8[gi, zp:zp + 16]

            for s in range(stages - 2):
                if c0 + s < c1:
                    load(s, c0 + s)
            acc = {(wp, r): torch.zeros(32, bm // 2, dtype=torch.float64) for wp in range(4) for r in range(rt)}
            slot = 0
            for c in range(c0, c1):
                fill = slot - 2 if slot >= 2 else slot + stages - 2
                assert fill != slot and fill != (slot - 1) % stages  # not read now, nor by the wgmmas in flight
                if c + stages - 2 < c1:
                    load(fill, c + stages - 2)
                sl = ring[slot]
                for (wp, r), a_acc in acc.items():
                    nl = (r * 4 + wp) * 16 + g
                    blk = xbytes_n + 16 * ((r * 4 + wp) * 32 + g)  # lane (g, j)'s words at + 128 j, lane (g, t) reads
                    wsel = 4 * (t >> 1)  # words t / 2 and 2 + t / 2 of them
                    sc = [_bf16_pairs(sl[sbase + 2 * rows] | (sl[sbase + 2 * rows + 1] << 8))[:, 0]
                          for rows in (nl, nl + 8)]
                    if z8 is None:
                        zz = [torch.zeros(32, dtype=torch.float64)] * 2
                    else:
                        zz = [sl[zbase + rows].to(torch.uint8).view(torch.int8).double() for rows in (nl, nl + 8)]
                    for i in range(4):
                        full = torch.zeros(16, 16, dtype=torch.float64)  # the warp's A: each lane's entries
                        for reg in range(4):  # a0 / a1 from word t / 2, a2 / a3 from word 2 + t / 2; rows g, g + 8
                            at = blk + 128 * i + wsel + 8 * (reg >> 1)
                            assert (sl[at[:, None] + torch.arange(4)] >= 0).all()
                            word = u32(sl[at[:, None] + torch.arange(4)])
                            sh = 8 * (t & 1) + 4 * (reg & 1)
                            lo, hi = (word >> sh) & 15, (word >> (sh + 16)) & 15
                            s_, z_ = sc[reg & 1], zz[reg & 1]
                            vals = [((v.double() - 8 - z_) * s_).to(torch.bfloat16).double() for v in (lo, hi)]
                            row, col = g + 8 * (reg & 1), 2 * t + 8 * (reg >> 1)  # wgmma's A layout, natural k
                            full[row, col], full[row, col + 1] = vals
                        start = 256 * i
                        kk, nn = torch.arange(16)[:, None], torch.arange(bm)[None, :]
                        addr = start + (kk // 8) * tk.X_LBO + (nn // 8) * tk.X_SBO + 16 * (nn % 8) + 2 * (kk % 8)
                        bits = sl[addr] | (sl[addr + 1] << 8)
                        assert (sl[addr] >= 0).all() and (sl[addr + 1] >= 0).all()  # read only what a copy wrote
                        b = (bits.to(torch.int32) << 16).view(torch.float32).double()  # [16 k, BM]
                        d = full @ b  # [16 rows of warp wp, BM]
                        cols = 8 * torch.arange(bm // 8)[None, :] + 2 * t[:, None]  # [32, BM / 8]
                        for q, (dr, dc) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
                            a_acc[:, q::4] += d[(g + dr)[:, None], cols + dc]
                slot = 0 if slot + 1 == stages else slot + 1
            for key, v in acc.items():
                total[key] = total.get(key, 0) + v
        for (wp, r), v in total.items():
            tl = (by * rt + r) * 4 + wp
            if tl >= tiles:
                continue
            na = tl * 16 + g
            for j in range(bm // 8):
                for q, (dm, dn) in enumerate(((0, 0), (1, 0), (0, 8), (1, 8))):
                    mm = m0 + 8 * j + 2 * t + dm
                    keep = mm < m_rows
                    bb = 0.0 if bias is None else bias[na + dn].double()
                    y[mm[keep], (na + dn)[keep]] = (v[:, 4 * j + q] + bb)[keep]
    return y


@pytest.mark.parametrize("cfg,n,k,group,m,asym", [
    (tk.TileConfig(4, 1, 2, stages=3, wgmma=True), 80, 256, 64, 13, False),  # 5 row tiles: a CTA and a quarter
    (tk.TileConfig(4, 2, 3, stages=4, split_k=3, wgmma=True), 144, 768, 128, 30, True),  # BM 24, uneven splits
    (tk.TileConfig(4, 1, 1, stages=5, split_k=2, wgmma=True), 64, 512, 64, 9, True),  # x pieces fewer than threads
    (tk.TileConfig(4, 1, 4, stages=3, wgmma=True), 32, 320, 64, 40, False),  # dead row tiles inside one CTA
    (tk.TileConfig(4, 1, 20, stages=3, wgmma=True), 64, 256, 128, 170, True),  # BM 160: 10 pieces a thread
])
def test_the_wgmma_forms_index_arithmetic_computes_the_linear(cfg, n, k, group, m, asym):
    """The wgmma form's transcription over M and N tails, split-K with uneven splits, ring depths 3-5 and x chunks of
    fewer pieces than threads: within float64 rounding of the reference on the same bf16 weights."""
    _transcription_computes_the_linear(_emulate_wgmma, cfg, n, k, group, m, asym)
