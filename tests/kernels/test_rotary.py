"""Rotary embedding kernel (in place on q and k) against the torch reference, and the
reference and cos/sin cache against HF's Llama rotary code, under TRITON_INTERPRET=1 on CPU.

Bounds, elementwise |out - ref| <= tol * max|x| of the head: float32 1e-6 (a fused
multiply-add or not); fp16 2^-10 and bf16 2^-7 on a GPU, one ulp of the largest element (both
round one float32 value once, which may differ in its last bits); the CPU interpreter truncates
to bf16: 2^-6 there. Against HF's bf16 apply_rotary_pos_emb (which rounds cos, sin and each
product to bf16): 2^-5 of the head's max. Dims past rotary_dim are bit-identical.
"""


import pytest
import torch

from optllm.kernels.rotary import apply_rotary, apply_rotary_ref, rotary_cos_sin

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7 if DEV == "cuda" else 2.0**-6}


def _inv_freq(rotary_dim, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


def _case(t, nq, nk, hd, dtype, seed, rotary_dim=None, max_pos=4096):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (nq + 2 * nk) * hd, generator=g).to(DEV, dtype)
    q, k = qkv[:, : nq * hd], qkv[:, nq * hd: (nq + nk) * hd]  # row stride (nq + 2 nk) hd
    pos = torch.randint(0, max_pos, (t,), generator=g).to(DEV)
    cache = rotary_cos_sin(_inv_freq(rotary_dim or hd).to(DEV), max_pos)
    return qkv, q, k, pos, cache


