"""W4A16 GEMM tiles on the tensor cores for small batches (M = 17..256): hand-written CUDA through NVRTC.

    y [M, N] = x [M, K] @ W^T,   W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]

Why: past M = 16 the tensor-core GEMV (kernels/w4a16_mma.py) runs out of column tiles (its x reads come
from L1 per mma), and the Triton path's swap-AB tiles were bound by the shared-memory round trip of each
dequantized bf16 tile that Triton builds for its wgmma operand (docs/BENCHMARKS.md: 0.76-1.07x cuBLAS
bf16 at M = 64, 0.58-0.69x at M = 256 on the H200). Here the dequantized weights never leave the
registers: they are the mma.sync A operand (swap-AB: 16 output features a fragment), as Marlin does,
and only x goes through shared memory, where every warp of the CTA reads it.

Weights: the GEMV's fragment words (``w4a16_mma.mma_words``, made once at load): a lane's 16 bytes of a
row tile's 64-k chunk hold its A fragments for the chunk's four m16n8k16 mmas, and the B fragments they
pair with are x[m, 64 c + 16 t .. 64 c + 16 t + 15] of lane t: 32 contiguous bytes of one x row.
Arithmetic: each nibble pair becomes (u - 8 - zero) exactly in bf16 (lop3 into the mantissa of 128 + u,
then one bf16x2 fma), times the group's scale: one rounding to bf16, as dequantize-then-GEMM and every
tensor-core W4A16 kernel round (the GEMV keeps the weight unrounded; its group sums need twice the
accumulators, which M = 64 columns do not leave room for); fp32 accumulation, one bf16 rounding of y.

Work split (``TileConfig``)
    A CTA of ``warps`` warps covers BN = 16 * rt * warps output features and BM = 8 * nt rows of x:
    warp w owns row tiles (16 features each) w * rt .. w * rt + rt - 1 of the CTA's, and all nt column
    tiles, so each B fragment read from shared memory feeds rt mmas and each dequantized A fragment nt.
    The grid is (ceil(M / BM), ceil(N / BN), split_k), the column blocks fastest, so the CTAs sharing a
    weight tile run together and all but the first read it from L2.
    x goes through a ring of ``stages`` chunk slots (BM rows x 64 k, rows padded to 144 bytes: the
    eight rows a quarter-warp reads fall on distinct banks), filled by cp.async stages - 1 chunks ahead
    by every thread of the CTA; the weights go to registers ``unroll`` chunks ahead (ld.global.nc,
    no L1 allocation), with their groups' scales and zeros.
    split_k > 1: the CTAs of blockIdx.z take contiguous 1 / split_k of the quantization groups, write
    their fp32 partial tiles to a workspace, and the last to arrive at the tile's counter (which it
    resets) sums them in split order: deterministic, no atomics on y, no host sync, CUDA-graph safe. The
    counters and the workspace are the device's, shared by every weight (the workspace with the GEMV too):
    split-K calls must run on one stream at a time, as the runtime's do. Two streams at once race on them and
    leave counters off zero, which breaks every later call (the forty-second session's benchmark did so when
    triton's do_bench_cudagraph started on its own stream before the calls before it had finished).
Limits: bf16, N % 16 == 0, K % 64 == 0, G % 64 == 0, 1 <= M <= MAX_M, x rows 16-byte aligned.

TileConfig.wgmma (forty-third session, sm_90a only, not yet run on a GPU): the same words, grid, split-K and
stores, with the products by asynchronous wgmma instead of mma.sync (``_WGMMA_KERNEL`` below says how).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from . import w4a16_mma as mk

MAX_M = 4096  # any M works (the grid's column blocks); the runtime sends what the tuned table says
XROW = 144  # bytes a row of an x slot: 64 bf16 and 16 of padding
WGMMA_SMEM = 227 * 1024  # the most dynamic shared memory a CTA may take on sm_90


@dataclass(frozen=True)
class TileConfig:
    warps: int = 4  # warps a CTA, each over rt row tiles
    rt: int = 2  # row tiles (16 output features each) a warp
    nt: int = 8  # column tiles (8 x rows each) a CTA: BM = 8 nt
    stages: int = 4  # x ring slots (cp.async stages - 1 chunks ahead)
    unroll: int = 2  # weight chunks a warp loads ahead into registers
    split_k: int = 1  # CTAs along K, each over 1 / split_k of the groups
    ablate: bool = False  # timing only: no dequantization (wrong numbers)
    wgmma: bool = False  # the wgmma form (sm_90a): one warpgroup, everything through the ring (below)

    def __post_init__(self) -> None:
        if self.wgmma and (self.warps != 4 or self.stages < 3 or self.smem() > WGMMA_SMEM):
            raise ValueError(f"wgmma: allowed warps=4 (one warpgroup) and stages >= 3 with stages * {self.slot()} "
                             f"bytes <= {WGMMA_SMEM}, got warps={self.warps}, stages={self.stages}")
        if self.warps not in (1, 2, 4, 8):
            raise ValueError(f"warps={self.warps}: allowed 1, 2, 4, 8")
        if self.rt not in (1, 2, 4):
            raise ValueError(f"rt={self.rt}: allowed 1, 2, 4 row tiles a warp")
        most = 32 if self.wgmma else 16  # the wgmma form keeps no B fragments in registers: 128 accumulators fit
        if self.nt not in range(1, most + 1) or self.rt * self.nt > most:
            raise ValueError(f"nt={self.nt}: allowed 1..{most} column tiles with rt * nt <= {most} (accumulators a "
                             f"lane: 4 rt nt), got rt={self.rt}")
        if self.stages not in range(2, 9) or (not self.wgmma and self.stages * 8 * self.nt * XROW > 98304):
            raise ValueError(f"stages={self.stages}: allowed 2..8 with stages * BM * {XROW} bytes <= 96 KiB")
        if self.unroll not in (1, 2, 4):
            raise ValueError(f"unroll={self.unroll}: allowed 1, 2, 4")
        if self.split_k not in range(1, 17):
            raise ValueError(f"split_k={self.split_k}: allowed 1..16")

    @property
    def bn(self) -> int:
        return 16 * self.rt * self.warps

    @property
    def bm(self) -> int:
        return 8 * self.nt

    def slot(self) -> int:
        """Bytes a ring slot: x (BM rows x 64 k), and in the wgmma form also the chunk's words, scales and zeros
        (rounded up to 128)."""
        if not self.wgmma:
            return self.bm * XROW
        return -(-(self.bm * 128 + self.rt * (2048 + 128 + 64)) // 128) * 128

    def smem(self) -> int:
        """Dynamic shared memory a CTA: the ring."""
        return self.stages * self.slot()


_TILE_HELPERS = r"""
// (u - 8 - zero) * scale for the nibble pair j, j + 4 of w: one bf16x2 fma brings 128 + u to u - 8 - zero
// (exact: small integers), one more multiplies by the row's scale (one rounding)
__device__ __forceinline__ u32 dq(u32 w, u32 nz, u32 s2) {
#if ABLATE
  return w;
#else
  u32 r, d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(pair(w)), "r"(0x3F803F80u), "r"(nz));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(r), "r"(s2), "r"(0x80008000u));
  return d;
