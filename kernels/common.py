"""What the kernel families share: the program-to-tile order of the GEMMs, and whether
Triton runs on the CPU interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import triton
import triton.language as tl


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
