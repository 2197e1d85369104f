"""kernels/w4a16_mma: the tensor-core GEMV's weight layout, checked on the CPU against an emulation of
the mma fragments written from the PTX ISA's tables (m16n8k16, .bf16: A row g / g + 8, columns
2t, 2t + 1 (+ 8); B rows 2t, 2t + 1 (+ 8), column g; D rows g / g + 8, columns 2t, 2t + 1), and the
kernel itself on the GPU against the float32 reference."""

from __future__ import annotations

import pytest
import torch

from optllm.kernels import w4a16 as w4k
from optllm.kernels import w4a16_mma as mk

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _quantized(n, k, group, asym, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    s = (0.01 + 0.02 * torch.rand(n, k // group, generator=g)).to(torch.bfloat16)
    z = torch.randint(-3, 4, (n, k // group), generator=g, dtype=torch.int8) if asym else None
    return q.to(device), s.to(device), None if z is None else z.to(device)


def test_words_round_trip():
    u = torch.randint(0, 16, (48, 192), generator=torch.Generator().manual_seed(0))
    words = mk.mma_words(u)
    assert words.shape == (3, 3, 32, 4) and words.dtype == torch.int32
    assert torch.equal(mk.mma_nibbles(words), u)
    # one nibble moved is one nibble changed
    u2 = u.clone()
    u2[17, 70] = (u2[17, 70] + 1) % 16
    assert (mk.mma_words(u2) != words).sum() == 1


def _emulate(x, w):
    """The kernel's arithmetic, fragment by fragment, in float64: for each row tile and chunk, the
    lanes' registers as the kernel forms them, placed where the PTX tables say the mma reads them."""
    m, k = x.shape
    words = w.words.to(torch.int64)
    r_tiles, chunks = words.shape[:2]
    xs = x.double()
    y = torch.zeros(m, w.N, dtype=torch.float64)
    cpg = w.group_size // mk.CHUNK
    nt = -(-m // 8)
    for r in range(r_tiles):
        acc = torch.zeros(16, 8 * nt, dtype=torch.float64)
        sx = torch.zeros(16, 8 * nt, dtype=torch.float64)
        for c in range(chunks):
            for i in range(4):
                a = torch.empty(16, 16, dtype=torch.float64)
                b = torch.empty(16, 8 * nt, dtype=torch.float64)  # NT column tiles side by side
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    wd = int(words[r, c, lane, i])
                    regs = [((128 + ((wd >> (4 * j)) & 15)), (128 + ((wd >> (4 * j + 16)) & 15))) for j in range(4)]
                    # A fragment: reg 0 = (g, 2t..), reg 1 = (g + 8, 2t..), reg 2 = (g, 2t + 8..), reg 3 = (g + 8, ..)
                    for j, (lo, hi) in enumerate(regs):
                        row, col = g + 8 * (j & 1), 2 * t + 8 * (j >> 1)
                        a[row, col], a[row, col + 1] = lo, hi
                    # B fragment of column tile j: lane t's x[16t .. 16t + 15] of row 8j + g (clamped
                    # to M - 1); regs 2i, 2i + 1
                    for j in range(nt):
                        xr = xs[min(8 * j + g, m - 1), c * 64 + 16 * t: c * 64 + 16 * t + 16]
                        col = 8 * j + g
                        b[2 * t, col], b[2 * t + 1, col] = xr[4 * i], xr[4 * i + 1]
                        b[2 * t + 8, col], b[2 * t + 9, col] = xr[4 * i + 2], xr[4 * i + 3]
                acc += a @ b
                sx += torch.ones(16, 16, dtype=torch.float64) @ b
            if (c + 1) % cpg == 0:
                grp = c // cpg
                rows = torch.arange(r * 16, r * 16 + 16)
                s = w.scales[grp, rows].double()[:, None]
                o = 136.0 + (0.0 if w.zeros is None else w.zeros[grp, rows].double()[:, None])
                part = s * (acc - o * sx)  # [16 rows, 8 columns = x rows]
                y[:, rows] += part[:, :m].t()
                acc.zero_()
                sx.zero_()
    return y


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("group,m", [(64, 1), (128, 3), (192, 8), (64, 13), (128, 32)])
def test_fragments_compute_the_linear(asym, group, m):
    n, k = 32, 192 if group != 128 else 256
    q, s, z = _quantized(n, k, group, asym, seed=group + m)
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, group, dtype=torch.bfloat16))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    ref = w4k.w4a16_linear_ref(x, q, s, z, group).double()
    got = _emulate(x, w)
    # the reference sums in float32 (about 1e-7 relative); one misplaced nibble or x pair is O(1)
    assert (got - ref).norm() <= 1e-6 * ref.norm()
    assert torch.allclose(mk.dequantize_mma(w), w4k.dequantize_w4a16(w4k.prepack_w4a16(q, s, z, group)), atol=0)


def test_from_w4a16_n_major_blocks_and_bad_shapes(monkeypatch):
    q, s, z = _quantized(80, 128, 64, True, seed=5)
    a = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, 64, dtype=torch.bfloat16))
    b = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, 64, dtype=torch.bfloat16, n_major=True))
    assert torch.equal(a.words, b.words) and torch.equal(mk.mma_nibbles(a.words), q.to(torch.int64) + 8)
    monkeypatch.setattr(mk, "_REPACK_ELEMENTS", 3 * 128)  # repacked 16 rows at a time, five blocks
    assert torch.equal(mk.from_w4a16(w4k.prepack_w4a16(q, s, z, 64, dtype=torch.bfloat16)).words, a.words)
    q, s, z = _quantized(32, 96, 32, False, seed=6)
    with pytest.raises(ValueError, match="multiple of 64"):
        mk.from_w4a16(w4k.prepack_w4a16(q, s, z, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shape must be"):
        mk.mma_words(torch.zeros(20, 64, dtype=torch.int64))
    assert not mk.mma_supported(576, 576, 64, torch.float16)
    assert mk.mma_supported(576, 576, 64, torch.bfloat16) and not mk.mma_supported(576, 576, 576 // 2, torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [mk.MmaConfig(8, 4), mk.MmaConfig(4, 2), mk.MmaConfig(16, 8), mk.MmaConfig(1, 1),
                                 mk.MmaConfig(8, 2, offset_mma=False), mk.MmaConfig(8, 4, xpre=True),
                                 mk.MmaConfig(4, 2, offset_mma=False, xpre=True),
                                 mk.MmaConfig(8, 2, offset_mma=False, persist=3),
                                 mk.MmaConfig(4, 2, offset_mma=False, xpre=True, persist=2),
                                 mk.MmaConfig(8, 4, persist=1), mk.MmaConfig(8, 2, offset_mma=False, split_k=2),
                                 mk.MmaConfig(4, 2, offset_mma=False, xpre=True, split_k=3),
                                 mk.MmaConfig(8, 4, split_k=8), mk.MmaConfig(8, 2, offset_mma=False, ring=4),
                                 mk.MmaConfig(4, 1, ring=2), mk.MmaConfig(8, 2, offset_mma=False, split_k=2, ring=6),
                                 mk.MmaConfig(16, 2, offset_mma=False, ring=2),
                                 mk.MmaConfig(4, 2, offset_mma=False, ring=16, tiles=4),
                                 mk.MmaConfig(8, 2, ring=3, tiles=8), mk.MmaConfig(8, 2, offset_mma=False, tiles=2),
                                 mk.MmaConfig(8, 4, offset_mma=False, xpre=True, tiles=4), mk.MANY_TILES_CONFIG])
@pytest.mark.parametrize("asym", [False, True])
def test_kernel_gpu(cfg, asym):
    assert mk.available(), mk._UNAVAILABLE
    assert set(mk.COMPILED_BY) == {"nvrtc"}, mk.COMPILED_BY  # torch's NVRTC, no CUDA toolkit needed
    for n, k, group in ((64, 256, 64), (960, 576, 64), (256, 1024, 128), (128, 512, 512), (48, 320, 64)):
        q, s, z = _quantized(n, k, group, asym, seed=n + k, device="cuda")
        w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, group, dtype=torch.bfloat16))
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        for m in (1, 2, 5, 8, 9, 16, 27, 32):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for b in (None, bias):
                ref = w4k.w4a16_linear_ref(x, q, s, z, group, b)
                y = mk.w4a16_mma_gemv(x, w, b, cfg)
                # fp32 sums, one bf16 rounding of y: 2^-8 relative per element at most
                assert (y.float() - ref).norm() <= 3e-3 * ref.norm(), (n, k, group, m, b is None)
                assert torch.equal(y, mk.w4a16_mma_gemv(x, w, b, cfg))  # deterministic
        # a strided x (rows of a wider buffer) reads the same
        xb = torch.randn(3, k + 64, device="cuda").to(torch.bfloat16)
        assert torch.equal(mk.w4a16_mma_gemv(xb[:, :k], w, None, cfg),
                           mk.w4a16_mma_gemv(xb[:, :k].contiguous(), w, None, cfg))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cfg", [None, mk.MmaConfig(8, 2, offset_mma=False, persist=3),
                                 mk.MmaConfig(8, 2, offset_mma=False, split_k=4),
                                 mk.MmaConfig(8, 2, offset_mma=False, ring=4),
                                 mk.MmaConfig(4, 2, offset_mma=False, ring=8, tiles=2)])