def _close(y, ref, hd):
    assert y.dtype == ref.dtype and y.shape == ref.shape
    scale = ref.float().reshape(ref.shape[0], -1, hd).abs().amax(-1, keepdim=True)
    err = (y.float() - ref.float()).reshape(scale.shape[0], -1, hd).abs()
    assert (err <= TOL[y.dtype] * scale).all(), float((err / scale).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,nq,nk,hd", [(1, 4, 2, 64), (7, 8, 8, 128), (33, 6, 1, 32), (3, 3, 2, 96)])
def test_in_place_matches_reference(t, nq, nk, hd, dtype):
    qkv, q, k, pos, cache = _case(t, nq, nk, hd, dtype, seed=t + hd)
    v_before = qkv[:, (nq + nk) * hd:].clone()
    q_ref, k_ref = apply_rotary_ref(pos, q, k, cache, hd)
    q_out, k_out = apply_rotary(pos, q, k, cache, hd)
    assert q_out is q and k_out is k
    _close(q, q_ref, hd)
    _close(k, k_ref, hd)
    assert torch.equal(qkv[:, (nq + nk) * hd:], v_before)  # v, beside k in memory, untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary(dtype):
    hd, rot = 64, 32
    qkv, q, k, pos, cache = _case(5, 4, 2, hd, dtype, seed=3, rotary_dim=rot)
    q0, k0 = q.clone(), k.clone()
    q_ref, k_ref = apply_rotary_ref(pos, q, k, cache, hd)
    apply_rotary(pos, q, k, cache, hd)
    _close(q, q_ref, hd)
    _close(k, k_ref, hd)
    for new, old in ((q, q0), (k, k0)):
        assert torch.equal(new.reshape(5, -1, hd)[..., rot:], old.reshape(5, -1, hd)[..., rot:])
        assert not torch.equal(new.reshape(5, -1, hd)[..., :rot], old.reshape(5, -1, hd)[..., :rot])


def test_torch_backend_is_in_place_reference():
    _, q, k, pos, cache = _case(4, 2, 1, 32, torch.float16, seed=9)
    q_ref, k_ref = apply_rotary_ref(pos, q, k, cache, 32)
    assert apply_rotary(pos, q, k, cache, 32, backend="torch") == (q, k)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_matches_hf_llama_rotary():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    t, nq, nk, hd = 6, 4, 2, 64
    cfg = LlamaConfig(hidden_size=nq * hd, num_attention_heads=nq, num_key_value_heads=nk,
                      max_position_embeddings=2048)
    hf = LlamaRotaryEmbedding(cfg).to(DEV)
    pos = torch.tensor([0, 1, 17, 500, 1999, 2047], device=DEV)
    x = torch.randn(t, (nq + nk) * hd, device=DEV)
    cos, sin = hf(x, pos[None])  # [1, T, hd] each: cat(freqs, freqs)
    cache = rotary_cos_sin(hf.inv_freq, 2048, hf.attention_scaling)
    assert torch.allclose(cache[pos], torch.cat((cos[0, :, : hd // 2], sin[0, :, : hd // 2]), -1),
                          rtol=0, atol=1e-6)
    assert torch.equal(cos[0, :, : hd // 2], cos[0, :, hd // 2:])
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        q, k = xd[:, : nq * hd].clone(), xd[:, nq * hd:].clone()
        cd, sd = hf(xd, pos[None])
        q_hf, k_hf = apply_rotary_pos_emb(q.view(1, t, nq, hd).transpose(1, 2),
                                          k.view(1, t, nk, hd).transpose(1, 2), cd, sd)
        apply_rotary(pos, q, k, cache, hd)
        tol = 1e-6 if dtype == torch.float32 else 2.0**-5
        for ours, theirs in ((q, q_hf), (k, k_hf)):
            theirs = theirs.transpose(1, 2).reshape(t, -1).float()
            assert ((ours.float() - theirs).abs() <= tol * theirs.abs().amax()).all()


def test_yarn_attention_scaling_scales_cos_and_sin():
    inv = _inv_freq(16)
    base, scaled = rotary_cos_sin(inv, 10), rotary_cos_sin(inv, 10, attention_scaling=1.25)
    assert scaled.shape == (10, 16) and scaled.dtype == torch.float32
    assert torch.allclose(scaled, base * 1.25, rtol=1e-7, atol=0)
    assert torch.equal(base[0], torch.cat((torch.ones(8), torch.zeros(8))))


def test_empty_and_bad_inputs():
    _, q, k, pos, cache = _case(3, 2, 1, 32, torch.bfloat16, seed=1)
    e = torch.empty(0, 64, device=DEV, dtype=torch.bfloat16)
    assert apply_rotary(pos[:0], e, e[:, :32], cache, 32)[0].shape == (0, 64)
    with pytest.raises(ValueError, match="q"):
        apply_rotary(pos, q[:, :50], k, cache, 32)
    with pytest.raises(ValueError, match="k"):
        apply_rotary(pos, q, k.float(), cache, 32)
    with pytest.raises(ValueError, match="k"):
        apply_rotary(pos, q, k[:2], cache, 32)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(pos[:2], q, k, cache, 32)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(pos.float(), q, k, cache, 32)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(pos, q, k, torch.zeros(16, 64, device=DEV), 32)  # rotary_dim > head_dim
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(pos, q, k, torch.zeros(16, 7, device=DEV), 32)  # odd
    with pytest.raises(ValueError, match="stride"):
        apply_rotary(pos, q.t().contiguous().t(), k, cache, 32, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        apply_rotary(pos, q, k, cache, 32, backend="cuda")
    with pytest.raises(ValueError, match="inv_freq"):
        rotary_cos_sin(torch.zeros(2, 2), 8)
    with pytest.raises(ValueError, match="max_position"):
        rotary_cos_sin(torch.zeros(4), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nq, nk", [(4, 2), (3, 3)])
def test_rotary_and_store_equals_the_two_kernels(dtype, nq, nk):
    """The fused rotary + KV store writes exactly what the rotary kernel then the store kernel
    write (same float32 math, one rounding): q bit-equal, the touched cache slots bit-equal,
    every other slot untouched (NaN), skipped tokens (slot -1) not written."""
    from optllm.kernels.paged_attention import store_kv_cache
    from optllm.kernels.rotary import apply_rotary_and_store

    g = torch.Generator().manual_seed(nq * 10 + nk)
    T, D, blocks, bs = 7, 16, 6, 4
    qkv = torch.randn(T, (nq + 2 * nk) * D, generator=g).to(DEV, dtype)
    q, k, v = qkv.split([nq * D, nk * D, nk * D], dim=1)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    cache = rotary_cos_sin(inv, 64).to(DEV)
    pos = torch.randint(0, 64, (T,), generator=g).to(DEV)
    slots = torch.randperm(blocks * bs, generator=g)[:T].to(DEV)
    slots[2] = -1
    kc = torch.full((blocks, nk, bs, D), float("nan"), dtype=dtype, device=DEV)
    vc = kc.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref, k_ref = apply_rotary(pos, q.clone(), k.clone(), cache, D)
    store_kv_cache(k_ref.view(T, nk, D), v.reshape(T, nk, D), kc_ref, vc_ref, slots)
    k_before = k.clone()
    apply_rotary_and_store(pos, q, k, v, cache, D, kc, vc, slots)
    assert torch.equal(q, q_ref) and torch.equal(k, k_before)
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(vc.isnan(), vc_ref.isnan())
    assert torch.equal(kc.nan_to_num(), kc_ref.nan_to_num()) and torch.equal(vc.nan_to_num(), vc_ref.nan_to_num())


def test_rotary_and_store_torch_backend_is_the_two_references():
    from optllm.kernels.paged_attention import store_kv_cache_ref
    from optllm.kernels.rotary import apply_rotary_and_store

    g = torch.Generator().manual_seed(5)
    T, D, nq, nk = 5, 8, 2, 1
    qkv = torch.randn(T, (nq + 2 * nk) * D, generator=g)
    q, k, v = qkv.split([nq * D, nk * D, nk * D], dim=1)
    cache = rotary_cos_sin(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)), 32)
    pos, slots = torch.arange(T) * 3, torch.tensor([0, 5, -1, 2, 7])
    kc, vc = torch.zeros(2, nk, 4, D), torch.zeros(2, nk, 4, D)
    kr, vr = kc.clone(), vc.clone()
    q_ref, k_ref = apply_rotary_ref(pos, q, k, cache, D)
    store_kv_cache_ref(k_ref.view(T, nk, D), v.reshape(T, nk, D), kr, vr, slots)
    apply_rotary_and_store(pos, q, k, v, cache, D, kc, vc, slots, backend="torch")
    assert torch.equal(q, q_ref) and torch.equal(kc, kr) and torch.equal(vc, vr)
