"""The runtime's own kernels (RMSNorm, rotary + KV store, extend attention, SiLU-and-mul) through
kernels/common.CompiledLaunch's direct launch (RUNTIME_DIRECT_LAUNCH): on fresh inputs of sizes
that change from call to call, a key's direct path gives JITFunction.run's bits, for each kernel
and for whole eager engine steps. The direct path exists only on CUDA; on the CPU the CPU-side
checks below run (the key's contents), the GPU tests are skipped."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import _cache_args, _extend_batch

from optllm.kernels import common
from optllm.kernels.activation import silu_and_mul
from optllm.kernels.extend_attention import paged_extend_attention
from optllm.kernels.rmsnorm import rms_norm
from optllm.kernels.rotary import apply_rotary_and_store

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _three_ways(monkeypatch, call):
    """call() through JITFunction.run, then twice with the direct launch on (a key's first call
    compiles through JITFunction.run, the second goes to the compiled launcher); each call
    returns a tuple of tensors (fresh inputs made inside); asserts them bit-equal."""
    monkeypatch.setattr(common, "RUNTIME_DIRECT_LAUNCH", True)
    outs = []
    for direct in (False, True, True):
        monkeypatch.setattr(common, "DIRECT_LAUNCH", direct)
        outs.append(call())
    for a, b, c in zip(*outs):
        assert torch.equal(a, b) and torch.equal(a, c)
    return outs[2]


def test_runtime_kernels_take_the_direct_path():
    # on by default since this file's GPU tests passed on the H200 (twentieth session)
    import os

    assert common.RUNTIME_DIRECT_LAUNCH is (os.environ.get("OPTLLM_RUNTIME_DIRECT_LAUNCH", "1") != "0")
    from optllm.kernels import activation, extend_attention, rmsnorm, rotary

    for launch in (rmsnorm._RMS, activation._SILU, rotary._ROTARY_STORE, extend_attention._EXTEND):
        assert launch.runtime
    assert common.int_kind(2 ** 31 - 1) and not common.int_kind(2 ** 31) and common.int_kind(-(2 ** 31))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_direct_gpu(monkeypatch, residual, dtype):
    g = torch.Generator().manual_seed(3)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to("cuda", dtype)
    for r in (1, 5, 16, 300):  # the row count is do_not_specialize: one key serves them all
        x = torch.randn(r, 576, generator=g).to("cuda", dtype)
        res = torch.randn(r, 576, generator=g).to("cuda", dtype) if residual else None
        out = _three_ways(monkeypatch, lambda: tuple(
            v for v in ((rms_norm(x, w, 1e-5, res),) if res is None else rms_norm(x, w, 1e-5, res))))
        ref = x.float() if res is None else x.float() + res.float()
        ref = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
        assert (out[0].float() - ref).norm() <= (2e-2 if dtype == torch.bfloat16 else 1e-5) * ref.norm()
    # a strided 3-D view (q heads of a fused qkv row), as the attention's q/k norms would pass
    qkv = torch.randn(9, 15 * 64, generator=g).to("cuda", dtype)
    q = qkv[:, :9 * 64].view(9, 9, 64)
    _three_ways(monkeypatch, lambda: (rms_norm(q, w[:64], 1e-5),))


@pytest.mark.gpu
@needs_cuda
def test_silu_and_mul_direct_gpu(monkeypatch):
    g = torch.Generator().manual_seed(4)
    for r in (1, 7, 64, 300):
        x = torch.randn(r, 2 * 1536, generator=g).to("cuda", torch.bfloat16)
        (out,) = _three_ways(monkeypatch, lambda: (silu_and_mul(x),))
        ref = torch.nn.functional.silu(x[:, :1536].float()) * x[:, 1536:].float()
        assert (out.float() - ref).norm() <= 1e-2 * ref.norm()


@pytest.mark.gpu
@needs_cuda
def test_rotary_and_store_direct_gpu(monkeypatch):
    g = torch.Generator().manual_seed(5)
    hd, nq, nk, bs, blocks = 64, 9, 3, 16, 40
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    ang = torch.arange(512).float()[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], -1).cuda()
    for t in (1, 9, 40, 130):
        qkv = torch.randn(t, (nq + 2 * nk) * hd, generator=g).to("cuda", torch.bfloat16)
        pos = torch.randint(0, 500, (t,), generator=g).cuda()
        slots = torch.randperm(blocks * bs, generator=g)[:t].cuda()
        slots[0] = -1  # a skipped row

        def call():
            q = qkv[:, :nq * hd].clone()
            k, v = qkv[:, nq * hd:(nq + nk) * hd], qkv[:, (nq + nk) * hd:]
            kc = torch.zeros(blocks, nk, bs, hd, device="cuda", dtype=torch.bfloat16)
            vc = torch.zeros_like(kc)
            apply_rotary_and_store(pos, q, k, v, cache, hd, kc, vc, slots)
            return q, kc, vc

        _three_ways(monkeypatch, call)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tree", [False, True])
def test_extend_attention_direct_gpu(monkeypatch, tree):
    for seed, pairs in enumerate(([(0, 17), (15, 1), (33, 20)], [(40, 1)] * 7 + [(3, 48)], [(100, 9)])):
        p, q, cu = _extend_batch(pairs, 3, 3, 64, 16, torch.bfloat16, seed=20 + seed)
        max_q = max(n for _, n in pairs)
        kw = {}
        if tree:  # causal trees as flat masks, one [n, n] block a sequence
            blocks = [torch.ones(n, n, dtype=torch.bool).tril() for _, n in pairs]
            offs = [0] + torch.tensor([n * n for _, n in pairs]).cumsum(0).tolist()[:-1]
            kw = dict(mask=torch.cat([b.flatten() for b in blocks]).cuda(),
                      mask_offsets=torch.tensor(offs, dtype=torch.int64, device="cuda"))
        # out zeroed: the padding row past the last sequence is never written
        _three_ways(monkeypatch, lambda: (paged_extend_attention(q, *_cache_args(p), cu, max_q, 0.125,
                                                                 out=torch.zeros_like(q), **kw),))


@pytest.mark.gpu
@needs_cuda
def test_eager_engine_steps_direct_gpu(monkeypatch, tiny_llama):
    """Whole eager steps (prefills and mixed steps: enforce_eager), greedy, bfloat16: the same
    tokens with the runtime's kernels on the direct path as through JITFunction.run."""
    from optllm.runtime.llm import LLM
    from optllm.runtime.sampling_params import SamplingParams

    llm = LLM(str(tiny_llama), device="cuda", dtype="bfloat16", enforce_eager=True, max_num_seqs=3)
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]  # six requests, three at a time: mixed steps
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(6)]
    monkeypatch.setattr(common, "RUNTIME_DIRECT_LAUNCH", False)
    jit = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(common, "RUNTIME_DIRECT_LAUNCH", True)
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == jit