#endif
}
// A chunk's weights for one row tile: the lane's 16 bytes, its rows' scales (bf16, row g low, g + 8 high)
// and zeros (int8 pair)
struct WChunk { W4 w; u32 s; u32 z; };
__device__ __forceinline__ void load_w(WChunk& wc, const W4* wp, int c, int n0, int N,
                                       const u16* __restrict__ scales, const signed char* __restrict__ zeros) {
  wc.w = ld_stream(wp + (size_t)c * 32);
  const size_t gi = (size_t)(c / CPG) * N + n0;
  wc.s = (u32)scales[gi] | ((u32)scales[gi + 8] << 16);
#if HAS_ZEROS
  wc.z = (u32)(unsigned char)zeros[gi] | ((u32)(unsigned char)zeros[gi + 8] << 8);
#else
  wc.z = 0;
#endif
}
// the A fragment of k16 step i of a chunk: register j is nibble pair j of word i >> 4j, rows g (j even) and
// g + 8 (j odd)
__device__ __forceinline__ void fragment_i(u32* a, const WChunk& wc, int i) {
  const u32 sg = (wc.s & 0xFFFFu) * 0x10001u, sh = (wc.s >> 16) * 0x10001u;
#if HAS_ZEROS
  const u32 nz0 = neg_pair(136.f + (float)(signed char)(wc.z & 0xFF)),
            nz1 = neg_pair(136.f + (float)(signed char)((wc.z >> 8) & 0xFF));
#else
  const u32 nz0 = 0xC308C308u, nz1 = 0xC308C308u;  // -136 in both halves
#endif
  const u32 w = i == 0 ? wc.w.a : i == 1 ? wc.w.b : i == 2 ? wc.w.c : wc.w.d;
  a[0] = dq(w, nz0, sg);
  a[1] = dq(w >> 4, nz1, sh);
  a[2] = dq(w >> 8, nz0, sg);
  a[3] = dq(w >> 12, nz1, sh);
}
// the mma without `volatile` (a function of registers only): the compiler may interleave the independent
// accumulators' mmas, where the GEMV's volatile ones keep program order (a chain of dependent mmas per
// accumulator then waits out the mma latency each time: the first form of these tiles ran at 10-20% of the
// tensor cores, H100)
__device__ __forceinline__ void mma_free(float* d, const u32* a, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#define BN (16 * RT * WARPS)
#define BM (8 * NT)
#define XROW 144
#define THREADS (WARPS * 32)
#define XP ((BM * 8 + THREADS - 1) / THREADS)  // 16-byte pieces of an x chunk a thread copies
// A thread's pieces of every x chunk: piece i is q = threadIdx.x + i * THREADS of the chunk's BM * 8 (row q / 8,
// bytes 16 (q % 8) of its 128), where the row (a copy of row M - 1 past M, never stored) and the piece do not
// depend on the chunk: their source pointers are made once, and a chunk adds its offset
struct XPieces { const u16* src[XP]; };
__device__ __forceinline__ void x_pieces(XPieces& xp, const u16* __restrict__ x, int m0, int M, int ldx) {
#pragma unroll
  for (int i = 0; i < XP; ++i) {
    const int q = threadIdx.x + i * THREADS;
    const int m = m0 + (q >> 3) < M ? m0 + (q >> 3) : M - 1;
    xp.src[i] = x + (size_t)m * ldx + (q & 7) * 8;
  }
}
// chunk c of x rows m0 .. m0 + BM - 1 into the slot at s
__device__ __forceinline__ void load_x(u32 s, const XPieces& xp, int c) {
  const u32 dst = s + (threadIdx.x >> 3) * XROW + (threadIdx.x & 7) * 16;
#pragma unroll
  for (int i = 0; i < XP; ++i)
    if ((BM * 8) % THREADS == 0 || threadIdx.x + i * THREADS < BM * 8)
      cp_async16(dst + i * (THREADS / 8) * XROW, xp.src[i] + (size_t)c * 64);
}
"""

_MMA_KERNEL = r"""
KERNEL_HEAD
  // my row tiles: those past N compute a copy of the last one and store nothing
  const W4* wp[RT];
  int n0[RT];
  bool live[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const int tl = (blockIdx.y * WARPS + warp) * RT + r;
    live[r] = tl < tiles;
    const int tc = live[r] ? tl : tiles - 1;
    wp[r] = wq + (size_t)tc * chunks * 32 + lane;
    n0[r] = tc * 16 + g;
  }
  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[r][j][q] = 0.f;
  const u32 xs0 = smem_addr(xs);
  XPieces xp;
  x_pieces(xp, x, m0, M, ldx);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (c0 + s < c1) load_x(xs0 + s * SLOT, xp, c0 + s);
    cp_commit();
  }
  WChunk buf[UNROLL][RT];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
    if (c0 + u < c1)
