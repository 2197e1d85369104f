"""Temperature sampling of each row of logits inside a graph: greedy rows take the argmax,
sampled rows the exponential race at their temperature, in two kernel launches.

    greedy (t < GREEDY_EPS):   token = argmax x                 ties: the lowest column
    sampled:                   token = argmax x / t - log E_j   E_j ~ Exp(1), one per column

The race's winner is distributed as softmax(x / t): argmax p_j / E_j over independent
exponentials picks j with probability p_j (the sampler's eager path, runtime/sampler.py, draws
the same race with torch's generator). Here the noise is counter-based, Philox4x32-10 as in
Salmon et al. (2011) and ``tl.philox``: E_j = -log u_j with u_j from the 32-bit word of

    philox(key = seed, counter = (j // 4 within the chunk's quarter index, step, row, 0))

-- (chunk c, quarter q, lane i) of column j = c * BLOCK + q * BLOCK / 4 + i draws word q of the
counter (c * BLOCK / 4 + i, steps[row], row, 0), so one Philox call serves four columns -- and
u_j = (word >> 9 + 1/2) * 2^-23, in [2^-24, 1 - 2^-24]: E_j > 0, no -log 0. A row's tokens
depend on (seed, row, its step counter) only; stage 2 advances a sampled row's counter, so a
CUDA graph replaying the launches draws fresh noise at every replay with no host in the loop
(torch's generator in a graph needs its own offset bookkeeping, and a seed passed as a kernel
argument would be frozen into the capture).

Stage 1, grid (rows, chunks of BLOCK columns): each chunk's best (value, column) as one int64
key (kernels/topk.py's order-preserving packing: the max is unique and prefers the lower
column). Stage 2, grid (rows,): the best of the chunks' keys -> the token; the counter of a
sampled row + 1. NaN logits are not supported (they sort above +inf).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import pow2, use_triton
from .topk import _keys

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GREEDY_EPS = 1e-5  # temperature below this: greedy (runtime/sampling_params.py's)


@triton.jit
def _uniform(word):
    """uint32 Philox words -> float32 uniforms in [2^-24, 1 - 2^-24] (23 bits, centred)."""
    return ((word >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit
def _race(x, word, t):
    """x / t - log E with E = -log u: the exponential race's score of each column."""
    return x / t - tl.log(-tl.log(_uniform(word)))


