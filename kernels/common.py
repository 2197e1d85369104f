"""What the kernel families share: the program-to-tile order of the GEMMs, whether Triton
runs on the CPU interpreter (TRITON_INTERPRET=1), the backend choice every wrapper makes,
and host-side launch arithmetic."""

from __future__ import annotations

import os

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
