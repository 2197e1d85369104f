"""kernels/common.CompiledLaunch's bookkeeping, with a stand-in for a Triton kernel (the real
direct launch is checked on the GPU: test_*::test_direct_launch_equals_the_jit_path_gpu)."""

import pytest
import torch

from optllm.kernels import common
from optllm.kernels.common import CompiledLaunch, aligned16


class _Compiled:
    """What JITFunction.run returns: a compiled kernel with a launcher."""

    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *a):
        self.log.append(("direct", a))


class _Jit:
    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]

    def __init__(self, compiles=True):
        self.log = []
        self.compiles = compiles

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return _Compiled(self.log) if self.compiles else None  # the interpreter returns no kernel
        return launch


class _Ptr:
    """A CUDA tensor as CompiledLaunch sees a pointer argument."""

    def __init__(self, addr=256, cuda=True):
        self.addr, self.is_cuda = addr, cuda

    def data_ptr(self):
        return self.addr


X = _Ptr()


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1234, raising=False)


def test_first_call_compiles_then_the_launcher_gets_every_argument_in_order(fake_cuda):
    jit = _Jit()
    launch = CompiledLaunch(jit, pointers=1)
    for n in (7, 8):  # the key fixes the specialization; the values passed may differ
        launch("k", (3, 1, 1), (X, n), {"FLAG": True, "BLOCK": 64}, {"num_warps": 4})
    assert jit.log[0] == ("jit", (3, 1, 1), (X, 7), {"FLAG": True, "BLOCK": 64, "num_warps": 4})
    # grid, stream, function, metadata, no launch metadata or hooks, then the arguments and the
    # constexprs in the kernel's parameter order (BLOCK before FLAG)
    assert jit.log[1] == ("direct", (3, 1, 1, 1234, "fn-handle", "meta", None, None, None, X, 8, 64, True))
    assert len(jit.log) == 2


def test_no_direct_launch_off_cuda_unaligned_or_switched_off_and_no_kernel_no_cache(fake_cuda, monkeypatch):
    jit = _Jit()
    launch = CompiledLaunch(jit, pointers=1)
    for ptr in (_Ptr(cuda=False), _Ptr(addr=258)):  # a CPU tensor (the interpreter), a pointer off 16 bytes
        for _ in range(2):
            launch("k", (1, 1, 1), (ptr, 1), {"BLOCK": 1, "FLAG": False}, {})
    monkeypatch.setattr(common, "DIRECT_LAUNCH", False)
    for _ in range(2):
        launch("k", (1, 1, 1), (X, 1), {"BLOCK": 1, "FLAG": False}, {})
    assert [e[0] for e in jit.log] == ["jit"] * 6 and not launch._compiled
    monkeypatch.setattr(common, "DIRECT_LAUNCH", True)
    interpreted = _Jit(compiles=False)
    launch = CompiledLaunch(interpreted, pointers=1)
    for _ in range(2):
        launch("k", (1, 1, 1), (X, 1), {"BLOCK": 1, "FLAG": False}, {})
    assert [e[0] for e in interpreted.log] == ["jit"] * 2 and not launch._compiled


def test_the_key_cache_is_bounded(fake_cuda):
    launch = CompiledLaunch(_Jit(), pointers=1, max_keys=3)
    for key in range(7):
        launch(key, (1, 1, 1), (X, 1), {"BLOCK": 1, "FLAG": False}, {})
    assert 1 <= len(launch._compiled) <= 3


def test_aligned16():
    t = torch.zeros(64, dtype=torch.bfloat16)
    assert aligned16(t, t[8:])
    assert not aligned16(t, t[1:])
