"""W4A16 decode GEMV on the tensor cores: hand-written CUDA, compiled at first use through NVRTC.

    y [M, N] = x [M, K] @ W^T,   W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G],   M = 1..32

Why: the Triton GEMV (kernels/w4a16.py) spends about 22 instructions per 32-bit word of weights
(eight products and their sums on the CUDA cores, docs/BENCHMARKS.md "GEMV instruction budget"),
close to the ~31 a word the H200 allows at its memory floor, and runs at 46-58% of that floor.
Here the products go to the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate) with the
weight tile as the MMA's A operand (its 16 rows are 16 output features, "swap-AB") and the x rows
as its 8 columns (M > 8: NT = ceil(M / 8) mmas share each dequantized fragment). A word costs 4 lop3
+ 3 shifts + NT mma, about 10 instructions at M <= 8.

Weight layout (``mma_words``, built once at load from the checkpoint's nibbles)
    int32 [N / 16, K / 64, 32, 4]: row tile r (16 features), k64 chunk c, lane L, word i. Lane
    L = 4 g + t holds, in word i, the eight nibbles of its A fragment for the chunk's i-th mma:
    register j (0..3) of the fragment is ``lop3(word >> 4 j, 0x000F000F, 0x43004300)``: nibble j
    in the low half, nibble j + 4 in the high half, each or-ed into the mantissa of the bf16 128.
    Fragment register j is row g + 8 (j & 1) of the tile, and it pairs with x at
    k = 64 c + 16 t + 4 i + 2 (j >> 1) + (half). That k order is a permutation of the chunk, the
    same on the x side: lane t's B fragments for all four mmas are x[16 t .. 16 t + 15], two
    16-byte loads. A warp reads one chunk of one row tile as 512 contiguous bytes, 16 per lane.
Arithmetic (per quantization group, G a multiple of 64)
    the mma sums (128 + u) x over the group exactly in fp32 (u = q + 8, products of bf16 are exact);
    a second mma with an all-ones A gives sum(x) over the group at no dequantization cost; then
    y += scale * (acc - (136 + zero) * sum(x)). The weight is never rounded to bf16: y is the float32
    value of sum((q - zero) scale x) up to fp32 summation order, rounded once to bf16 at the end.
Work split
    one CTA of WARPS warps per row tile; the warps take contiguous runs of groups (split-K inside
    the CTA), each prefetching UNROLL chunks ahead; their partials are summed in warp order through
    shared memory (deterministic), bias added, one bf16 store per output. No workspace, no atomics,
    no host sync: CUDA-graph safe.

Limits: bf16 activations, N % 16 == 0, K % 64 == 0, G % 64 == 0 (G = K allowed when K % 64 == 0),
M <= 32 (the runtime sends M <= 16: at 32 it lost to the Triton path on some shapes, H200).
Everything else (and the CPU, where nothing is compiled) stays on kernels/w4a16.py. A persistent
form (MmaConfig.persist) streams a contiguous range of the weights per warp instead of one CTA per
row tile. A split-K form (MmaConfig.split_k = S) gives each row tile S CTAs, each over a contiguous
1/S of the groups, for shapes whose N / 16 tiles leave SMs idle (o and down of the 8B model: 256
CTAs on 132 SMs, 0.6 waves and 24% occupancy in Nsight Compute on the H100); the S partial tiles
meet in a workspace and the last CTA to arrive sums them in split order (deterministic); on the H100
it lost to the plain form on every 8B shape (twenty-seventh session). A ring form (MmaConfig.ring = R)
streams each warp's chunks through R slots of shared memory filled by cp.async R - 1 chunks ahead, for
gate_up, which Nsight Compute found latency-bound (52% of stalls on L1TEX scoreboard, two chunks in
flight a warp in registers at 56 registers and 50% occupancy): more bytes in flight, 40 registers, 66%
occupancy. Under Nsight Compute's locked clocks it moved gate_up from 59% to 63% of DRAM throughput at
the same instruction count, but in CUDA-graph replays it only tied the register form on gate_up (R = 3)
and lost elsewhere (H100, twenty-seventh session): neither is in MMA_CONFIGS. Since the thirty-ninth
session the ring also carries each group's scales and zeros (no dependent global load a group); it still
lost in replays. MmaConfig.tiles = T puts T row tiles in a CTA, warps / T warps each: what decides is the
warps a tile, and gate_up (1792 row tiles) runs fastest with 4 (-6% at M = 1 and 8, -10% at M = 16 against
8, H100), the shapes of 256-384 row tiles with 8.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from .w4a16 import _K_NIBBLE, W4A16Weight

MAX_M = 32  # the kernel: M <= 8 NT, NT column tiles of 8 x rows sharing each dequantized fragment
RUNTIME_MAX_M = 16  # rows the runtime sends it: ahead of the Triton path on the H200 up to 16 (22nd session)
CHUNK = 64  # k per chunk: four m16n8k16 mmas, one 16-byte weight load per lane
_REPACK_ELEMENTS = 1 << 24  # weights repacked at once at load (int64 temporaries: 128 MiB each)


@dataclass(frozen=True)
class MmaConfig:
    warps: int = 8  # warps per CTA (the CTA's split of K)
    unroll: int = 4  # chunks a warp loads ahead
    offset_mma: bool = True  # sum(x) from an all-ones mma (else: u - 8 - zero formed before the mma)
    xpre: bool = False  # x loaded with the weights, unroll chunks ahead
    ablate: bool = False  # timing only: no dequantization (wrong numbers)
    persist: int = 0  # CTAs per SM of the persistent form (0: one CTA per 16-row tile)
    split_k: int = 1  # CTAs per row tile of the per-tile form, each over 1/split_k of the groups
    # the per-tile form's weights through a ring of `ring` chunk slots per warp in shared memory, filled
    # by cp.async ring - 1 chunks ahead (0: registers, unroll chunks ahead); x then loads at compute time
    ring: int = 0
    # row tiles per CTA of the per-tile form, warps / tiles warps each (longer runs for fewer warps a tile)
    tiles: int = 1

    def __post_init__(self) -> None:
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"warps={self.warps}: allowed 1, 2, 4, 8, 16")
        if self.unroll not in (1, 2, 4, 8):
            raise ValueError(f"unroll={self.unroll}: allowed 1, 2, 4, 8")
        if self.persist not in range(9):
            raise ValueError(f"persist={self.persist}: allowed 0 (one CTA per row tile) to 8 CTAs per SM")
        if self.split_k not in range(1, 17) or (self.split_k > 1 and self.persist):
            raise ValueError(f"split_k={self.split_k}: allowed 1..16, and 1 with the persistent form")
        # static shared memory: the ring's slots (512 bytes of words and 48 of scales and zeros, a warp), at
        # least four of words (the NT <= 4 partial goes there after the run)
        if self.ring and (self.ring not in range(2, 17) or self.persist or self.xpre
                          or self.warps * (max(self.ring, 4) * 512 + self.ring * 48) > 49152):
            raise ValueError(f"ring={self.ring}: allowed 0, or 2..16 slots with warps * (512 max(ring, 4) + 48 ring) "
                             "<= 49152 (48 KiB of shared memory), without the persistent form or xpre")
        if self.tiles not in (1, 2, 4, 8, 16) or self.warps % self.tiles or (self.tiles > 1 and (
                self.persist or self.split_k > 1)):
            raise ValueError(f"tiles={self.tiles}: allowed 1, 2, 4, 8, 16 dividing warps={self.warps}, and 1 with the "
                             "persistent or split-K forms")


@dataclass(frozen=True)
class W4A16MmaWeight:
    """words int32 [N / 16, K / 64, 32, 4] (module docstring); scales bf16 [K / G, N]; zeros int8
    [K / G, N] or None (symmetric); counters int32 [N / 16], zero between calls (the persistent and
    split-K forms' per-tile arrivals; one weight must not run on two streams at once)."""

    words: torch.Tensor
    scales: torch.Tensor
    zeros: Optional[torch.Tensor]
    N: int
    K: int
    group_size: int
    counters: Optional[torch.Tensor] = None
    # this weight's launches (w4a16_mma_linear), by (row tiles, bias or not, config or None): made on
    # first use, its own pointers and sizes set once (not an argument: dataclasses.replace starts anew)
    calls: dict = field(default_factory=dict, init=False, compare=False, repr=False)


def mma_supported(n: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and n % 16 == 0 and k % CHUNK == 0 and group_size % CHUNK == 0 \
        and k % group_size == 0


def _fragment_index(device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (lane, word i, nibble p): the row inside the 16-row tile and the k inside the
    64-k chunk that nibble holds, [32, 4, 8] each."""
    lane = torch.arange(32, device=device)[:, None, None]
    i = torch.arange(4, device=device)[None, :, None]
    p = torch.arange(8, device=device)[None, None, :]
    j, half = p % 4, p // 4
    row = (lane >> 2) + 8 * (j % 2)
    kk = 16 * (lane & 3) + 4 * i + 2 * (j // 2) + half
    return row.expand(32, 4, 8), kk.expand(32, 4, 8)


def mma_words(u: torch.Tensor) -> torch.Tensor:
    """Nibbles u [N, K] (integers 0..15) -> the kernel's words int32 [N / 16, K / 64, 32, 4]."""
    n, k = u.shape
    if n % 16 or k % CHUNK:
        raise ValueError(f"u: shape must be [16 a, 64 b], got {tuple(u.shape)}")
    row, kk = _fragment_index(u.device)
    tiles = u.to(torch.int64).view(n // 16, 16, k // CHUNK, CHUNK).permute(0, 2, 1, 3)  # [R, C, 16, 64]
    vals = tiles[:, :, row, kk]  # [R, C, 32, 4, 8]
    shifts = 4 * torch.arange(8, device=u.device, dtype=torch.int64)
    words = (vals << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def mma_nibbles(words: torch.Tensor) -> torch.Tensor:
    """The inverse of mma_words: words [N / 16, K / 64, 32, 4] -> u int64 [N, K]."""
    r, c = words.shape[:2]
    row, kk = _fragment_index(words.device)
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int64)
    vals = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 15  # [R, C, 32, 4, 8]
    tiles = torch.empty(r, c, 16, CHUNK, dtype=torch.int64, device=words.device)
    tiles[:, :, row, kk] = vals
    return tiles.permute(0, 2, 1, 3).reshape(r * 16, c * CHUNK)


def from_w4a16(w: W4A16Weight) -> W4A16MmaWeight:
    """The kernel's weight from the Triton kernels' prepacked one (same values, scales, zeros)."""
    if not mma_supported(w.N, w.K, w.group_size, w.scales.dtype):
        raise ValueError(f"W4A16 weight N={w.N} K={w.K} group {w.group_size} scales {w.scales.dtype}: the "
                         "tensor-core GEMV needs N % 16 == 0, K and the group a multiple of 64, bf16 scales")
    words = w.packed.t() if w.n_major else w.packed
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    out = torch.empty(w.N // 16, w.K // CHUNK, 32, 4, dtype=torch.int32, device=words.device)
    rows = max(16, (_REPACK_ELEMENTS // w.K) // 16 * 16)  # bounded temporaries: ~16 bytes a weight of a block
    for r0 in range(0, w.N, rows):
        block = words[r0:r0 + rows]
        u = ((block.unsqueeze(-1) >> shifts) & 15)[:, :, _K_NIBBLE].reshape(block.shape[0], w.K)
        out[r0 // 16:(r0 + block.shape[0]) // 16] = mma_words(u)
    return W4A16MmaWeight(out, w.scales.contiguous(), None if w.zeros is None else w.zeros.contiguous(),
                          w.N, w.K, w.group_size, torch.zeros(w.N // 16, dtype=torch.int32, device=words.device))


def dequantize_mma(w: W4A16MmaWeight) -> torch.Tensor:
    """float32 [N, K]: (u - 8 - zero) * scale, from the kernel's own words (a torch reference)."""
    u = mma_nibbles(w.words).float()
    z = 0.0 if w.zeros is None else w.zeros.t().float().repeat_interleave(w.group_size, dim=1)
    return (u - 8.0 - z) * w.scales.t().float().repeat_interleave(w.group_size, dim=1)


def w4a16_mma_ref(x: torch.Tensor, w: W4A16MmaWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    y = x.float() @ dequantize_mma(w).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


# what both kernels of this file and kernels/w4a16_mma_tile.py build on: the 16-byte word W4, global,
# shared and cp.async loads, the nibble pairs (ABLATE: the raw words), the mma, bf16 conversions
COMMON_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
struct __align__(16) W4 { u32 a, b, c, d; };

__device__ __forceinline__ W4 ld_stream(const W4* p) {
  W4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
  return v;
}
__device__ __forceinline__ W4 ld_cached(const W4* p) {
  W4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "l"(p));
  return v;
}
// cp.async: 16 bytes global -> shared through L2 only; a commit per chunk; wait until at most N are pending
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 s;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
  return s;
}
__device__ __forceinline__ void cp_async16(u32 s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s), "l"(g) : "memory");
}
__device__ __forceinline__ W4 ld_shared(u32 s) {
  W4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.a), "=r"(v.b), "=r"(v.c), "=r"(v.d) : "r"(s) : "memory");
  return v;
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 pair(u32 w) {  // nibbles j, j + 4 (bits 0-3, 16-19) -> bf16x2 128 + u
#if ABLATE
  return w;
#else
  u32 r;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(r) : "r"(w));
  return r;
#endif
}
__device__ __forceinline__ u32 pair_sub(u32 w, u32 nz) {  // (128 + u) - (136 + zero): exact in bf16
#if ABLATE
  return w;
#else
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(pair(w)), "r"(0x3F803F80u), "r"(nz));
  return r;
#endif
}
__device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float bf16f(u16 v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ u16 f2bf(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}
__device__ __forceinline__ u32 neg_pair(float o) {  // -o as bf16x2 (o = 136 + zero: exact)
  const u32 h = f2bf(-o);
  return h | (h << 16);
}
"""

_SOURCE = COMMON_SOURCE + r"""
// OFFSET_MMA 1: the weights enter the mma as 128 + u and sum(x) comes from a second mma with an
// all-ones A; 0: each nibble pair is brought to u - 8 - zero (one exact bf16x2 fma) before its mma.
// XPRE 1 (NT == 1 only): the x pairs of a chunk are loaded with its weights, UNROLL chunks ahead.
// ABLATE 1 (timing only, wrong numbers): the raw words are the A operand, no dequantization.
// NT: x column tiles of 8 rows (M <= 8 NT); each dequantized fragment feeds NT mmas.
struct Chunk { W4 w;
#if XPRE
  W4 xa, xb;
#endif
};
// A chunk's weight words (w: this lane's 16 bytes of it) and, with XPRE, its x pairs (chunk-in-tile
// c of the first column tile's rows).
__device__ __forceinline__ void load_chunk(Chunk& ch, const W4* w, const W4* x0, int c) {
  ch.w = ld_stream(w);
#if XPRE
  ch.xa = ld_cached(x0 + (size_t)c * 8);
  ch.xb = ld_cached(x0 + (size_t)c * 8 + 1);
#endif
}
// One word's A fragment: registers j = 0..3 are nibble pairs (j, j + 4) of word >> 4j; rows g, g + 8,
// g, g + 8.
__device__ __forceinline__ void fragment(u32* a, u32 w, u32 nz0, u32 nz1) {
#if OFFSET_MMA
  a[0] = pair(w); a[1] = pair(w >> 4); a[2] = pair(w >> 8); a[3] = pair(w >> 12);
#else
  a[0] = pair_sub(w, nz0); a[1] = pair_sub(w >> 4, nz1); a[2] = pair_sub(w >> 8, nz0); a[3] = pair_sub(w >> 12, nz1);
#endif
}

// What a warp holds while it walks its chunks: the group's sums, sum(x) (OFFSET_MMA), the running
// y of its current tile, the group's scales and offsets; one column tile of 8 x rows per j.
struct State {
  float acc[NT][4], sx[NT][4], yv[NT][4];
  float s0, s1, o0, o1;
  u32 nz0, nz1;
};
__device__ __forceinline__ void state_init(State& st) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) { st.acc[j][q] = 0.f; st.sx[j][q] = 0.f; st.yv[j][q] = 0.f; }
  st.s0 = st.s1 = 0.f;
  st.o0 = st.o1 = 136.f;
  st.nz0 = st.nz1 = neg_pair(136.f);
}
// A group starts at chunk c (c % CPG == 0): its scales (and zeros) of rows n0, n1, loaded while its chunks
// compute (group_global), or read from the 48 bytes the ring form copied with the chunk (group_shared: the
// tile's 16 scales, then its 16 zeros; g the lane's row in the tile).
__device__ __forceinline__ void group_zeros(State& st, float z0, float z1) {
#if HAS_ZEROS
  st.o0 = 136.f + z0;
  st.o1 = 136.f + z1;
  st.nz0 = neg_pair(st.o0);
  st.nz1 = neg_pair(st.o1);
#endif
}
__device__ __forceinline__ void group_global(State& st, int c, int n0, int n1, int N, const u16* __restrict__ scales,
                                             const signed char* __restrict__ zeros) {
  const size_t gi = (size_t)(c / CPG) * N;
  st.s0 = bf16f(scales[gi + n0]);
  st.s1 = bf16f(scales[gi + n1]);
#if HAS_ZEROS
  group_zeros(st, (float)zeros[gi + n0], (float)zeros[gi + n1]);
#endif
}
__device__ __forceinline__ void group_shared(State& st, const W4* slot, int g) {
  const u16* sp = (const u16*)slot;
  st.s0 = bf16f(sp[g]);
  st.s1 = bf16f(sp[g + 8]);
#if HAS_ZEROS
  const signed char* zp = (const signed char*)(slot + 2);
  group_zeros(st, (float)zp[g], (float)zp[g + 8]);
#endif
}
// Chunk c (0 .. K / 64 - 1) of the tile whose rows g, g + 8 are n0, n1 (its group's scales already in st when
// c starts one): four words, then the group's end.
__device__ __forceinline__ void chunk_step(State& st, const Chunk& ch, const W4* const* xp, int c) {
  u32 a[4][4];
  fragment(a[0], ch.w.a, st.nz0, st.nz1);
  fragment(a[1], ch.w.b, st.nz0, st.nz1);
  fragment(a[2], ch.w.c, st.nz0, st.nz1);
  fragment(a[3], ch.w.d, st.nz0, st.nz1);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#if XPRE
    const W4 xa = ch.xa, xb = ch.xb;
#else
    const W4 xa = ld_cached(xp[j] + (size_t)c * 8), xb = ld_cached(xp[j] + (size_t)c * 8 + 1);
#endif
    mma(st.acc[j], a[0], xa.a, xa.b);
    mma(st.acc[j], a[1], xa.c, xa.d);
    mma(st.acc[j], a[2], xb.a, xb.b);
    mma(st.acc[j], a[3], xb.c, xb.d);
#if OFFSET_MMA
    const u32 one[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};
    mma(st.sx[j], one, xa.a, xa.b);
    mma(st.sx[j], one, xa.c, xa.d);
    mma(st.sx[j], one, xb.a, xb.b);
    mma(st.sx[j], one, xb.c, xb.d);
#endif
  }
  if ((c + 1) % CPG == 0) {  // the group ends: scale it into the running sums
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#if OFFSET_MMA
      st.yv[j][0] += st.s0 * (st.acc[j][0] - st.o0 * st.sx[j][0]);
      st.yv[j][1] += st.s0 * (st.acc[j][1] - st.o0 * st.sx[j][1]);
      st.yv[j][2] += st.s1 * (st.acc[j][2] - st.o1 * st.sx[j][2]);
      st.yv[j][3] += st.s1 * (st.acc[j][3] - st.o1 * st.sx[j][3]);
#else
      st.yv[j][0] += st.s0 * st.acc[j][0];
      st.yv[j][1] += st.s0 * st.acc[j][1];
      st.yv[j][2] += st.s1 * st.acc[j][2];
      st.yv[j][3] += st.s1 * st.acc[j][3];
#endif
#pragma unroll
      for (int q = 0; q < 4; ++q) { st.acc[j][q] = 0.f; st.sx[j][q] = 0.f; }
    }
  }
}
// y for one lane's accumulator entries: column tile j's (row g, m 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
__device__ __forceinline__ void store_y(u16* y, const u16* bias, const float (*v)[4], int n0, int n1, int t, int M,
                                        int ldy) {
  float b0 = 0.f, b1 = 0.f;
#if HAS_BIAS
  b0 = bf16f(bias[n0]);
  b1 = bf16f(bias[n1]);
#endif
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int m0 = 8 * j + 2 * t, m1 = m0 + 1;
    if (m0 < M) { y[(size_t)m0 * ldy + n0] = f2bf(v[j][0] + b0); y[(size_t)m0 * ldy + n1] = f2bf(v[j][2] + b1); }
    if (m1 < M) { y[(size_t)m1 * ldy + n0] = f2bf(v[j][1] + b0); y[(size_t)m1 * ldy + n1] = f2bf(v[j][3] + b1); }
  }
}
// Partial tiles across CTAs or warps (the split-K and persistent forms): publish writes a warp's partial
// v (its lane's 4 NT floats at `mine`) and counts the warp's arrival at its tile's counter, returning
// how many had arrived before it; the last to arrive fences and sums every partial with add_partial
// (through L2, ld_cg) in a fixed order, then resets the counter.
__device__ __forceinline__ int publish(float* mine, const float (*v)[4], int* counter, int lane) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) mine[4 * j + q] = v[j][q];
  __threadfence();
  __syncwarp();
  int old = 0;
  if (lane == 0) old = atomicAdd(counter, 1);
  return __shfl_sync(0xffffffffu, old, 0);
}
__device__ __forceinline__ void add_partial(float (*v)[4], const float* p) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) v[j][q] += ld_cg(p + 4 * j + q);
}
__device__ __forceinline__ void x_rows(const W4** xp, const u16* x, int g, int t, int M, int ldx) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int row = 8 * j + g < M ? 8 * j + g : M - 1;  // columns past M: a copy of the last row, not stored
    xp[j] = (const W4*)(x + (size_t)row * ldx) + 2 * t;
  }
}

