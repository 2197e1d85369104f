#!/usr/bin/env bash
# Nsight Compute on the W4A16 kernels at decode sizes (Llama-3-8B gate_up and qkv, M = 1 and
# 16), on the lent H200: speed of light, memory and warp-stall sections, one launch each.
set -uo pipefail
export PYTHONPATH=$(dirname "$PWD")
ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
cat > /tmp/ncu_w4a16.py <<'PY'
import torch
from optllm.kernels import w4a16 as w4k
for n, k in ((28672, 4096), (6144, 4096)):
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device="cuda")
    s = (torch.rand(n, k // 128, device="cuda") * 1e-3).to(torch.bfloat16)
    w = w4k.prepack_w4a16(q, s, None, 128)
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w4k.w4a16_gemm(x, w)
torch.cuda.synchronize()
PY
ncu --kernel-name regex:_w4a16 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 /tmp/ncu_w4a16.py > "${OUT:-.}/ncu_w4a16.txt" 2>&1
grep -E "w4a16|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" "${OUT:-.}/ncu_w4a16.txt" | head -60