#pragma unroll
      for (int r = 0; r < RT; ++r) load_w(buf[u][r], wp[r], c0 + u, n0[r], N, scales, zeros);
  int slot = 0;  // (c - c0) % STAGES
  for (int cb = c0; cb < c1; cb += UNROLL) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = cb + u;
      if (c < c1) {  // the same for every thread of the CTA: the barrier below is reached by all
        WChunk cur[RT];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          cur[r] = buf[u][r];
          if (c + UNROLL < c1) load_w(buf[u][r], wp[r], c + UNROLL, n0[r], N, scales, zeros);
        }
        cp_wait<STAGES - 2>();  // chunk c's x landed (this thread's copies) ...
        __syncthreads();  // ... and everyone's; every warp is done with chunk c - 1's slot, refilled now
        const int fill = slot == 0 ? STAGES - 1 : slot - 1;
        if (c + STAGES - 1 < c1) load_x(xs0 + fill * SLOT, xp, c + STAGES - 1);
        cp_commit();
        // two halves of the chunk: every column tile's 16 bytes of x (k16 steps 2h, 2h + 1) first, then per
        // step the rt A fragments and the rt * nt mmas, each accumulator's next mma rt * nt mmas later
        const u32 xrow = xs0 + slot * SLOT + g * XROW + 32 * t;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          W4 xv[NT];
#pragma unroll
          for (int j = 0; j < NT; ++j) xv[j] = ld_shared(xrow + j * 8 * XROW + 16 * h);
#pragma unroll
          for (int i2 = 0; i2 < 2; ++i2) {
            u32 a[RT][4];
#pragma unroll
            for (int r = 0; r < RT; ++r) fragment_i(a[r], cur[r], 2 * h + i2);
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
              for (int r = 0; r < RT; ++r)
                mma_free(acc[r][j], a[r], i2 ? xv[j].c : xv[j].a, i2 ? xv[j].d : xv[j].b);
          }
        }
        slot = slot + 1 == STAGES ? 0 : slot + 1;
      }
    }
  }
  cp_wait<0>();