#if !PERSIST
// TPC row tiles per CTA, WPT = WARPS / TPC warps per tile (SPLITK > 1: TPC 1 and SPLITK CTAs per tile,
// blockIdx.y taking groups [y G / S, (y + 1) G / S)); a tile's warps take contiguous runs of those groups,
// prefetch UNROLL chunks ahead (or RING - 1 through shared memory), and sum their partials in warp order
// through shared memory. Split: warp 0 of each CTA writes its partial tile to the workspace
// ws [S][tiles][32][4 NT]; the last of the tile's S CTAs to arrive (the counter, which it resets) sums the
// S partials in split order and stores y.
#define WPT (WARPS / TPC)
#if RING
// each lane copies its 16 bytes of chunk c into slot (c - c0) % RING of its warp's ring, and lanes 0-2 the
// tile's 32 bytes of scales and 16 of zeros beside it when c starts a group; a lane reads back its own 16
// bytes (its cp.async.wait_group orders those) and every lane the group's scales (after __syncwarp, which
// orders lanes 0-2's completed copies before the other lanes' reads). After the run a warp's partial goes
// into its own ring (RING_SLOTS >= 4 slots: 2 KiB, the NT <= 4 partial), read by the tile's first warp.
#define RING_SLOTS (RING < 4 ? 4 : RING)
#define RED(w, l, i) (((float*)&ring[w][0][0])[(l) * (4 * NT) + (i)])
__device__ __forceinline__ void copy_chunk(u32 wslot, u32 sslot, const W4* wsrc, int c, int lane, int tile, int N,
                                           const u16* __restrict__ scales, const signed char* __restrict__ zeros) {
  cp_async16(wslot, wsrc);
  if (c % CPG == 0 && lane < 2 + HAS_ZEROS) {
    const size_t gi = (size_t)(c / CPG) * N + (size_t)tile * 16;
    cp_async16(sslot + 16 * lane, lane < 2 ? (const void*)(scales + gi + 8 * lane) : (const void*)(zeros + gi));
  }
}
#else
#define RED(w, l, i) (red[w][l][i])
#endif
extern "C" __global__ void __launch_bounds__(WARPS * 32)
w4a16_mma_gemv(const W4* __restrict__ wq, const u16* __restrict__ x, const u16* __restrict__ scales,
               const signed char* __restrict__ zeros, const u16* __restrict__ bias, u16* __restrict__ y,
#if SPLITK > 1
               float* __restrict__ ws, int* __restrict__ cnt,
#endif
               int M, int N, int K, int ldx, int ldy) {
#if RING
  __shared__ W4 ring[WARPS][RING_SLOTS][32];
  __shared__ W4 sring[WARPS][RING][3];
#else
  __shared__ float red[WARPS][32][NT * 4];
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = K >> 6;
#if TPC == 1
  const int wit = warp, tile = blockIdx.x;
  const bool live = true;
#else
  const int wit = warp % WPT, tile = blockIdx.x * TPC + warp / WPT;
  const bool live = tile < (N >> 4);  // the grid's last CTA may hold fewer than TPC tiles
#endif
#if SPLITK > 1
  const int all = chunks / CPG, g0 = (blockIdx.y * all) / SPLITK, groups = ((blockIdx.y + 1) * all) / SPLITK - g0;
#else
  const int g0 = 0, groups = chunks / CPG;
#endif
  const int c0 = (g0 + (wit * groups) / WPT) * CPG, c1 = live ? (g0 + ((wit + 1) * groups) / WPT) * CPG : c0;
  const W4* wp = wq + (size_t)tile * chunks * 32 + lane;
  const W4* xp[NT];
  x_rows(xp, x, g, t, M, ldx);
  const int n0 = tile * 16 + g, n1 = n0 + 8;
  State st;
  state_init(st);
#if RING
  const u32 my = smem_addr(&ring[warp][0][lane]);  // slot s at my + 512 s
  const u32 ms = smem_addr(&sring[warp][0][0]);  // slot s's scales at ms + 48 s
#pragma unroll
  for (int u = 0; u < RING - 1; ++u) {
    if (c0 + u < c1) copy_chunk(my + 512 * u, ms + 48 * u, wp + (size_t)(c0 + u) * 32, c0 + u, lane, tile, N, scales,
                                zeros);
    cp_commit();
  }
  // unrolled by RING: chunk cb + u is in slot u, chunk cb + u + RING - 1 goes to slot (u + RING - 1) % RING
  for (int cb = c0; cb < c1; cb += RING) {
#pragma unroll
    for (int u = 0; u < RING; ++u) {
      const int c = cb + u;
      if (c < c1) {
        cp_wait<RING - 2>();  // chunk c's group is done (one group committed per chunk, empty ones too)
        __syncwarp();  // lanes 0-2's scales of chunk c landed; every lane is done with chunk c - 1's slot
        Chunk ch;
        ch.w = ld_shared(my + 512 * u);
        if (c % CPG == 0) group_shared(st, &sring[warp][u][0], g);
        if (c + RING - 1 < c1)
          copy_chunk(my + 512 * ((u + RING - 1) % RING), ms + 48 * ((u + RING - 1) % RING),
                     wp + (size_t)(c + RING - 1) * 32, c + RING - 1, lane, tile, N, scales, zeros);
        cp_commit();
        chunk_step(st, ch, xp, c);
      }
    }
  }
  cp_wait<0>();  // (empty groups only by now) the ring is free for the partials
  __syncwarp();
#else
  Chunk buf[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
    if (c0 + u < c1) load_chunk(buf[u], wp + (size_t)(c0 + u) * 32, xp[0], c0 + u);
  for (int cb = c0; cb < c1; cb += UNROLL) {
    Chunk cur[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) cur[u] = buf[u];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (cb + UNROLL + u < c1) load_chunk(buf[u], wp + (size_t)(cb + UNROLL + u) * 32, xp[0], cb + UNROLL + u);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (cb + u < c1) {
        if ((cb + u) % CPG == 0) group_global(st, cb + u, n0, n1, N, scales, zeros);
        chunk_step(st, cur[u], xp, cb + u);
      }
  }
#endif
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) RED(warp, lane, 4 * j + q) = st.yv[j][q];
  __syncthreads();
  if (wit == 0 && live) {  // the tile's first warp sums its WPT warps' partials in order
    float v[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) v[j][q] = 0.f;
    for (int w = warp; w < warp + WPT; ++w)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) v[j][q] += RED(w, lane, 4 * j + q);
#if SPLITK > 1
    const size_t tiles = gridDim.x;
    float* mine = ws + (((size_t)blockIdx.y * tiles + tile) * 32 + lane) * (4 * NT);
    if (publish(mine, v, cnt + tile, lane) != SPLITK - 1) return;  // not the last of the tile's CTAs
    __threadfence();
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) v[j][q] = 0.f;
    for (int s = 0; s < SPLITK; ++s) add_partial(v, ws + (((size_t)s * tiles + tile) * 32 + lane) * (4 * NT));
    if (lane == 0) cnt[tile] = 0;
