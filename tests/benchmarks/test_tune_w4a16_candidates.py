"""benchmarks/tune_w4a16.py's candidates for the M = 128 bucket (forty-third session): swap-AB over one or two
64-row x tiles or one of 128, split 1/2/4, and the plain tiles; each a valid config that computes the linear
(Triton's interpreter, a small shape, M between 64 and 128)."""

from __future__ import annotations

import os

import pytest
import torch

from optllm.benchmarks.tune_w4a16 import candidates
from optllm.kernels import w4a16 as w4k
from optllm.kernels.w4a16_configs import W4A16Config, m_bucket


def test_the_m128_bucket_has_its_own_candidates():
    c = candidates(128)
    assert m_bucket(100) == 128 and c[0].dequant  # the dequantize + cuBLAS path stays a candidate
    swap = [x for x in c if x.swap_ab]
    assert {x.block_m for x in swap} == {64, 128} and {x.split_k for x in swap} == {1, 2, 4}
    assert any(not x.swap_ab and not x.dequant for x in c)
    assert all(isinstance(x, W4A16Config) for x in c) and len(set(c)) == len(c)
    assert candidates(129) != c  # M = 129.. keep the M = 256 bucket's


def test_the_m256_bucket_tries_m128s_winners_first():
    # forty-sixth session: M = 128's swap-AB 64-row tiles split over K lead M = 256's sweep (its budget may end
    # before the plain tiles), which keeps the earlier candidates after them
    c = candidates(256)
    assert c[0].dequant and c[1] == W4A16Config(64, 64, 128, 1, 4, 3, swap_ab=True)
    assert W4A16Config(64, 128, 128, 4, 8, 3, swap_ab=True) in c[:37]
    assert any(not x.swap_ab and not x.dequant for x in c) and any(x.block_m == 256 for x in c)
    assert len(set(c)) == len(c)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="Triton runs on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("i", [1, 8, 20, 37])
def test_candidates_compute_the_linear(i):
    cfg = candidates(128)[i]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(i)
    q = torch.randint(-8, 8, (128, 256), generator=g, dtype=torch.int8)
    s = torch.rand(128, 2, generator=g) * 0.01 + 0.001
    w = w4k.prepack_w4a16(q.to(dev), s.to(dev), None, 128, dtype=torch.float32)
    x = torch.randn(100, 256, generator=g).to(dev)
    ref = x @ w4k.dequantize_w4a16(w).t()
    y = w4k.w4a16_gemm(x, w, config=cfg)
    assert (y - ref).norm() <= 1e-5 * ref.norm(), cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_m256_swap_ab_candidates_compute_the_down_shape_gpu():
    # forty-sixth session, H100: tune_w4a16.py's M = 256 sweep timed (128, 128, 64, split 4, 4 warps, swap-AB) fastest
    # on down (N 4096, K 14336) at a relative error of 0.45, and this test found 128-row swap-AB splits 2 and 4 at 8
    # warps wrong (0.018); kernels/w4a16._plan now runs 128-row swap-AB tiles unsplit. Every swap-AB candidate at that
    # shape, twice (the split-K counters must return to zero between calls)
    g = torch.Generator().manual_seed(5)
    n, k = 4096, 14336
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8).cuda()
    s = (torch.rand(n, k // 128, generator=g) * 0.002 + 0.001).to("cuda", torch.bfloat16)
    w = w4k.prepack_w4a16(q, s, None, 128)
    x = torch.randn(256, k, generator=g).to("cuda", torch.bfloat16)
    ref = x.float() @ w4k.dequantize_w4a16(w).t()
    wrong = []
    for cfg in [c for c in candidates(256) if c.swap_ab and c.block_m <= 128]:
        for _ in range(2):
            err = float((w4k.w4a16_gemm(x, w, config=cfg).float() - ref).norm() / ref.norm())
            if not err <= 1e-2:
                wrong.append((cfg, err))
        assert int(w.locks.abs().sum()) == 0, cfg
    assert not wrong, "; ".join(f"bm{c.block_m} bn{c.block_n} bk{c.block_k} k{c.split_k} w{c.num_warps}: {e:.3g}"
                                for c, e in wrong)