"""

# both forms' kernel: its arguments (the launcher's slots), the lane's place, and its split's chunks c0 .. c1 - 1
_KERNEL_HEAD = r"""extern "C" __global__ void __launch_bounds__(THREADS)
w4a16_mma_tile(const W4* __restrict__ wq, const u16* __restrict__ x, const u16* __restrict__ scales,
               const signed char* __restrict__ zeros, const u16* __restrict__ bias, u16* __restrict__ y,
               float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int K, int ldx, int ldy) {
  extern __shared__ __align__(128) unsigned char xs[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = K >> 6, tiles = N >> 4;
  const int m0 = blockIdx.x * BM;
  const int all = chunks / CPG;
  const int c0 = (int)(((long long)blockIdx.z * all) / SPLITK) * CPG;
  const int c1 = (int)(((long long)(blockIdx.z + 1) * all) / SPLITK) * CPG;"""

# the split-K sum and the stores, shared by both forms: lane (g, t) holds acc[r][j] of its row tile r (rows
# n0[r], n0[r] + 8; live[r]: inside N) and column tile j, as mma.sync's and wgmma's D fragments both place them
_EPILOGUE = r"""
#if SPLITK > 1
  // partial tiles: ws [SPLITK][tiles of the grid][RT NT][THREADS] float4, coalesced along the threads
  const int id = blockIdx.y * gridDim.x + blockIdx.x, T = gridDim.x * gridDim.y;
  float4* ws4 = (float4*)ws;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
      ws4[(((size_t)blockIdx.z * T + id) * (RT * NT) + r * NT + j) * THREADS + threadIdx.x] =
          make_float4(acc[r][j][0], acc[r][j][1], acc[r][j][2], acc[r][j][3]);
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (threadIdx.x == 0) last = atomicAdd(cnt + id, 1) == SPLITK - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[r][j][q] = 0.f;
  for (int s = 0; s < SPLITK; ++s)
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float* p = (const float*)(ws4 + (((size_t)s * T + id) * (RT * NT) + r * NT + j) * THREADS + threadIdx.x);
        acc[r][j][0] += ld_cg(p);
        acc[r][j][1] += ld_cg(p + 1);
        acc[r][j][2] += ld_cg(p + 2);
        acc[r][j][3] += ld_cg(p + 3);
      }
  if (threadIdx.x == 0) cnt[id] = 0;
#endif
  // lane (g, t) holds, for row tile r and column tile j: (row n0, m 2t), (n0, 2t + 1), (n0 + 8, 2t), (n0 + 8, 2t + 1)
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    if (!live[r]) continue;
    const int na = n0[r], nb = na + 8;
    float b0 = 0.f, b1 = 0.f;
#if HAS_BIAS
    b0 = bf16f(bias[na]);
    b1 = bf16f(bias[nb]);
#endif
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int ma = m0 + 8 * j + 2 * t, mb = ma + 1;
      if (ma < M) {
        y[(size_t)ma * ldy + na] = f2bf(acc[r][j][0] + b0);
        y[(size_t)ma * ldy + nb] = f2bf(acc[r][j][2] + b1);
      }
      if (mb < M) {
        y[(size_t)mb * ldy + na] = f2bf(acc[r][j][1] + b0);
        y[(size_t)mb * ldy + nb] = f2bf(acc[r][j][3] + b1);
      }
    }
  }
}
"""


# The wgmma form (TileConfig.wgmma, sm_90a only; forty-third session, not yet run on a GPU). The mma.sync tiles
# above ran latency-bound: one CTA of 4 warps an SM, one warp a scheduler, an instruction every 5.6-7.9 cycles,
# SM busy 14-24% (Nsight Compute, H100, o and down at M = 64, docs/BENCHMARKS.md). Here one warpgroup (the CTA's
# 4 warps) issues asynchronous m64nBMk16 wgmmas: A, the dequantized weights, from registers (warp w holds rows
# 16 w .. 16 w + 15 of each 64-row tile, in mma.m16n8k16's A layout), B, x, from shared memory through a
# descriptor; the dequantization of chunk c + 1 runs while chunk c's wgmmas do.
# Everything a chunk needs comes through one cp.async ring of STAGES slots, STAGES - 2 chunks ahead (the slot of
# chunk c - 2 is refilled once every warp has waited out c - 2's wgmmas):
#   x       BM rows x 64 k as no-swizzle K-major core matrices [BM / 8][8 k blocks][8 rows][16 bytes]: piece q of
#           the chunk (row 8 (q >> 6) + (q & 7), k block (q >> 3) & 7) lands at byte 16 q, so the copies are
#           conflict-free and wgmma's k16 step i reads k blocks 2i, 2i + 1: start 256 i, leading-dimension byte
#           offset (between the two k blocks) 128, stride-dimension byte offset (between 8-row groups) 1024;
#   words   the CTA's 4 RT row tiles' fragment words of the chunk, [row tile][t][g][16 bytes] for lane (g, t): the
#           GEMV's words give lane (g, t) the k 16 t .. 16 t + 15 of its rows (x read 32 bytes a lane), where wgmma's
#           k16 step j takes of lane (g, t) k 16 j + 2 t (+ 8); so lane (g, t) reads two 4-byte words of lane
#           (g, j)'s, and with the 8 lanes of one t side by side those reads are free of bank conflicts;
#   scales  the chunk's group's scales of the CTA's BN rows (bf16), zeros (int8) when asymmetric.
# The x descriptor's byte offsets as the layout above needs them under PTX's reading of a no-swizzle K-major
# descriptor: the leading-dimension offset between the two k blocks of a k16 step, the stride-dimension offset
# between 8-row groups. No CPU test can check that the hardware reads them so (the transcription takes PTX's
# reading): tests/kernels/test_w4a16_mma_tile.py's GPU test says, where the form computes wrong, whether the
# swapped pair computes right.
X_LBO, X_SBO = 128, 1024
_WGMMA_KERNEL = r"""
#define XBYTES (BM * 128)
#define WBYTES (RT * 4 * 512)
#define SBYTES (RT * 128)
#define ZBYTES (RT * 64)
#define XPW ((BM * 8 + 127) / 128)  // x pieces a thread
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ void keep(float& v) { asm volatile("" : "+f"(v) :: "memory"); }
__device__ __forceinline__ unsigned long long x_desc(u32 addr) {  // no swizzle (bits 62-63 zero), base offset 0
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(XLBO >> 4) << 16)
         | ((unsigned long long)(XSBO >> 4) << 32);
}
WGMMA_FUNCTION
__device__ __forceinline__ u16 lds16(u32 a) {
  u16 v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ u32 lds32(u32 a) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ u32 lds8(u32 a) {
  u32 v;
  asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
KERNEL_HEAD
  const int nb = blockIdx.y * BN;
  // my row tiles (warp w of 64-row tile r): those past N compute a copy of the last one and store nothing
  int n0[RT];
  bool live[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const int tl = (blockIdx.y * RT + r) * 4 + warp;
    live[r] = tl < tiles;
    n0[r] = (live[r] ? tl : tiles - 1) * 16 + g;
  }
  // the copies' sources, made once (a chunk adds its offset): x pieces, my words (thread q: row tile
  // q / 32 + 4 i of the CTA's, lane q % 32), the scales' and zeros' 16-byte pieces (rows past N: the last piece)
  const u16* xsrc[XPW];
#pragma unroll
  for (int i = 0; i < XPW; ++i) {
    const int q = threadIdx.x + i * 128;
    const int m = m0 + 8 * (q >> 6) + (q & 7);
    xsrc[i] = x + (size_t)(m < M ? m : M - 1) * ldx + ((q >> 3) & 7) * 8;
  }
  const W4* wsrc[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const int tl = blockIdx.y * RT * 4 + threadIdx.x / 32 + 4 * r;
    wsrc[r] = wq + (size_t)(tl < tiles ? tl : tiles - 1) * chunks * 32 + lane;
  }
  const int sp = nb + 8 * (int)threadIdx.x, zp = nb + 16 * (int)threadIdx.x;
  const u16* ssrc = scales + (sp + 8 <= N ? sp : N - 8);
  const signed char* zsrc = zeros + (zp + 16 <= N ? zp : N - 16);
  const u32 xs0 = smem_addr(xs);
  auto load = [&](u32 sb, int c) {  // chunk c into the slot at sb (every thread; one commit after)
#pragma unroll
    for (int i = 0; i < XPW; ++i)
      if ((BM * 8) % 128 == 0 || threadIdx.x + i * 128 < BM * 8)
        cp_async16(sb + 16 * (threadIdx.x + i * 128), xsrc[i] + (size_t)c * 64);
#pragma unroll
    for (int r = 0; r < RT; ++r) {  // lane (g, t) of row tile p / 32 at block 32 (p / 32) + 8 t + g
      const int p = threadIdx.x + 128 * r;
      cp_async16(sb + XBYTES + 16 * ((p >> 5) * 32 + (p & 3) * 8 + ((p >> 2) & 7)), wsrc[r] + (size_t)c * 32);
    }
    const size_t gi = (size_t)(c / CPG) * N;
    if (threadIdx.x < BN / 8) cp_async16(sb + XBYTES + WBYTES + 16 * threadIdx.x, ssrc + gi);
#if HAS_ZEROS
    if (threadIdx.x < BN / 16) cp_async16(sb + XBYTES + WBYTES + SBYTES + 16 * threadIdx.x, zsrc + gi);
#endif
  };
  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[r][j][q] = 0.f;
#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (c0 + s < c1) load(xs0 + s * SLOT, c0 + s);
    cp_commit();
  }
  u32 a[2][RT][4][4];  // two chunks' A fragments: chunk c's stay untouched until its wgmmas are waited out
  int slot = 0;  // (c - c0) % STAGES
  for (int cb = c0; cb < c1; cb += 2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = cb + h;
      if (c < c1) {  // the same for every thread: the barrier is reached by all
        cp_wait<STAGES - 3>();  // chunk c landed (this thread's copies) ...
        fence_async_smem();     // ... visible to the wgmmas' (async proxy) reads ...
        __syncthreads();        // ... everyone's; and every warp waited out chunk c - 2's wgmmas: its slot is free
        const int fill = slot >= 2 ? slot - 2 : slot + STAGES - 2;
        if (c + STAGES - 2 < c1) load(xs0 + fill * SLOT, c + STAGES - 2);
        cp_commit();
        const u32 sb = xs0 + slot * SLOT;
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          const int lt = r * 4 + warp, nl = lt * 16 + g;  // my row tile and row g within the CTA's BN
          const u32 sc = (u32)lds16(sb + XBYTES + WBYTES + 2 * nl)
                         | ((u32)lds16(sb + XBYTES + WBYTES + 2 * (nl + 8)) << 16);
          const u32 sg = (sc & 0xFFFFu) * 0x10001u, sh = (sc >> 16) * 0x10001u;
#if HAS_ZEROS
          const u32 nz0 = neg_pair(136.f + (float)(signed char)lds8(sb + XBYTES + WBYTES + SBYTES + nl)),
                    nz1 = neg_pair(136.f + (float)(signed char)lds8(sb + XBYTES + WBYTES + SBYTES + nl + 8));
#else
          const u32 nz0 = 0xC308C308u, nz1 = 0xC308C308u;
#endif
          // the words hold lane (g, t')'s k 16 t' .. 16 t' + 15 (the GEMV's order: word i, pair jr -> row
          // g + 8 (jr & 1), k 16 t' + 8 (i >> 1) + 4 (i & 1) + 2 (jr >> 1)); wgmma's k16 step j wants, of lane (g, t),
          // k 16 j + 2 t (+ 8): lane (g, j)'s words t / 2 and 2 + t / 2, pairs 2 (t & 1) (row g), 2 (t & 1) + 1 (g + 8)
          const u32 wb = sb + XBYTES + 16 * (lt * 32 + g) + 4 * (t >> 1);
          const int sh0 = 8 * (t & 1);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const u32 lo = lds32(wb + 128 * j), hi = lds32(wb + 128 * j + 8);
            a[h][r][j][0] = dq(lo >> sh0, nz0, sg);
            a[h][r][j][1] = dq(lo >> (sh0 + 4), nz1, sh);
            a[h][r][j][2] = dq(hi >> sh0, nz0, sg);
            a[h][r][j][3] = dq(hi >> (sh0 + 4), nz1, sh);
          }
        }
        wg_fence();
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
          for (int i = 0; i < 4; ++i) wgmma_bm(&acc[r][0][0], a[h][r][i], x_desc(sb + 256 * i));
        wg_commit();
        wg_wait<1>();  // chunk c - 1's wgmmas are done: its A registers and (after the next barrier) its slot free
        slot = slot + 1 == STAGES ? 0 : slot + 1;
      }
    }
  }
  wg_wait<0>();
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) keep(acc[r][j][q]);
  cp_wait<0>();