#endif
    store_y(y, bias, v, n0, n1, t, M, ldy);
  }
}
#else
// The persistent form: gridDim.x * WARPS warps in all (W <= R * GPT, the groups), warp gw streams
// the groups [gw * TG / W, (gw + 1) * TG / W) of the flattened (tile, group) order, which is the
// weights' memory order, with its prefetch carried across tile boundaries. A tile that one warp
// covers alone is written directly; a tile shared by warps lo..hi gets their partials through the
// workspace (slot 0: the warp's first tile, 1: its last), and the last to arrive (a per-tile
// counter, reset by it) sums them in warp order: deterministic, no CTA-wide barrier, no spin.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
w4a16_mma_gemv_persist(const W4* __restrict__ wq, const u16* __restrict__ x, const u16* __restrict__ scales,
                       const signed char* __restrict__ zeros, const u16* __restrict__ bias, u16* __restrict__ y,
                       float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int K, int ldx, int ldy) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int C = K >> 6, GPT = C / CPG;
  const long long TG = (long long)(N >> 4) * GPT;
  const long long W = (long long)gridDim.x * WARPS;
  const long long gw = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
  const long long f0 = (gw * TG / W) * CPG, f1 = ((gw + 1) * TG / W) * CPG;  // my chunks, flattened
  const W4* wp = wq + lane;
  const W4* xp[NT];
  x_rows(xp, x, g, t, M, ldx);
  int tile = (int)(f0 / C), c = (int)(f0 % C);  // the next chunk to compute
  const int first_tile = tile;
  int lc = c;  // the chunk-in-tile of the next chunk to load
  State st;
  state_init(st);
  Chunk buf[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
    if (f0 + u < f1) {
      load_chunk(buf[u], wp + (f0 + u) * 32, xp[0], lc);
      lc = lc + 1 == C ? 0 : lc + 1;
    }
  for (long long fb = f0; fb < f1; fb += UNROLL) {
    Chunk cur[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) cur[u] = buf[u];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (fb + UNROLL + u < f1) {
        load_chunk(buf[u], wp + (fb + UNROLL + u) * 32, xp[0], lc);
        lc = lc + 1 == C ? 0 : lc + 1;
      }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (fb + u < f1) {
        const int n0 = tile * 16 + g, n1 = n0 + 8;
        if (c % CPG == 0) group_global(st, c, n0, n1, N, scales, zeros);
        chunk_step(st, cur[u], xp, c);
        if (c + 1 == C || fb + u + 1 == f1) {  // the tile, or my range, ends: flush this tile
          const long long a = (long long)tile * GPT, b = a + GPT;
          const int lo = (int)(((a + 1) * W + TG - 1) / TG) - 1, hi = (int)((b * W + TG - 1) / TG) - 1;
          if (lo == hi) {
            store_y(y, bias, st.yv, n0, n1, t, M, ldy);
          } else {
            float* mine = ws + ((gw * 2 + (tile == first_tile ? 0 : 1)) * 32 + lane) * (4 * NT);
            if (publish(mine, st.yv, cnt + tile, lane) == hi - lo) {  // the last of hi - lo + 1: sum all in warp order
              __threadfence();
              float v[NT][4];
#pragma unroll
              for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) v[j][q] = 0.f;
              for (int k = lo; k <= hi; ++k) {
                const int fk = (int)(((long long)k * TG / W) / GPT);
                add_partial(v, ws + (((long long)k * 2 + (tile == fk ? 0 : 1)) * 32 + lane) * (4 * NT));
              }
              store_y(y, bias, v, n0, n1, t, M, ldy);
              if (lane == 0) cnt[tile] = 0;
            }
          }
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) st.yv[j][q] = 0.f;
        }
        if (++c == C) { c = 0; ++tile; }
      }
    }
  }
}
#endif
"""

_KERNELS: dict = {}
_UNAVAILABLE: list = []  # the reason NVRTC could not build the kernel, once known
COMPILED_BY: list = []  # how each variant was built: "nvrtc", or the fallback and why


class _Launch:
    """One compiled variant: its function, block size, dynamic shared memory and argument layout
    (``pointers`` pointers, then five ints); ``bound`` makes a weight's launches of it (torch's
    _CudaKernel.__call__ builds the ctypes arguments anew each call, tens of µs of host time). The
    GEMV's and kernels/w4a16_mma_tile.py's tiles' (``name``) alike."""

    smem = 0  # dynamic shared memory a CTA, bytes (the tiles' x ring; the GEMV has none)
    name = "w4a16_mma_gemv"  # the kernel, for errors (both also the defaults of stand-ins made without __init__)

    def __init__(self, kernel, warps: int, pointers: int, smem: int = 0, name: str = "w4a16_mma_gemv") -> None:
        import ctypes

        from torch.cuda._utils import _get_gpu_runtime_library

        self.lib = _get_gpu_runtime_library()
        self.ctypes = ctypes  # a stream handle goes as a pointer, not as ctypes' default 32-bit int
        self.func = kernel.func
        self.kernel = kernel  # keeps its module loaded
        self.block = 32 * warps
        self.pointers = pointers
        self.smem, self.name = smem, name
        if smem > 48 * 1024:  # past the default limit: opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
            err = self.lib.cuFuncSetAttribute(self.func, 8, smem)
            if err != 0:
                raise RuntimeError(f"{name}: cuFuncSetAttribute({smem} bytes) failed with CUDA error {err}")

    def bound(self, grid: int, grid_y: int, fixed: dict[int, int], grid_z: int = 1) -> _Bound:
        """This variant's launches for one weight (``_Bound``): fixed, slot index -> value."""
        return _Bound(self, grid, grid_y, fixed, grid_z)


