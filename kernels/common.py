"""What the kernel families share: the program-to-tile order of the GEMMs, whether Triton
runs on the CPU interpreter (TRITON_INTERPRET=1), the backend choice every wrapper makes,
host-side launch arithmetic, and the direct launch through a compiled kernel's launcher
(CompiledLaunch: what an eager decode-sized call costs the host)."""

from __future__ import annotations

import os
from collections.abc import Hashable, Sequence

import torch
import triton
import triton.language as tl

BACKENDS = ("auto", "triton", "torch")


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` in grouped order: GROUP_M row tiles walk each weight
    column tile together, while that tile is in L2."""
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(backend: str, t: torch.Tensor) -> bool:
    """Resolve ``backend`` ("auto" | "triton" | "torch") for tensor ``t``: "auto" takes Triton
    on CUDA tensors, or on CPU tensors when TRITON_INTERPRET=1, else the torch reference."""
    if backend == "auto":
        return t.is_cuda or interpreting()
    if backend == "triton":
        if not (t.is_cuda or interpreting()):
            raise ValueError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 for CPU tensors")
        return True
    if backend == "torch":
        return False
    raise ValueError(f"backend={backend!r} is not supported; allowed: {BACKENDS}")


def pow2(n: int) -> int:
    """The smallest power of two >= n (plain Python: triton.next_power_of_2 and triton.cdiv
    go through the JIT's call path, microseconds per launch)."""
    return 1 << (n - 1).bit_length()


# Launching through Triton's compiled launcher (set False to time JITFunction.run's path)
DIRECT_LAUNCH = True
# The runtime's own kernels (RMSNorm, rotary + KV store, extend attention, SiLU-and-mul) take the
# same path only when this is True. An eager step launches about 151 of them
# (benchmarks/eager_step_launches.py), 38-68 µs of host time each through JITFunction.run on the
# H200's host. On since the twentieth session: tests/kernels/test_direct_launch.py passed on the
# H200 (bit-equal to JITFunction.run), and the plain engine under a continuous load ran 1.10x (batch
# 32) and 1.25x (batch 64) faster with it (docs/BENCHMARKS.md). OPTLLM_RUNTIME_DIRECT_LAUNCH=0 (read
# once, here) turns it off for a comparison.
RUNTIME_DIRECT_LAUNCH = os.environ.get("OPTLLM_RUNTIME_DIRECT_LAUNCH", "1") != "0"


class CompiledLaunch:
    """A @triton.jit kernel launched straight through its compiled launcher once Triton has
    compiled it for a key. JITFunction.run does, on every call: bind and specialize each
    argument, hash the cache key, read Triton's environment knobs, check the kernel's globals,
    build launch metadata -- tens of µs of host time, several times a decode-sized kernel's GPU
    time. Here the first call of a key goes through JITFunction.run (which compiles and returns
    the compiled kernel); later calls of that key pass the arguments to its launcher directly.

    The kernel's first ``pointers`` arguments are its tensors. The caller's key must fix the rest
    of what Triton specializes on, except the kernel's do_not_specialize arguments: every
    constexpr, the value of every other int argument, each pointer's dtype. The direct path is
    taken only for CUDA tensors that are all 16-byte aligned (Triton specializes on alignment),
    and the current device joins the key. Launch hooks (knobs.runtime.launch_enter_hook, e.g. a
    profiler's) are not called on the direct path. Under the CPU interpreter nothing is compiled
    and every call goes through the interpreter."""

    def __init__(self, fn, pointers: int, max_keys: int = 4096, runtime: bool = False) -> None:
        """runtime: one of the runtime's own kernels, direct only while RUNTIME_DIRECT_LAUNCH."""
        self.fn = fn
        self.names = tuple(fn.arg_names)
        self.pointers = pointers
        self.max_keys = max_keys
        self.runtime = runtime
        self._compiled: dict = {}

    def __call__(self, key: Hashable, grid: tuple, args: Sequence, constexprs: dict, options: dict) -> None:
        if DIRECT_LAUNCH and (RUNTIME_DIRECT_LAUNCH or not self.runtime) and args[0].is_cuda \
                and aligned16(*args[:self.pointers]):
            key = (key, torch._C._cuda_getDevice())
            hit = self._compiled.get(key)
            if hit is not None:
                kernel, tail = hit
                stream = torch._C._cuda_getCurrentRawStream(key[1])
                kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None,
                           None, *args, *tail)
                return
        else:
            key = None
        kernel = self.fn[grid](*args, **constexprs, **options)
        if key is not None and hasattr(kernel, "packed_metadata"):
            if len(self._compiled) >= self.max_keys:
                self._compiled.clear()
            # the parameters after the positional arguments, in the kernel's order (constexprs)
            self._compiled[key] = (kernel, tuple(constexprs[name] for name in self.names[len(args):]))


def int_kind(v: int) -> bool:
    """What Triton fixes about an int argument it does not specialize on (do_not_specialize):
    its type, 32 or 64 bits. A CompiledLaunch key holds this for such arguments, and the exact
    value of every other int argument."""
    return -(1 << 31) <= v < (1 << 31)


def aligned16(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's data pointer is 16-byte aligned (Triton specializes on it)."""
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    return bits & 15 == 0