"""


def wgmma_function(bm: int) -> str:
    """``wgmma_bm(d, a, desc)``: one m64n{bm}k16 bf16 wgmma, A from four registers, B from shared memory (K-major,
    the descriptor), fp32 accumulators d[0 .. bm / 2 - 1] in place (scale-d 1, no scaling or transposes)."""
    nd = bm // 2
    regs = ", ".join(f"%{i}" for i in range(nd))
    a = ", ".join(f"%{nd + i}" for i in range(4))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    return (f'__device__ __forceinline__ void wgmma_bm(float* d, const u32* a, unsigned long long desc) {{\n'
            f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 5}, 0;\\n'
            f'wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.bf16.bf16 '
            f'{{{regs}}}, {{{a}}}, %{nd + 4}, p, 1, 1, 0;\\n}}\\n"\n'
            f'    : {outs}\n'
            f'    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));\n}}\n')


def cuda_source(cfg: TileConfig, cpg: int, has_zeros: bool, has_bias: bool) -> str:
    """The CUDA source of one variant (cpg: 64-k chunks per quantization group)."""
    return (f"#define WARPS {cfg.warps}\n#define RT {cfg.rt}\n#define NT {cfg.nt}\n#define STAGES {cfg.stages}\n"
            f"#define UNROLL {cfg.unroll}\n#define SPLITK {cfg.split_k}\n#define CPG {cpg}\n"
            f"#define HAS_ZEROS {int(has_zeros)}\n#define HAS_BIAS {int(has_bias)}\n#define ABLATE {int(cfg.ablate)}\n"
            f"#define SLOT {cfg.slot()}\n"  # bytes a ring slot: TileConfig.slot's, the one count of it
            f"#define XLBO {X_LBO}\n#define XSBO {X_SBO}\n"
            ) + mk.COMMON_SOURCE + _TILE_HELPERS + (
        _WGMMA_KERNEL.replace("WGMMA_FUNCTION", wgmma_function(cfg.bm)) if cfg.wgmma else _MMA_KERNEL
    ).replace("KERNEL_HEAD", _KERNEL_HEAD) + _EPILOGUE


_KERNELS: dict = {}
_COUNTERS: dict = {}  # device -> int32 counters, zero between calls (each call's last CTAs reset theirs)
COUNTERS = 1 << 16


def _kernel(cfg: TileConfig, cpg: int, has_zeros: bool, has_bias: bool) -> mk._Launch:
    key = (cfg, cpg, has_zeros, has_bias, torch.cuda.current_device(), (X_LBO, X_SBO) if cfg.wgmma else None)
    kern = _KERNELS.get(key)
    if kern is None:
        if cfg.wgmma and not wgmma_here():
            raise ValueError(f"{cfg}: the wgmma form needs compute capability 9.0 (sm_90a), got "
                             f"{torch.cuda.get_device_capability()}")
        compiled = mk._compile(cuda_source(cfg, cpg, has_zeros, has_bias), "w4a16_mma_tile", "a" if cfg.wgmma else "")
        kern = _KERNELS[key] = mk._Launch(compiled, cfg.warps, pointers=8, smem=cfg.smem(), name="w4a16_mma_tile")
    return kern


def _counters(device: torch.device) -> torch.Tensor:
    cnt = _COUNTERS.get(device.index)
    if cnt is None:
        cnt = _COUNTERS[device.index] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return cnt


def grid(cfg: TileConfig, m: int, n: int) -> tuple[int, int, int]:
    return -(-m // cfg.bm), -(-n // cfg.bn), cfg.split_k


def workspace_floats(cfg: TileConfig, m: int, n: int) -> int:
    """fp32 partials of a split-K call (0: none): split_k partial tiles of BN x BM per CTA tile."""
    gx, gy, _ = grid(cfg, m, n)
    return cfg.split_k * gx * gy * cfg.bn * cfg.bm if cfg.split_k > 1 else 0


DEFAULT_CONFIG = TileConfig()
RUNTIME_MIN_M = 17  # below, the GEMV (kernels/w4a16_mma.py)
TILE_MAX_M = 256  # the most rows the runtime may send (OPTLLM_W4A16_TILE=1: every M of RUNTIME_MIN_M..TILE_MAX_M)
# The tuned table (benchmarks/w4a16_tile.py --table prints it from a run): (N, K) -> ((lo, hi, config), ...), the
# rows M = lo..hi that the runtime sends the tiles, in that config; every other M goes to the GEMV (M <= 16) or
# the Triton path (kernels/w4a16.py). Entries only where a run measured the tiles ahead of the Triton path, at
# the M measured (lo = hi): the decode graphs' batch buckets are multiples of 16, and the M between two measured
# ones is not guessed. Measured on an H100 with symmetric groups of 128 (other groups take the same rows;
# docs/BENCHMARKS.md), µs tiles / Triton:
#   forty-second session: qkv M = 128 36.5 / 44.1, down M = 128 66.8 / 111.3, gate_up M = 32 51.4 / 56.3;
#   forty-third session: qkv M = 80 / 96 / 112 39.4 / 43.0, 39.2 / 43.6, 40.8 / 44.6; down 63.6 / 106.3,
#   62.8 / 107.2, 65.5 / 107.8 (Triton's M > 64 dequantizes the whole weight and calls cuBLAS).
# o lost at every M measured (16..256), gate_up everywhere but M = 32, qkv and down at M <= 64 and 256.
#   forty-fifth session: the Triton path's M = 65..128 bucket tuned (kernels/w4a16_configs.py), qkv M = 128 29.9,
#   down 54.0 against the best tiles' 36.1 and 67.0 (the wgmma form's among them): the qkv and down rows at
#   M = 80..128 went back to the Triton path. At 80..112 its M = 128 configs run the same two 64-row tiles
#   over M (not measured there; the tiles read 39.2-40.8 and 62.8-65.5 at those M).
_K4_NT4 = TileConfig(4, 2, 4, split_k=4)
TILE_TABLE: dict = {
    (28672, 4096): ((32, 32, _K4_NT4),),  # gate_up
}


def wgmma_here() -> bool:
    """Whether this process's CUDA device runs the wgmma form (compute capability 9.0: sm_90a)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _entries(n: int, k: int, wgmma: bool) -> tuple:
    """The table's rows of (N, K) this device can run (wgmma False: without the wgmma form's)."""
    return tuple(e for e in TILE_TABLE.get((n, k), ()) if wgmma or not e[2].wgmma)