class _Bound:
    """One weight's launches of a variant, with argument slots of its own: the weight's pointers and
    sizes (and the grid) set once, so a call sets five values -- x, bias or y, y, M and x's row
    stride -- and launches (setting all eleven to thirteen each call, after the config, grid and
    workspace lookups, cost 3.8 µs of Python a call on the CPU with a no-op launch; this, 2.3)."""

    def __init__(self, launch: _Launch, grid: int, grid_y: int, fixed: dict[int, int], grid_z: int = 1) -> None:
        ctypes, p = launch.ctypes, launch.pointers
        self.launch = launch
        # cuLaunchKernel's grid, block and shared memory, in its argument order
        self.dims = (grid, grid_y, grid_z, launch.block, 1, 1, launch.smem)
        self.slots = [ctypes.c_void_p() for _ in range(p)] + [ctypes.c_int() for _ in range(5)]
        self.argv = (ctypes.c_void_p * len(self.slots))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in self.slots])
        for i, v in fixed.items():
            self.slots[i].value = v
        # the pointers, then M, N, K, x's row stride, y's
        self._x, self._b, self._y, self._m, self._sx = (self.slots[i] for i in (1, 4, 5, p, p + 3))

    def run(self, stream: int, x_ptr: int, bias_ptr: int, y_ptr: int, m: int, sx: int) -> None:
        self._x.value, self._b.value, self._y.value, self._m.value, self._sx.value = x_ptr, bias_ptr, y_ptr, m, sx
        la = self.launch
        err = la.lib.cuLaunchKernel(la.func, *self.dims, la.ctypes.c_void_p(stream), self.argv, None)
        if err != 0:
            raise RuntimeError(f"{la.name}: cuLaunchKernel failed with CUDA error {err}")


