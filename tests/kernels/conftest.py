import pytest
import torch


@pytest.fixture
def heavy_tailed_rows():
    """make(m, k, seed) -> float32 [m, k] on CUDA: normal values scaled by 2^[-20, 20) per
    row and 2^[-8, 8) per element, so row scales and in-row magnitudes both vary widely."""
    def make(m, k, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(m, k, device="cuda", generator=g)
        x *= torch.exp2(torch.randint(-20, 20, (m, 1), device="cuda", generator=g).float())
        x *= torch.exp2(torch.randint(-8, 8, (m, k), device="cuda", generator=g).float())
        return x, g
    return make