def test_kernel_gpu_graph_and_errors(cfg):
    """Replays of a captured call follow x (the persistent form's counters are back at zero after
    every call, or a replay would wait on arrivals that never come)."""
    q, s, z = _quantized(256, 512, 128, False, seed=1, device="cuda")
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, 128, dtype=torch.bfloat16))
    x = torch.randn(1, 512, device="cuda").to(torch.bfloat16)
    replays_follow_x(lambda x_: mk.w4a16_mma_gemv(x_, w, None, cfg), x)
    assert int(w.counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="1 <= M <= 32"):
        mk.w4a16_mma_gemv(torch.zeros(33, 512, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bf16"):
        mk.w4a16_mma_gemv(torch.zeros(1, 512, device="cuda"), w)


def replays_follow_x(call, x):
    """call(x) captured in a CUDA graph: after x is refilled, each replay's output equals an eager call on
    the new x and differs from the first (the tensor-core tests of this file and test_w4a16_mma_tile.py)."""
    eager = call(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(x)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device=x.device).to(x.dtype))
        graph.replay()
        assert torch.equal(out, call(x)) and not torch.equal(out, eager)


def _nvrtc():
    """libnvrtc from NVIDIA's wheel (the dev extra installs it; CI has no GPU and no CUDA toolkit)."""
    import ctypes
    from pathlib import Path

    try:
        import nvidia.cuda_nvrtc as pkg
    except ImportError:
        pytest.skip("nvidia-cuda-nvrtc-cu12 is not installed")
    libs = sorted(Path(next(iter(pkg.__path__))).glob("lib/libnvrtc.so.*"))
    if not libs:
        pytest.skip("no libnvrtc.so in nvidia-cuda-nvrtc-cu12")
    return ctypes.CDLL(str(libs[0]))


@pytest.mark.parametrize("cfg", sorted({*mk.MMA_CONFIGS.values(), mk.DEFAULT_CONFIG, mk.MANY_TILES_CONFIG,
                                        mk.MmaConfig(), mk.MmaConfig(4, 4, offset_mma=False),
                                        mk.MmaConfig(8, 2, offset_mma=False, persist=3),
                                        mk.MmaConfig(8, 2, offset_mma=False, xpre=True, persist=2),
                                        mk.MmaConfig(8, 2, offset_mma=False, split_k=4),
                                        mk.MmaConfig(8, 2, offset_mma=False, xpre=True, split_k=2),
                                        mk.MmaConfig(8, 2, offset_mma=False, ring=4), mk.MmaConfig(8, 2, ring=8),
                                        mk.MmaConfig(8, 2, offset_mma=False, split_k=2, ring=6),
                                        mk.MmaConfig(4, 2, offset_mma=False, ring=16, tiles=4),
                                        mk.MmaConfig(8, 2, offset_mma=False, tiles=2)}, key=repr))
def test_cuda_source_builds_for_hopper_without_spills(cfg, tmp_path):
    """Every variant the runtime uses, compiled on the CPU as the GPU would (NVRTC to PTX, then
    Triton's sm_90 ptxas): it builds, spills nothing, and at M <= 8 fits 3+ CTAs of its warps per SM
    (the persistent form: its grid's CTAs a SM)."""
    import re
    import subprocess
    from pathlib import Path

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's ptxas is not in this installation")
    lib = _nvrtc()
    for cpg, zeros, bias, nt in ((1, False, False, 1), (2, True, True, 1), (2, False, True, 4)):
        src = tmp_path / f"k{cpg}_{nt}.ptx"
        src.write_text(mk.nvrtc_ptx(lib, mk.cuda_source(cfg, cpg, zeros, bias, nt), "compute_90"))
        out = subprocess.run([str(ptxas), "-arch=sm_90", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
        spills = [int(v) for v in re.findall(r"(\d+) bytes spill", out)]
        assert spills and not any(spills), out
        regs = max(int(v) for v in re.findall(r"Used (\d+) registers", out))
        # at the rows the runtime sends (NT 1): 3 CTAs of WARPS warps a SM at least, the persistent
        # form's cfg.persist all resident at once (NT 4, M <= 32, is not sent yet: spills checked only)
        assert nt > 1 or regs * 32 * cfg.warps * (cfg.persist or 3) <= 65536, (cfg, nt, regs)


def _persistent_plan(tiles, gpt, warps):
    """The persistent form's index arithmetic, as the kernel writes it: warp gw's groups
    [gw * TG / W, (gw + 1) * TG / W) and, per tile, the first and last warp meeting it."""
    tg = tiles * gpt
    ranges = [(gw * tg // warps, (gw + 1) * tg // warps) for gw in range(warps)]
    lohi = []
    for tile in range(tiles):
        a, b = tile * gpt, tile * gpt + gpt
        lohi.append((-(-(a + 1) * warps // tg) - 1, -(-b * warps // tg) - 1))
    return ranges, lohi


@pytest.mark.parametrize("tiles,gpt,warps", [(1, 1, 1), (4, 4, 16), (256, 112, 3168), (1792, 32, 3168),
                                              (60, 9, 7), (3, 5, 15), (384, 32, 3168), (36, 9, 324)])
def test_persistent_split_covers_every_group_once(tiles, gpt, warps):
    """Every group belongs to exactly one warp; each tile's (lo, hi) are exactly the warps whose
    ranges meet it; a tile shared by several warps is the first or the last tile of each of them
    (two workspace slots a warp suffice), and a warp's middle tiles are its alone."""
    ranges, lohi = _persistent_plan(tiles, gpt, warps)
    owner = [None] * (tiles * gpt)
    for gw, (s0, s1) in enumerate(ranges):
        assert s1 > s0  # W <= TG: no empty range
        for grp in range(s0, s1):
            assert owner[grp] is None
            owner[grp] = gw
    assert None not in owner
    for tile, (lo, hi) in enumerate(lohi):
        meet = sorted({owner[grp] for grp in range(tile * gpt, tile * gpt + gpt)})
        assert meet == list(range(lo, hi + 1))
        if lo != hi:
            for gw in meet:
                first, last = ranges[gw][0] // gpt, (ranges[gw][1] - 1) // gpt
                assert tile in (first, last)


def test_config_for_measured_shapes_then_the_row_tiles():
    """The measured table first; an unmeasured shape gets 4 warps a row tile from MANY_TILES row tiles up
    (gate_up's 1792 and SmolLM2's LM head's 3072 ran fastest so on the H100), 8 below."""
    assert mk.config_for(28672, 4096).warps == 4  # gate_up, measured
    assert mk.config_for(6144, 4096) == mk.MmaConfig(8, 2, offset_mma=False, xpre=True)  # qkv, measured
    assert mk.config_for(49152, 576) == mk.MANY_TILES_CONFIG  # SmolLM2's LM head: 3072 row tiles
    assert mk.config_for(16 * mk.MANY_TILES, 4096) == mk.MANY_TILES_CONFIG
    assert mk.config_for(16 * mk.MANY_TILES - 16, 4096) == mk.DEFAULT_CONFIG
    assert mk.config_for(960, 576) == mk.DEFAULT_CONFIG  # SmolLM2's qkv: 60 row tiles


def test_what_the_runtime_sends_and_bad_configs():
    """fits(): the rows the runtime sends the kernel (bf16, M <= RUNTIME_MAX_M, unit stride along K,
    rows on 16-byte boundaries); anything else stays on the Triton kernels. Bad configs are refused."""
    x = torch.zeros(mk.RUNTIME_MAX_M + 1, 128, dtype=torch.bfloat16)
    assert mk.RUNTIME_MAX_M == 16 and mk.fits(x[:16]) and mk.fits(x[:9]) and mk.fits(x[:1])
    assert not mk.fits(x)  # 17 rows: more than the runtime sends
    assert not mk.fits(x[:4].float()) and not mk.fits(x[:4, None])
    assert not mk.fits(x[:4, 1:121])  # starts 2 bytes past a 16-byte boundary
    assert not mk.fits(torch.zeros(4, 130, dtype=torch.bfloat16)[:, :128])  # row stride 130: rows misaligned
    assert not mk.fits(x[:4].t().contiguous().t())  # K not the unit-stride dimension
    for bad in (dict(warps=3), dict(unroll=3), dict(persist=9), dict(split_k=0), dict(split_k=17),
                dict(split_k=2, persist=1), dict(ring=1), dict(ring=17), dict(ring=4, xpre=True),
                dict(ring=4, persist=2), dict(warps=16, ring=6), dict(ring=11), dict(tiles=3), dict(tiles=16),
                dict(tiles=2, split_k=2), dict(tiles=2, persist=1)):
        with pytest.raises(ValueError, match="allowed"):
            mk.MmaConfig(**bad)


@pytest.mark.parametrize("groups,splits,warps", [(32, 4, 8), (112, 3, 8), (4, 8, 8), (7, 2, 16), (1, 1, 1),
                                                 (224, 16, 4)])
def test_split_k_covers_every_group_once(groups, splits, warps):
    """The split-K form's index arithmetic, as the kernel writes it: CTA y of a row tile takes groups
    [y G / S, (y + 1) G / S), its warp w the run [g0 + w n / W, g0 + (w + 1) n / W) of those n; every
    group is one warp's of one split, and the workspace holds S tiles per row tile (one per split)."""
    owner = [None] * groups
    for y in range(splits):
        g0 = y * groups // splits
        n = (y + 1) * groups // splits - g0
        for w in range(warps):
            for grp in range(g0 + w * n // warps, g0 + (w + 1) * n // warps):
                assert owner[grp] is None
                owner[grp] = (y, w)
    assert None not in owner and [o[0] for o in owner] == sorted(o[0] for o in owner)  # splits in K order
    cfg = mk.MmaConfig(8, 2, split_k=splits)
    w = mk.W4A16MmaWeight(torch.zeros(3, 1, 32, 4, dtype=torch.int32), torch.zeros(1, 48), None, 48, 64, 64)
    assert mk._workspace_floats(w, cfg, 0, 2) == (splits * 3 * 256 if splits > 1 else 0)


@pytest.mark.parametrize("ring", range(2, 9))
def test_ring_schedule_reads_each_chunk_once_it_landed(ring):
    """The ring form's schedule, as the kernel writes it (RING - 1 chunks copied ahead, one commit group a
    chunk, empty ones too; the loop unrolled by RING, so chunk c is in slot (c - c0) % RING;
    cp.async.wait_group RING - 2 before it is read; chunk c + RING - 1 copied into the slot chunk c - 1
    left): every chunk of a warp's run is read from the slot its copy
    went to, after its group completed, and no copy lands on a slot whose chunk is still unread."""
    for n in range(0, 3 * ring + 2):  # the chunks of one warp's run [c0, c1)
        groups: list[list[int]] = []  # commit groups in order: the chunks copied in each
        slots: dict[int, int] = {}  # slot -> the chunk last copied into it
        read: set[int] = set()

        def copy(chunk, slot):
            assert slots.get(slot) is None or slots[slot] in read, (ring, n, chunk, slot)  # overwrites a read chunk
            slots[slot] = chunk
            return chunk

        for u in range(ring - 1):
            groups.append([copy(u, u)] if u < n else [])
        slot = 0
        for c in range(n):
            done = [x for g in groups[:max(len(groups) - (ring - 2), 0)] for x in g]  # wait_group RING - 2
            assert c in done and slots[slot] == c, (ring, n, c)
            read.add(c)
            nxt = ring - 1 if slot == 0 else slot - 1
            groups.append([copy(c + ring - 1, nxt)] if c + ring - 1 < n else [])
            slot = 0 if slot == ring - 1 else slot + 1
        assert read == set(range(n))


class _FakeDriver:
    """cuLaunchKernel as the kernels call it through ctypes, recording each launch's grid, stream and
    the argument values its argv points at (P pointers, then five ints)."""

    def __init__(self, pointers):
        self.pointers, self.launches = pointers, []

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, shm, stream, argv, extra):
        import ctypes

        p = self.pointers
        vals = [ctypes.cast(argv[i], ctypes.POINTER(ctypes.c_void_p)).contents.value or 0 for i in range(p)]
        vals += [ctypes.cast(argv[i], ctypes.POINTER(ctypes.c_int)).contents.value for i in range(p, p + 5)]
        self.launches.append((gx, gy, stream.value or 0, tuple(vals)))
        return 0


@pytest.mark.parametrize("cfg", [mk.MmaConfig(8, 2), mk.MmaConfig(8, 2, persist=2), mk.MmaConfig(4, 1, split_k=2)])
@pytest.mark.parametrize("asym,with_bias", [(False, False), (True, True)])
@pytest.mark.parametrize("explicit", [False, True])
def test_a_weights_launch_sends_every_argument(monkeypatch, cfg, asym, with_bias, explicit):
    """w4a16_mma_linear's launch, made once per weight and row-tile count (and config, when one is
    given) with the weight's pointers and sizes fixed, passes the kernel the grid, the current stream
    and every argument it reads -- the weight's words, scales, zeros (the scales' address when
    symmetric), bias or y, y, the persistent and split-K forms' workspace and counters, M, N, K and
    x's row stride -- for 1 to 16 rows; checked on the CPU through a stand-in for the driver's
    cuLaunchKernel."""
    import ctypes

    n, k, group = 256, 512, 128
    q, s, z = _quantized(n, k, group, asym, seed=5)
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, group, dtype=torch.bfloat16))
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    drivers, compiled = {}, []

    def kernel(c, cpg, has_zeros, has_bias, nt=1):
        compiled.append(c)
        la = mk._Launch.__new__(mk._Launch)
        la.pointers = 8 if c.persist or c.split_k > 1 else 6
        la.lib = drivers.setdefault(nt, _FakeDriver(la.pointers))
        la.ctypes, la.func, la.kernel, la.block = ctypes, None, None, 32 * c.warps
        return la

    monkeypatch.setattr(mk, "_kernel", kernel)
    monkeypatch.setattr(mk, "config_for", lambda n_, k_: mk.MmaConfig(16, 1) if explicit else cfg)
    monkeypatch.setattr(mk, "_SMS", {None: 3})  # the CPU device's "SMs": a persistent grid of 3 * persist
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 77, raising=False)
    x_all = torch.randn(16, k).to(torch.bfloat16)
    grid = min(3 * cfg.persist, (n // 16) * (k // group) // cfg.warps)
    for m in (1, 8, 9, 16, 1):
        x = x_all[:m]
        y = mk.w4a16_mma_linear(x, w, bias, cfg if explicit else None)
        d = drivers[(m + 7) // 8]
        gx, gy, stream, vals = d.launches[-1]
        p = d.pointers
        assert y.shape == (m, n) and stream == 77
        assert (gx, gy) == ((grid, 1) if cfg.persist else (n // 16, cfg.split_k))
        assert vals[:6] == (w.words.data_ptr(), x.data_ptr(), w.scales.data_ptr(),
                            (w.zeros if asym else w.scales).data_ptr(), (bias if with_bias else y).data_ptr(),
                            y.data_ptr())
        assert vals[p:] == (m, n, k, x.stride(0), n)
        assert p == (8 if cfg.persist or cfg.split_k > 1 else 6)
        assert p == 6 or vals[7] == w.counters.data_ptr() and vals[6] != 0
    assert set(compiled) == {cfg} and len(compiled) == 2  # one variant per row-tile count, bound once
    assert set(w.calls) == {(1, with_bias, cfg if explicit else None), (2, with_bias, cfg if explicit else None)}
    # prepare() (at load) binds the launches of every row-tile count the runtime sends: no first-call work
    w2 = mk.from_w4a16(w4k.prepack_w4a16(q, s, z, group, dtype=torch.bfloat16))
    mk.prepare(w2, with_bias, cfg if explicit else None)
    assert set(w2.calls) == set(w.calls) and len(compiled) == 4
    for m in (1, 16):
        mk.w4a16_mma_linear(x_all[:m], w2, bias, cfg if explicit else None)
        assert drivers[(m + 7) // 8].launches[-1][3][0] == w2.words.data_ptr()
    assert len(compiled) == 4