def cuda_source(cfg: MmaConfig, cpg: int, has_zeros: bool, has_bias: bool, nt: int = 1) -> str:
    """The CUDA source of one variant (cpg: 64-k chunks per quantization group; nt: column tiles of
    8 x rows, M <= 8 nt)."""
    return (f"#define WARPS {cfg.warps}\n#define UNROLL {cfg.unroll}\n#define CPG {cpg}\n#define NT {nt}\n"
            f"#define HAS_ZEROS {int(has_zeros)}\n#define HAS_BIAS {int(has_bias)}\n"
            f"#define OFFSET_MMA {int(cfg.offset_mma)}\n#define XPRE {int(cfg.xpre and nt == 1)}\n"
            f"#define ABLATE {int(cfg.ablate)}\n#define PERSIST {int(cfg.persist > 0)}\n"
            f"#define SPLITK {cfg.split_k}\n#define RING {cfg.ring}\n#define TPC {cfg.tiles}\n") + _SOURCE


def nvrtc_ptx(lib, source: str, arch: str) -> str:
    """PTX of `source` from the NVRTC library `lib` (a ctypes.CDLL) for `arch` (e.g. compute_90). The
    source includes no header, so no CUDA toolkit is needed: the NVRTC that torch's CUDA build
    loads is enough."""
    import ctypes

    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"w4a16_mma.cu", 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
        ok = lib.nvrtcCompileProgram(prog, 1, opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if ok != 0:
            raise RuntimeError(f"NVRTC could not compile the tensor-core GEMV for {arch}: {log.value.decode()}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _compile(source: str, name: str, arch_suffix: str = ""):
    """The kernel `name` of `source`, loaded on the current device. NVRTC through torch's own library
    first: torch.cuda._compile_kernel also wants CUDA_HOME's headers, which a pip-installed torch
    machine may lack; it is the fallback. arch_suffix "a": the architecture-specific target (compute_90a,
    which wgmma needs)."""
    from torch.cuda import _utils

    try:
        major, minor = torch.cuda.get_device_capability()
        ptx = nvrtc_ptx(_utils._get_gpu_rtc_library(), source, f"compute_{major}{minor}{arch_suffix}")
        kernel = _utils._cuda_load_module(ptx, [name])[name]
        COMPILED_BY.append("nvrtc")
        return kernel
    except Exception as e:
        if not hasattr(torch.cuda, "_compile_kernel"):
            raise
        COMPILED_BY.append(f"torch.cuda._compile_kernel (nvrtc: {type(e).__name__}: {e})")
        return torch.cuda._compile_kernel(source, name)


def _kernel(cfg: MmaConfig, cpg: int, has_zeros: bool, has_bias: bool, nt: int = 1) -> _Launch:
    key = (cfg, cpg, has_zeros, has_bias, nt, torch.cuda.current_device())
    kern = _KERNELS.get(key)
    if kern is None:
        name = "w4a16_mma_gemv_persist" if cfg.persist else "w4a16_mma_gemv"
        compiled = _compile(cuda_source(cfg, cpg, has_zeros, has_bias, nt), name)
        kern = _KERNELS[key] = _Launch(compiled, cfg.warps, pointers=8 if cfg.persist or cfg.split_k > 1 else 6)
    return kern


def available() -> bool:
    """Whether the kernel compiles here (a CUDA device of compute capability >= 8.0, and NVRTC); the
    first call compiles one variant and remembers a failure."""
    if _UNAVAILABLE:
        return False
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        _UNAVAILABLE.append("needs a CUDA device of compute capability >= 8.0")
        return False
    try:
        _kernel(MmaConfig(), 1, False, False)
    except Exception as e:  # no NVRTC, no CUDA headers: the Triton kernels serve
        _UNAVAILABLE.append(f"{type(e).__name__}: {e}")
        return False
    return True


# (N, K) -> config, from benchmarks/w4a16_mma.py on the H200 (twentieth session, weights from HBM):
# the fastest variant per shape at M = 1 and 8; gate_up's 4 warps a row tile from the H100 (thirty-ninth
# session: 23.8 / 24.7 / 28.2 µs at M = 1 / 8 / 16 against 25.3 / 26.2 / 31.2 for 8 warps)
MMA_CONFIGS: dict = {
    (6144, 4096): MmaConfig(8, 2, offset_mma=False, xpre=True),
    (4096, 4096): MmaConfig(8, 2, offset_mma=False, xpre=True),
    (28672, 4096): MmaConfig(4, 2, offset_mma=False),
    (4096, 14336): MmaConfig(8, 2, offset_mma=False, xpre=True),
}
DEFAULT_CONFIG = MmaConfig(8, 2, offset_mma=False)
# shapes of many row tiles (gate_up's 1792, SmolLM2's LM head's 3072: 8 to 23 tiles an SM) ran fastest with 4
# warps a tile on the H100 (thirty-ninth session: the LM head 9.9 / 10.9 / 14.8 µs at M = 1 / 8 / 16 against
# 10.8 / 12.2 / 19.6 for 8 warps); those of 384 row tiles or fewer with 8
MANY_TILES = 1536
MANY_TILES_CONFIG = MmaConfig(4, 2, offset_mma=False)


def config_for(n: int, k: int) -> MmaConfig:
    """The measured config of the (N, K) shape; else 4 warps a row tile for shapes of MANY_TILES row tiles or
    more, 8 for the rest."""
    hit = MMA_CONFIGS.get((n, k))
    if hit is not None:
        return hit
    return MANY_TILES_CONFIG if n // 16 >= MANY_TILES else DEFAULT_CONFIG


def prepare(w: W4A16MmaWeight, has_bias: bool, config: Optional[MmaConfig] = None) -> None:
    """Compile the variants a weight's runtime calls will use (one per row-tile count the runtime
    sends: M <= 8 and M <= 16), make their workspace and bind their launches, now (at load), not at
    a first call that may come inside a graph capture or mid-serving. config None: the tuned one,
    as w4a16_mma_linear's config None."""
    cfg = config or config_for(w.N, w.K)
    for nt in range(1, (RUNTIME_MAX_M + 7) // 8 + 1):  # the rows the runtime sends
        kern, grid, grid_y, fixed = _variant(w, cfg, nt, has_bias, w.words.device)
        w.calls[(nt, has_bias, config)] = kern.bound(grid, grid_y, fixed)


def fits(x: torch.Tensor) -> bool:
    """Whether the runtime sends x to the kernel: bf16 [M <= RUNTIME_MAX_M, K], unit stride along K,
    rows on 16-byte boundaries (it falls back to kernels/w4a16.py otherwise)."""
    return x.dim() == 2 and x.shape[0] <= RUNTIME_MAX_M and x.dtype == torch.bfloat16 and x.stride(1) == 1 \
        and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0


def check_args(x: torch.Tensor, w: W4A16MmaWeight, bias: Optional[torch.Tensor], max_m: int) -> None:
    """What this file's GEMV and kernels/w4a16_mma_tile.py's tiles need of their arguments, one line each."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_cuda or x.stride(1) != 1:
        raise ValueError(f"x: must be a CUDA bf16 [M, K] tensor with unit stride, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    if not 1 <= m <= max_m or k != w.K:
        raise ValueError(f"x: must be [M, {w.K}] with 1 <= M <= {max_m}, got {tuple(x.shape)}")
    if x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("x: rows must start on 16-byte boundaries (row stride a multiple of 8)")
    if bias is not None and (bias.shape != (w.N,) or bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        raise ValueError(f"bias: must be a contiguous bf16 tensor of shape ({w.N},), got {bias.dtype} "
                         f"{tuple(bias.shape)}")


def w4a16_mma_gemv(x: torch.Tensor, w: W4A16MmaWeight, bias: Optional[torch.Tensor] = None,
                   config: Optional[MmaConfig] = None) -> torch.Tensor:
    """y = x @ W^T + bias: x bf16 [M, K] (M <= 32, unit stride along K, rows 16-byte aligned), bias
    bf16 [N] or None -> y bf16 [M, N]."""
    check_args(x, w, bias, MAX_M)
    return w4a16_mma_linear(x, w, bias, config)


_SMS: dict = {}
# device -> fp32 partials' buffers, the newest (largest) last; never freed: captured graphs keep addresses
_WORKSPACES: dict = {}


def persistent_grid(w: W4A16MmaWeight, cfg: MmaConfig, device: torch.device) -> int:
    """CTAs of the persistent form for this weight (0: the per-tile form): cfg.persist a SM, no
    more warps than quantization groups (every warp's range then holds at least one)."""
    if not cfg.persist:
        return 0
    sms = _SMS.get(device.index)
    if sms is None:
        sms = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    groups = (w.N // 16) * (w.K // w.group_size)
    return min(sms * cfg.persist, groups // cfg.warps)


def _workspace_floats(w: W4A16MmaWeight, cfg: MmaConfig, grid: int, nt: int) -> int:
    """fp32 partials a call needs (0: none): the persistent form two 16 x 8 nt tiles per warp of its
    grid, the split-K form one per (split, row tile)."""
    if grid:
        return grid * cfg.warps * 2 * 128 * nt
    return cfg.split_k * (w.N // 16) * 128 * nt if cfg.split_k > 1 else 0


def _workspace(device: torch.device, floats: int) -> torch.Tensor:
    """The device's newest partials buffer, a larger one made first where it holds fewer than `floats`
    (the load-time prepare()s of this file and kernels/w4a16_mma_tile.py size it, so calls do not
    allocate). Kernels of one stream run in order, so every weight and both kernels share it; an older
    buffer stays alive for the launches bound to it."""
    held = _WORKSPACES.setdefault(device.index, [])
    if not held or held[-1].numel() < floats:
        held.append(torch.empty(floats, dtype=torch.float32, device=device))
    return held[-1]


def _variant(w: W4A16MmaWeight, cfg: MmaConfig, nt: int, has_bias: bool, device: torch.device):
    """(compiled variant, grid x, grid y, the weight's fixed arguments: slot index -> value) of a call
    of w with nt row tiles; the arguments: the variant's pointers (words, x, scales, zeros, bias or y,
    y[, workspace, counters]), then M, N, K, x's row stride, N."""
    grid = persistent_grid(w, cfg, device)
    if cfg.persist and not grid:
        cfg = dataclasses.replace(cfg, persist=0)
    if cfg.ring and any(t is not None and t.data_ptr() % 16 for t in (w.scales, w.zeros)):
        cfg = dataclasses.replace(cfg, ring=0)  # the ring copies scales and zeros 16 bytes at a time
    kern = _kernel(cfg, w.group_size // CHUNK, w.zeros is not None, has_bias, nt)
    zeros = w.scales if w.zeros is None else w.zeros  # any valid address when symmetric
    fixed = {0: w.words.data_ptr(), 2: w.scales.data_ptr(), 3: zeros.data_ptr()}
    floats = _workspace_floats(w, cfg, grid, nt)
    if floats:  # (the persistent and split-K variants: 8 pointers)
        fixed.update({6: _workspace(device, floats).data_ptr(), 7: w.counters.data_ptr()})
    p = kern.pointers
    fixed.update({p + 1: w.N, p + 2: w.K, p + 4: w.N})
    return kern, grid or -(-(w.N // 16) // cfg.tiles), 1 if grid else cfg.split_k, fixed


def w4a16_mma_linear(x: torch.Tensor, w: W4A16MmaWeight, bias: Optional[torch.Tensor] = None,
                     config: Optional[MmaConfig] = None) -> torch.Tensor:
    """The runtime's call: x already known to fit (fits(x)); no argument checks on the hot path;
    config None: the tuned one for the weight's shape. The weight's launch for x's row tiles is made
    once (``_Bound``): a call allocates y, sets five arguments and launches."""
    m = x.shape[0]
    key = ((m + 7) >> 3, bias is not None, config)
    call = w.calls.get(key)
    if call is None:
        kern, grid, grid_y, fixed = _variant(w, config or config_for(w.N, w.K), key[0], key[1], x.device)
        call = w.calls[key] = kern.bound(grid, grid_y, fixed)
    y = torch.empty(m, w.N, device=x.device, dtype=torch.bfloat16)
    yp = y.data_ptr()
    call.run(torch._C._cuda_getCurrentRawStream(x.device.index), x.data_ptr(), yp if bias is None else bias.data_ptr(),
             yp, m, x.stride(0))
    return y