def route_rows(n: int, k: int, wgmma: Optional[bool] = None) -> frozenset:
    """The M the runtime sends the tiles for an (N, K) weight (empty: none); rows in the wgmma form only where
    ``wgmma`` (None: wgmma_here())."""
    ok = wgmma_here() if wgmma is None else wgmma
    return frozenset(m for lo, hi, _ in _entries(n, k, ok) for m in range(max(lo, RUNTIME_MIN_M),
                                                                           min(hi, TILE_MAX_M) + 1))


def fits(x: torch.Tensor) -> bool:
    """Whether x can go to the tiles: bf16 [M, K], unit stride along K, rows on 16-byte boundaries."""
    return x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1 and x.stride(0) % 8 == 0 \
        and x.data_ptr() % 16 == 0


def prepare(w: mk.W4A16MmaWeight, rows) -> None:
    """At load, for the M (rows: an iterable) the runtime will send: compile each config those M take and size
    the split-K workspace and counters for the largest, so no call (inside a graph capture, mid-serving)
    compiles or allocates; the launches themselves are bound at a call's first M (host work only)."""
    device = w.words.device
    plan = [(m, config_for(w.N, w.K, m)) for m in sorted(rows)]
    if not plan:
        return
    for cfg in {cfg for _, cfg in plan}:
        for has_bias in (False, True):
            _kernel(cfg, w.group_size // mk.CHUNK, w.zeros is not None, has_bias)
    floats = max(workspace_floats(cfg, m, w.N) for m, cfg in plan)
    if floats:
        mk._workspace(device, floats)
        _counters(device)


def config_for(n: int, k: int, m: int, sms: int = 132, wgmma: Optional[bool] = None) -> TileConfig:
    """The tuned table's config of (N, K) at M (the wgmma form's only where ``wgmma``, None: wgmma_here()), else
    DEFAULT_CONFIG with the smallest power-of-two split_k (up to 8, four chunks a split at least) whose grid has
    2 CTAs an SM."""
    for lo, hi, cfg in _entries(n, k, wgmma_here() if wgmma is None else wgmma):
        if lo <= m <= hi:
            return cfg
    gx, gy, _ = grid(DEFAULT_CONFIG, m, n)
    split = 1
    while gx * gy * split < 2 * sms and split < 8 and (k // 64) // (2 * split) >= 4:
        split *= 2
    return dataclasses.replace(DEFAULT_CONFIG, split_k=split)


def w4a16_mma_tile(x: torch.Tensor, w: mk.W4A16MmaWeight, bias: Optional[torch.Tensor] = None,
                   config: Optional[TileConfig] = None) -> torch.Tensor:
    """y = x @ W^T + bias: x bf16 [M, K] (unit stride along K, rows 16-byte aligned), bias bf16 [N] or None
    -> y bf16 [M, N]. config None: config_for's."""
    mk.check_args(x, w, bias, MAX_M)
    return w4a16_mma_tile_linear(x, w, bias, config)


def _bind(w: mk.W4A16MmaWeight, m: int, has_bias: bool, cfg: TileConfig, device: torch.device) -> mk._Bound:
    gr = grid(cfg, m, w.N)
    if cfg.split_k > 1 and gr[0] * gr[1] > COUNTERS:
        raise ValueError(f"split_k={cfg.split_k}: the grid's {gr[0] * gr[1]} tiles pass the {COUNTERS} counters")
    kern = _kernel(cfg, w.group_size // mk.CHUNK, w.zeros is not None, has_bias)
    floats = workspace_floats(cfg, m, w.N)
    zeros = w.scales if w.zeros is None else w.zeros  # any valid address when symmetric
    fixed = {0: w.words.data_ptr(), 2: w.scales.data_ptr(), 3: zeros.data_ptr(), 8: m, 9: w.N, 10: w.K, 12: w.N}
    if floats:
        fixed.update({6: mk._workspace(device, floats).data_ptr(), 7: _counters(device).data_ptr()})
    return kern.bound(gr[0], gr[1], fixed, gr[2])


def w4a16_mma_tile_linear(x: torch.Tensor, w: mk.W4A16MmaWeight, bias: Optional[torch.Tensor] = None,
                          config: Optional[TileConfig] = None) -> torch.Tensor:
    """The runtime's call (x known to fit, no checks): the weight's launch at x's M, made once (its grid,
    workspace and sizes) and kept in ``w.calls`` (the GEMV's ``_Bound``); a call allocates y, sets its
    arguments and launches."""
    m = x.shape[0]
    key = ("tile", m, bias is not None, config)
    call = w.calls.get(key)
    if call is None:
        call = w.calls[key] = _bind(w, m, bias is not None, config or config_for(w.N, w.K, m), x.device)
    y = torch.empty(m, w.N, device=x.device, dtype=torch.bfloat16)
    yp = y.data_ptr()
    call.run(torch._C._cuda_getCurrentRawStream(x.device.index), x.data_ptr(), yp if bias is None else bias.data_ptr(),
             yp, m, x.stride(0))
    return y
