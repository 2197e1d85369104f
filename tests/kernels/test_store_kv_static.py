"""store_kv_cache with static (calibrated) FP8 scales, under TRITON_INTERPRET=1 on CPU.

A checkpoint's kv_cache_scheme gives each layer's K and V one scale per KV head (per tensor: one
scale repeated); the store quantizes with it instead of each row's amax and writes it into the
scale cache, so the attention kernels read static and dynamic caches alike.

Bounds:
    store: bit-exact against ``store_kv_cache_ref`` (fp8 values and scales).
    in-range values: |dequantized - x| <= 2^-4 |x| + 2^-9 scale (E4M3 keeps 3 mantissa bits;
        below 2^-6 the subnormal step is 2^-9 scale).
    out-of-range values: saturate to exactly +-448 * scale, never NaN.
    decode attention over the static cache: 2e-5 against the reference on the same cache.
"""

import pytest
import torch

from optllm.kernels.paged_attention import (
    FP8_DTYPE,
    paged_decode_attention,
    paged_decode_attention_ref,
    store_kv_cache,
    store_kv_cache_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T, HQ, H, D, BS, NB = 9, 4, 3, 20, 4, 6  # head_dim 20: not a power of two (masked lanes)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(2 * T, HQ + 2 * H, D, generator=g) * 3
    qkv[:, HQ + 1] *= 40  # kv head 1 of k: rows far past its calibrated range (saturate)
    qkv = qkv.to(DEVICE)
    k, v = qkv[::2, HQ:HQ + H], qkv[::2, HQ + H:]  # strided views, as the fused QKV output gives them
    k[4, 2] = 0.0  # an all-zero row: zeros, no NaN
    slots = torch.randperm(NB * BS, generator=g)[:T]
    slots[[1, 6]] = -1  # skipped tokens
    return g, k, v, slots.to(DEVICE)


def _caches(g, n=2):
    fill = torch.randn(NB, H, BS, D, generator=g).to(DEVICE, FP8_DTYPE)
    return [fill.clone() for _ in range(2 * n)], [torch.full((NB, H, BS), 7.0, device=DEVICE) for _ in range(2 * n)]


@pytest.mark.parametrize("per_tensor", [False, True])
def test_static_store_matches_reference_and_saturates(per_tensor):
    g, k, v, slots = _inputs()
    if per_tensor:  # compressed-tensors' strategy "tensor": one scale, repeated per head
        sk, sv = torch.full((H,), 0.011, device=DEVICE), torch.full((H,), 0.007, device=DEVICE)
    else:
        sk = torch.tensor([0.02, 0.013, 0.5], device=DEVICE)
        sv = torch.tensor([0.008, 0.03, 0.011], device=DEVICE)
    caches, scales = _caches(g)
    store_kv_cache(k, v, caches[0], caches[1], slots, scales[0], scales[1], backend="triton",
                   static_k_scale=sk, static_v_scale=sv)
    store_kv_cache_ref(k, v, caches[2], caches[3], slots, scales[2], scales[3], sk, sv)
    for a, b in ((0, 2), (1, 3)):
        assert torch.equal(caches[a].view(torch.uint8), caches[b].view(torch.uint8))
        assert torch.equal(scales[a], scales[b])
    keep = slots >= 0
    blk, off = slots[keep] // BS, slots[keep] % BS
    for x, cache, sc, s in ((k, caches[0], scales[0], sk), (v, caches[1], scales[1], sv)):
        # the scale cache holds the static scale at every written slot, and only there
        assert torch.equal(sc[blk, :, off], s.expand(int(keep.sum()), H))
        written = torch.zeros(NB, BS, dtype=torch.bool, device=DEVICE)
        written[blk, off] = True
        assert bool((sc.permute(0, 2, 1)[~written] == 7.0).all())
        stored = cache[blk, :, off].float()
        assert not torch.isnan(stored).any()
        deq = stored * s[None, :, None]
        x = x[keep].float()
        inside = x.abs() <= 448 * s[None, :, None]
        err = (deq - x).abs()
        assert bool((err[inside] <= (x.abs() / 16 + s[None, :, None].expand_as(x) / 512)[inside]).all())
        # past the calibrated range: exactly +-448 * scale
        outside = ~inside
        assert torch.equal(stored[outside], 448.0 * x[outside].sign())
    assert int((~(k[keep].abs() <= 448 * sk[None, :, None])).sum()) > 0, "the test must exercise saturation"


def test_static_and_dynamic_differ_only_in_the_scales():
    """A static scale equal to a row's own dynamic one stores the same bits; a different one does not."""
    g, k, v, slots = _inputs(1)
    caches, scales = _caches(g)
    store_kv_cache(k, v, caches[0], caches[1], slots, scales[0], scales[1], backend="triton")
    t = int(torch.nonzero(slots >= 0)[0])
    blk, off = slots[t] // BS, slots[t] % BS
    sk, sv = scales[0][blk, :, off].clone(), scales[1][blk, :, off].clone()  # token t's dynamic scales
    store_kv_cache(k, v, caches[2], caches[3], slots, scales[2], scales[3], backend="triton",
                   static_k_scale=sk, static_v_scale=sv)
    assert torch.equal(caches[0][blk, :, off].view(torch.uint8), caches[2][blk, :, off].view(torch.uint8))
    assert torch.equal(scales[2][blk, :, off], sk)


def test_decode_attention_reads_a_static_cache():
    g = torch.Generator().manual_seed(2)
    seq_lens = [7, 13]
    nblk = [-(-n // BS) for n in seq_lens]
    bt = torch.zeros(len(seq_lens), max(nblk), dtype=torch.int32)
    ids = torch.randperm(NB, generator=g)
    bt[0, :nblk[0]], bt[1, :nblk[1]] = ids[:nblk[0]].int(), ids[nblk[0]:nblk[0] + nblk[1]].int()
    slots = torch.cat([bt[b, torch.arange(n) // BS].long() * BS + torch.arange(n) % BS for b, n in enumerate(seq_lens)])
    n = sum(seq_lens)
    k, v = torch.randn(n, H, D, generator=g).to(DEVICE), torch.randn(n, H, D, generator=g).to(DEVICE)
    sk = (k.abs().amax(dim=(0, 2)) / 448).contiguous()
    sv = (v.abs().amax(dim=(0, 2)) / 448).contiguous()
    kc = torch.zeros(NB, H, BS, D, device=DEVICE).to(FP8_DTYPE)
    vc = kc.clone()
    ks, vs = torch.zeros(NB, H, BS, device=DEVICE), torch.zeros(NB, H, BS, device=DEVICE)
    store_kv_cache(k, v, kc, vc, slots.to(DEVICE), ks, vs, backend="triton", static_k_scale=sk, static_v_scale=sv)
    q = torch.randn(len(seq_lens), H * 2, D, generator=g).to(DEVICE)
    args = (q, kc, vc, bt.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), D ** -0.5)
    out = paged_decode_attention(*args, k_scale=ks, v_scale=vs, backend="triton")
    ref = paged_decode_attention_ref(*args, k_scale=ks, v_scale=vs)
    err = float((out - ref).abs().max() / ref.abs().max())
    assert err <= 2e-5, err


def test_static_scales_are_checked():
    g, k, v, slots = _inputs()
    caches, scales = _caches(g, 1)
    s = torch.ones(H, device=DEVICE)
    with pytest.raises(ValueError, match="both static scales or neither"):
        store_kv_cache(k, v, caches[0], caches[1], slots, scales[0], scales[1], static_k_scale=s)
    with pytest.raises(ValueError, match="static_v_scale"):
        store_kv_cache(k, v, caches[0], caches[1], slots, scales[0], scales[1], static_k_scale=s,
                       static_v_scale=torch.ones(H + 1, device=DEVICE))
    plain = torch.zeros(NB, H, BS, D, device=DEVICE)
    with pytest.raises(ValueError, match="only float8_e4m3fn caches take static scales"):
        store_kv_cache(k, v, plain, plain.clone(), slots, static_k_scale=s, static_v_scale=s)