@triton.jit(do_not_specialize=["R"])
def _chunk_kernel(x_ptr, temp_ptr, step_ptr, keys_ptr, R, V, stride_x, S, seed,
                  Q: tl.constexpr, EPS: tl.constexpr):
    """grid (R, S): the best key of row r's columns [c * 4Q, +4Q) to keys [R, S]."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + r)
    lane = tl.arange(0, Q)
    base = c * 4 * Q
    row = x_ptr + r * stride_x
    cols = base + lane
    x0 = tl.load(row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x1 = tl.load(row + cols + Q, mask=cols + Q < V, other=float("-inf")).to(tl.float32)
    x2 = tl.load(row + cols + 2 * Q, mask=cols + 2 * Q < V, other=float("-inf")).to(tl.float32)
    x3 = tl.load(row + cols + 3 * Q, mask=cols + 3 * Q < V, other=float("-inf")).to(tl.float32)
    if t >= EPS:
        step = tl.load(step_ptr + r).to(tl.uint32)
        ctr = (c * Q + lane).to(tl.uint32)
        zero = tl.zeros_like(ctr)
        w0, w1, w2, w3 = tl.philox(seed, ctr, zero + step, zero + r.to(tl.uint32), zero)
        x0 = _race(x0, w0, t)
        x1 = _race(x1, w1, t)
        x2 = _race(x2, w2, t)
        x3 = _race(x3, w3, t)
    k0 = tl.max(_keys(x0, cols), axis=0)
    k1 = tl.max(_keys(x1, cols + Q), axis=0)
    k2 = tl.max(_keys(x2, cols + 2 * Q), axis=0)
    k3 = tl.max(_keys(x3, cols + 3 * Q), axis=0)
    tl.store(keys_ptr + r * S + c, tl.maximum(tl.maximum(k0, k1), tl.maximum(k2, k3)))


@triton.jit(do_not_specialize=["R"])
def _pick_kernel(keys_ptr, temp_ptr, step_ptr, out_ptr, R, S, S_PAD: tl.constexpr, EPS: tl.constexpr):
    """grid (R,): row r's token (the column of its best key) to out [R]; a sampled row's step + 1."""
    r = tl.program_id(0).to(tl.int64)
    ch = tl.arange(0, S_PAD)
    key = tl.load(keys_ptr + r * S + ch, mask=ch < S, other=-9223372036854775807 - 1)
    best = tl.max(key, axis=0)
    low = best - ((best >> 32) << 32)  # the low word, in [0, 2^31)
    tl.store(out_ptr + r, 0x7FFFFFFF - low)
    if tl.load(temp_ptr + r) >= EPS:
        tl.store(step_ptr + r, tl.load(step_ptr + r) + 1)


def sample_tokens_ref(logits: torch.Tensor, temps: torch.Tensor, vocab_size: Optional[int] = None,
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """torch: greedy rows' argmax, sampled rows' exponential race over torch's Exp(1) noise from
    ``generator`` (None: the device's default generator, the one a CUDA graph may draw from)."""
    x = logits[:, :vocab_size].float()
    t = temps.float()[:, None]
    q = torch.empty_like(x).exponential_(generator=generator)
    if not q.is_cuda:  # CUDA's exponential_ never returns 0; elsewhere 0 would give -inf + inf
        q.clamp_min_(torch.finfo(torch.float32).tiny)
    race = (x / t.clamp_min(GREEDY_EPS) - q.log_()).argmax(dim=-1)
    return torch.where(t[:, 0] >= GREEDY_EPS, race, x.argmax(dim=-1))


def _quarter(v: int) -> int:
    return min(1024, max(16, pow2(v) // 4))


def sample_tokens(logits: torch.Tensor, temps: torch.Tensor, steps: torch.Tensor, seed: int,
                  vocab_size: Optional[int] = None, backend: str = "auto", out: Optional[torch.Tensor] = None,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of logits [R, >= V] (bf16 / fp16 / fp32, unit last stride; columns past
    vocab_size, e.g. a padded LM head's, excluded): int64 [R] (``out`` if given). temps float32
    [R]: each row's temperature (< 1e-5: greedy, the argmax, ties to the lower column). steps
    int64 [R]: each row's noise counter (Triton: the row's draws are Philox(seed, its row and
    step), and the launches add 1 to a sampled row's step). backend "torch": torch's argmax and
    exponential noise from ``generator`` (steps unused). Nothing here waits for the device or
    reads the host between calls: graph-safe."""
    if logits.dim() != 2 or logits.dtype not in DTYPES or logits.stride(-1) != 1:
        raise ValueError(f"logits: must be a unit-stride bf16/fp16/fp32 [R, V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    r, width = logits.shape
    v = width if vocab_size is None else vocab_size
    if not 1 <= v <= width:
        raise ValueError(f"vocab_size={vocab_size!r} is not allowed; allowed: 1..{width} (the logits' width)")
    if temps.shape != (r,) or temps.dtype != torch.float32 or steps.shape != (r,) or steps.dtype != torch.int64:
        raise ValueError(f"temps / steps: must be float32 / int64 [{r}], got {temps.dtype} {tuple(temps.shape)} "
                         f"/ {steps.dtype} {tuple(steps.shape)}")
    if not use_triton(backend, logits):
        tokens = sample_tokens_ref(logits, temps, v, generator)
        return tokens if out is None else out.copy_(tokens)
    if out is None:
        out = torch.empty(r, dtype=torch.int64, device=logits.device)
    if r == 0:
        return out
    q = _quarter(v)
    s = -(-v // (4 * q))
    keys = torch.empty(r, s, dtype=torch.int64, device=logits.device)
    _chunk_kernel[(r, s)](logits, temps, steps, keys, r, v, logits.stride(0), s, seed & 0x7FFFFFFFFFFFFFFF,
                          Q=q, EPS=GREEDY_EPS, num_warps=4)
    _pick_kernel[(r,)](keys, temps, steps, out, r, s, S_PAD=pow2(s), EPS=GREEDY_EPS, num_warps=1)
    return out
