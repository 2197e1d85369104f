"""Paged KV cache kernels (store, decode, extend) under TRITON_INTERPRET=1 on CPU.

Every batch is written through ``store_kv_cache`` into a NaN-filled cache at shuffled,
non-contiguous block ids; unused block-table entries point at NaN blocks, so a kernel that
reads past a sequence's keys (or a garbage table entry) returns NaN. Outputs are checked
against the float32 torch references (``*_ref``) and against plain dense float64 attention on
the un-paged K/V, so the paging itself is checked, not only kernel == reference.

Error bounds (max |out - expected| / max |expected|):
    fp32 q and cache: 2e-5 against both the reference and the float64 dense attention.
    bf16 q and cache: 2e-2 (the dense attention uses the same bf16-rounded q, K, V; the kernel
        rounds the output to bf16, 2^-9, and on a GPU p to bf16 before the p.V dot; measured
        3e-3 to 6e-3). fp16 q: 5e-3 (the same roundings at 2^-11).
    fp8 cache, fp32 q, against the reference on the same fp8 cache: 2e-5; against attention
        on the unquantized K/V: 0.1 (E4M3 keeps 3 mantissa bits: up to 2^-4 relative error
        per element; measured about 0.03 here).
    store_kv_cache: bit-exact against ``store_kv_cache_ref`` (fp8 values and scales included).
"""


import pytest
import torch

from optllm.kernels.extend_attention import (
    BIG_TILE_ROWS,
    extend_num_splits,
    extend_tiles,
    paged_extend_attention,
    paged_extend_attention_ref,
)
from optllm.kernels.paged_attention import (
    FP8_DTYPE,
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    sm_count,
    store_kv_cache,
    store_kv_cache_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUND = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
FP8_LOOSE = 0.1


def _paged(seq_lens, h, d, bs, cache_dtype, seed, spare=3):
    """Random K/V for sequences of seq_lens, stored into a paged cache; returns a dict with the
    caches, block_tables, seq_lens and the dense K/V (float64, as stored; 'k_raw' unrounded)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // bs) for n in seq_lens]
    total = sum(nblk) + spare
    ids = torch.randperm(total, generator=g)
    used, poison = ids[:sum(nblk)], ids[sum(nblk):]
    bt = poison[torch.randint(0, spare, (len(seq_lens), max(nblk) + 2), generator=g)].int()
    for b, (start, nb) in enumerate(zip([0] + torch.tensor(nblk).cumsum(0).tolist(), nblk)):
        bt[b, :nb] = used[start:start + nb].int()
    k_raw = [torch.randn(n, h, d, generator=g) for n in seq_lens]
    v_raw = [torch.randn(n, h, d, generator=g) for n in seq_lens]
    kc = torch.full((total, h, bs, d), float("nan")).to(DEVICE, cache_dtype)
    vc = kc.clone()
    fp8 = cache_dtype == FP8_DTYPE
    ks = torch.full((total, h, bs), float("nan"), device=DEVICE) if fp8 else None
    vs = ks.clone() if fp8 else None
    slots = torch.cat([bt[b, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
                       for b, n in enumerate(seq_lens)])
    src = torch.float32 if fp8 else cache_dtype
    store_kv_cache(torch.cat(k_raw).to(DEVICE, src), torch.cat(v_raw).to(DEVICE, src), kc, vc,
                   slots.to(DEVICE), ks, vs)
    as_stored = (lambda x: x.double()) if fp8 else (lambda x: x.to(cache_dtype).double())
    return dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs, block_tables=bt.to(DEVICE),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                k=[as_stored(x) for x in k_raw], v=[as_stored(x) for x in v_raw])


def _cache_args(p):
    return p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"]


def _dense(q, k, v, visible, scale):
    """float64 attention: q [L, Hq, D], k/v [n, Hkv, D], visible bool [L, n]."""
    grp = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(grp, 1), v.repeat_interleave(grp, 1)
    s = torch.einsum("lhd,nhd->hln", q.double().cpu(), k) * scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hln,nhd->lhd", p, v)


def _close(out, expect, bound):
    out, expect = out.double().cpu(), expect.double().cpu()
    assert not torch.isnan(out).any(), "NaN: a row was not written, or a poisoned slot was read"
    err = ((out - expect).abs().max() / expect.abs().max()).item()
    assert err <= bound, f"relative error {err:.2e} > {bound:.0e}"
    return err


def _decode_dense(q, p, scale, window=0):
    outs = []
    for b, n in enumerate(p["seq_lens"].tolist()):
        j = torch.arange(n)
        vis = (n - 1 - j < window) if window else torch.ones(n, dtype=torch.bool)
        outs.append(_dense(q[b:b + 1], p["k"][b], p["v"][b], vis[None, :], scale))
    return torch.cat(outs)


# --------------------------------------------------------------------------- store
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, FP8_DTYPE])
def test_store_kv_cache_matches_reference(cache_dtype):
    g = torch.Generator().manual_seed(1)
    t, hq, h, d, bs, nb = 11, 4, 2, 24, 8, 6
    src = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    # k, v: strided views into a fused qkv output, every other token
    qkv = (torch.randn(2 * t, hq + 2 * h, d, generator=g) * 3).to(DEVICE, src)
    k, v = qkv[::2, hq:hq + h], qkv[::2, hq + h:]
    k[3, 1] = 0.0  # an all-zero row: scale floors at SCALE_EPS, values 0, no NaN
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots = torch.where(torch.isin(torch.arange(t), torch.tensor([2, 7])), -1, slots).to(DEVICE)
    fill = torch.randn(nb, h, bs, d, generator=g).to(DEVICE, cache_dtype)
    caches = [fill.clone() for _ in range(4)]
    scales = [torch.full((nb, h, bs), 7.0, device=DEVICE) if cache_dtype == FP8_DTYPE else None for _ in range(4)]
    store_kv_cache(k, v, caches[0], caches[1], slots, scales[0], scales[1], backend="triton")
    store_kv_cache_ref(k, v, caches[2], caches[3], slots, scales[2], scales[3])
    bits = (lambda x: x.view(torch.uint8)) if cache_dtype == FP8_DTYPE else (lambda x: x)
    for a, b in ((0, 2), (1, 3)):
        assert torch.equal(bits(caches[a]), bits(caches[b]))
        if scales[a] is not None:
            assert torch.equal(scales[a], scales[b])
    assert not torch.isnan(caches[0].float()).any()
    # slots of skipped tokens and slots nobody wrote are untouched
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = (~written).view(nb, bs)
    assert torch.equal(bits(caches[0]).permute(0, 2, 1, 3)[untouched.to(DEVICE)],
                       bits(fill).permute(0, 2, 1, 3)[untouched.to(DEVICE)])
    if cache_dtype != FP8_DTYPE:  # plain caches hold the values themselves
        blk, off = slots[0] // bs, slots[0] % bs
        assert torch.equal(caches[0][blk, :, off], k[0].to(cache_dtype))


# --------------------------------------------------------------------------- decode
DECODE_LENS = [1, 15, 17, 33, 100]


@pytest.mark.parametrize("group,bs,d,dtype", [
    (1, 8, 32, torch.float32),
    (2, 16, 64, torch.float32),
    (3, 64, 80, torch.float32),   # G and head_dim not powers of two, 64-token blocks
    (4, 32, 32, torch.bfloat16),
])
def test_decode_matches_dense_and_reference(group, bs, d, dtype):
    h = 2
    p = _paged(DECODE_LENS, h, d, bs, dtype, seed=group * 10 + bs)
    g = torch.Generator().manual_seed(group)
    q = torch.randn(len(DECODE_LENS), h * group, d, generator=g).to(DEVICE, dtype)
    scale = d ** -0.5
    dense = _decode_dense(q, p, scale)
    ref = paged_decode_attention_ref(q, *_cache_args(p), scale)
    _close(ref, dense, BOUND[dtype])
    # 1 split, several, more splits than the shorter sequences have blocks, the default
    for splits in (1, 3, 8, None):
        out = torch.full_like(q, float("nan"))
        got = paged_decode_attention(q, *_cache_args(p), scale, num_splits=splits, out=out)
        assert got is out and out.dtype == dtype
        _close(out, ref, BOUND[dtype])
        _close(out, dense, BOUND[dtype])


def test_decode_sliding_window():
    p = _paged(DECODE_LENS, 2, 32, 8, torch.float32, seed=3)
    q = torch.randn(len(DECODE_LENS), 4, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    for window, splits in ((1, 2), (5, 1), (16, 4), (40, 3), (1000, 2)):
        dense = _decode_dense(q, p, 0.2, window)
        ref = paged_decode_attention_ref(q, *_cache_args(p), 0.2, sliding_window=window)
        _close(ref, dense, 2e-5)
        out = paged_decode_attention(q, *_cache_args(p), 0.2, sliding_window=window, num_splits=splits)
        _close(out, dense, 2e-5)


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_fp8_cache(qdtype):
    p = _paged(DECODE_LENS, 2, 32, 16, FP8_DTYPE, seed=5)
    q = torch.randn(len(DECODE_LENS), 4, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE, qdtype)
    fp8 = dict(k_scale=p["k_scale"], v_scale=p["v_scale"])
    ref = paged_decode_attention_ref(q, *_cache_args(p), 0.2, **fp8)
    out = paged_decode_attention(q, *_cache_args(p), 0.2, num_splits=3, **fp8)
    _close(out, ref, BOUND[qdtype])
    _close(out, _decode_dense(q, p, 0.2), FP8_LOOSE)  # p["k"] is the unquantized K


def test_decode_empty_sequence_gives_zeros():
    p = _paged([5, 9], 1, 16, 8, torch.float32, seed=7)
    p["seq_lens"][1] = 0  # e.g. a padding slot of a CUDA-graph batch
    q = torch.randn(2, 2, 16, device=DEVICE)
    for splits in (1, 2):
        out = paged_decode_attention(q, *_cache_args(p), 0.25, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        _close(out[:1], _dense(q[:1], p["k"][0], p["v"][0], torch.ones(1, 5, dtype=torch.bool), 0.25), 2e-5)


# --------------------------------------------------------------------------- extend
def _extend_batch(pairs, h, group, d, bs, dtype, seed):
    """pairs: (prefix, q_len) per sequence; one padding row after the last sequence."""
    p = _paged([a + b for a, b in pairs], h, d, bs, dtype, seed)
    cu = [0] + torch.tensor([n for _, n in pairs]).cumsum(0).tolist()
    qdtype = torch.float32 if dtype == FP8_DTYPE else dtype
    q = torch.randn(cu[-1] + 1, h * group, d, generator=torch.Generator().manual_seed(seed)).to(DEVICE, qdtype)
    return p, q, torch.tensor(cu, dtype=torch.int32, device=DEVICE)


def _extend_dense(q, p, cu, scale, trees=None, window=0):
    outs = []
    for b, n in enumerate(p["seq_lens"].tolist()):
        s, e = int(cu[b]), int(cu[b + 1])
        pos = n - (e - s) + torch.arange(e - s)[:, None]
        j = torch.arange(n)[None, :]
        vis = j <= pos
        if trees is not None and trees[b] is not None:  # None: that sequence causal
            vis = torch.cat([torch.ones(e - s, n - trees[b].shape[1], dtype=torch.bool), trees[b]], 1)
        if window:
            vis &= pos - j < window
        outs.append(_dense(q[s:e], p["k"][b], p["v"][b], vis, scale))
    return torch.cat(outs)


def _run_extend(p, q, cu, max_q, scale, **kw):
    out = torch.full_like(q, float("nan"))
    got = paged_extend_attention(q, *_cache_args(p), cu, max_q, scale, out=out, **kw)
    assert got is out
    assert torch.isnan(out[-1]).all(), "the padding row past the last sequence was written"
    kw.pop("num_splits", None)
    ref = paged_extend_attention_ref(q, *_cache_args(p), cu, scale, **kw)
    return out[:-1], ref[:-1]


@pytest.mark.parametrize("group,bs,d,dtype", [
    (1, 8, 32, torch.float32),
    (3, 16, 32, torch.float32),
    (4, 64, 64, torch.bfloat16),
])
def test_extend_causal(group, bs, d, dtype):
    pairs = [(0, 17), (15, 1), (33, 20), (0, 1), (100, 9)]
    p, q, cu = _extend_batch(pairs, 2, group, d, bs, dtype, seed=11 + group)
    out, ref = _run_extend(p, q, cu, 20, d ** -0.5)
    dense = _extend_dense(q, p, cu, d ** -0.5)
    _close(ref, dense, BOUND[dtype])
    _close(out, ref, BOUND[dtype])
    _close(out, dense, BOUND[dtype])


def test_extend_sliding_window():
    pairs = [(0, 40), (30, 9), (5, 3)]
    p, q, cu = _extend_batch(pairs, 2, 2, 32, 8, torch.float32, seed=17)
    for window in (1, 7, 20):
        out, _ = _run_extend(p, q, cu, 40, 0.2, sliding_window=window)
        _close(out, _extend_dense(q, p, cu, 0.2, window=window), 2e-5)


def test_chunked_prefill_equals_one_shot():
    n, h, group, d = 45, 2, 2, 32
    p = _paged([n], h, d, 8, torch.float32, seed=19)
    q = torch.randn(n, h * group, d, generator=torch.Generator().manual_seed(19)).to(DEVICE)
    args = (p["k_cache"], p["v_cache"], p["block_tables"])
    cu = lambda m: torch.tensor([0, m], dtype=torch.int32, device=DEVICE)  # noqa: E731
    lens = lambda m: torch.tensor([m], dtype=torch.int32, device=DEVICE)  # noqa: E731
    one = paged_extend_attention(q, *args, lens(n), cu(n), n, 0.2)
    first = paged_extend_attention(q[:20], *args, lens(20), cu(20), 20, 0.2)
    second = paged_extend_attention(q[20:], *args, lens(n), cu(n - 20), n - 20, 0.2)
    _close(torch.cat([first, second]), one, 2e-6)
    _close(one, _extend_dense(q, p, cu(n).cpu(), 0.2), 2e-5)
    # the last token alone through decode attention agrees too
    dec = paged_decode_attention(q[-1:], *args, lens(n), 0.2, num_splits=2)
    _close(dec, one[-1:], 2e-6)


def _ancestor_mask(n, g):
    """A random token tree: node i's parent is a random earlier node or the prefix (-1)."""
    parent = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parent[j]
    return m


def test_extend_tiles_keep_token_trees_on_64_row_tiles():
    # a tree verify's rows (nodes x group) stay on 64-row tiles, split across programs, below BIG_TILE_ROWS;
    # long prefill runs take the 128 x 128, 8-warp tiles (forty-fifth session: one 128-row tile made a
    # 41-node tree's attention 3x a 20-node one's on the H100)
    for n in (20, 41, 81, 127):
        assert extend_tiles(n, 3, 64)[:3] == (64, 64, 4), n
        assert extend_tiles(n, 4, 128)[:3] == (64, 64, 4), n
    assert extend_tiles(BIG_TILE_ROWS // 4, 4, 128) == (128, 128, 8, 3)
    assert extend_tiles(4096, 4, 128) == (128, 128, 8, 3)
    assert extend_tiles(5, 3, 64)[0] == 16 and extend_tiles(10, 3, 64)[0] == 32
    assert extend_tiles(4096, 4, 256)[:2] == (64, 32)  # head_dim 256: half tiles, as before
    assert extend_tiles(4096, 4, 128, elem_bytes=4) == (128, 64, 8, 2)


@pytest.mark.parametrize("group,dtype,window", [(1, torch.float32, 0), (3, torch.float32, 12),
                                                (2, torch.bfloat16, 0)])
def test_extend_tree_mask(group, dtype, window):
    g = torch.Generator().manual_seed(23)
    pairs = [(20, 7), (0, 12), (33, 1), (64, 26)]
    p, q, cu = _extend_batch(pairs, 2, group, 32, 16, dtype, seed=23 + group)
    trees = [_ancestor_mask(n, g) for _, n in pairs]
    sizes = [n * n for _, n in pairs]
    mask = torch.cat([t.flatten() for t in trees]).to(DEVICE)
    offsets = torch.tensor([0] + sizes[:-1], dtype=torch.int64).cumsum(0).to(DEVICE)
    out, ref = _run_extend(p, q, cu, 26, 0.2, mask=mask, mask_offsets=offsets, sliding_window=window)
    dense = _extend_dense(q, p, cu.cpu(), 0.2, trees=trees, window=window)
    _close(ref, dense, BOUND[dtype])
    _close(out, ref, BOUND[dtype])
    _close(out, dense, BOUND[dtype])


@pytest.mark.parametrize("group,dtype", [(1, torch.float32), (2, torch.bfloat16)])
def test_extend_tree_masks_beside_causal_sequences(group, dtype):
    """A speculative step's verify forward with prefill chunks folded in: sequences whose
    mask offset is negative are causal, the others read their tree block; the long causal chunks
    size the tiles (several query tiles a sequence), so a tree sequence's later tiles stay idle."""
    g = torch.Generator().manual_seed(31)
    pairs = [(0, 70), (20, 7), (9, 33), (40, 12), (64, 1), (5, 1)]
    causal = [True, False, True, False, False, True]
    p, q, cu = _extend_batch(pairs, 2, group, 32, 16, dtype, seed=31 + group)
    trees = [None if c else _ancestor_mask(n, g) for (_, n), c in zip(pairs, causal)]
    flat = [t.flatten() for t in trees if t is not None]
    offsets, at = [], 0
    for t in trees:
        offsets.append(-1 if t is None else at)
        at += 0 if t is None else t.numel()
    mask = torch.cat(flat).to(DEVICE)
    off = torch.tensor(offsets, dtype=torch.int64, device=DEVICE)
    out, ref = _run_extend(p, q, cu, 70, 0.2, mask=mask, mask_offsets=off)
    dense = _extend_dense(q, p, cu.cpu(), 0.2, trees=trees)
    _close(ref, dense, BOUND[dtype])
    _close(out, ref, BOUND[dtype])
    _close(out, dense, BOUND[dtype])
    # the causal sequences' rows equal a causal launch's (the trees' rows differ from one)
    plain, _ = _run_extend(p, q, cu, 70, 0.2)
    rows = [r for b, c in enumerate(causal) if c for r in range(int(cu[b]), int(cu[b + 1]))]
    _close(out[rows], plain[rows], BOUND[dtype])


@pytest.mark.parametrize("group,dtype,extra", [(1, torch.float32, 8), (2, torch.bfloat16, 16), (2, torch.float32, 0)])
def test_extend_mask_over_keys_before_the_new_tokens(group, dtype, extra):
    """mask_cols C > q_len: each mask row covers the last C keys, the new tokens' own and the C -
    q_len before them (an EAGLE-2 level's rows over the rows earlier levels wrote); keys before
    those are all visible. Beside a causal sequence (negative offset) in the same launch."""
    g = torch.Generator().manual_seed(37 + extra)
    q_len = 8
    cols = q_len + extra
    pairs = [(cols - q_len + 30, q_len), (cols - q_len, q_len), (50, 21), (cols - q_len + 3, q_len)]
    causal = [False, False, True, False]
    p, q, cu = _extend_batch(pairs, 2, group, 32, 16, dtype, seed=41 + extra)
    trees = []
    for c in causal:
        if c:
            trees.append(None)
            continue
        m = torch.rand(q_len, cols, generator=g) < 0.4
        m[torch.arange(q_len), cols - q_len + torch.arange(q_len)] = True  # each row sees itself
        trees.append(m)
    offsets, at = [], 0
    for t in trees:
        offsets.append(-1 if t is None else at)
        at += 0 if t is None else t.numel()
    mask = torch.cat([t.flatten() for t in trees if t is not None]).to(DEVICE)
    off = torch.tensor(offsets, dtype=torch.int64, device=DEVICE)
    out, ref = _run_extend(p, q, cu, 21, 0.2, mask=mask, mask_offsets=off, mask_cols=cols)
    dense = _extend_dense(q, p, cu.cpu(), 0.2, trees=trees)
    _close(ref, dense, BOUND[dtype])
    _close(out, ref, BOUND[dtype])
    _close(out, dense, BOUND[dtype])


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("window", [0, 12])
def test_extend_key_splits(splits, window):
    """The key tiles cut into num_splits runs (flash-decoding: partials merged by the combine kernel)
    give the unsplit result, for trees beside causal sequences, with a sliding window; more splits
    than a sequence's key tiles leave some empty (a zero-length sequence too); the padding row past
    the last sequence stays unwritten (_run_extend)."""
    g = torch.Generator().manual_seed(43 + splits)
    pairs = [(90, 7), (0, 12), (33, 1), (130, 20), (5, 0)]
    causal = [False, True, False, False, True]
    p, q, cu = _extend_batch(pairs, 2, 3, 32, 16, torch.float32, seed=47 + window)
    trees = [None if c else _ancestor_mask(n, g) for (_, n), c in zip(pairs, causal)]
    offsets, at = [], 0
    for t in trees:
        offsets.append(-1 if t is None else at)
        at += 0 if t is None else t.numel()
    mask = torch.cat([t.flatten() for t in trees if t is not None]).to(DEVICE)
    kw = dict(mask=mask, mask_offsets=torch.tensor(offsets, dtype=torch.int64, device=DEVICE), sliding_window=window)
    out, ref = _run_extend(p, q, cu, 20, 0.2, num_splits=splits, **kw)
    _close(out, _extend_dense(q, p, cu.cpu(), 0.2, trees=trees, window=window), 2e-5)
    one, _ = _run_extend(p, q, cu, 20, 0.2, num_splits=1, **kw)
    _close(out, one, 2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE])
def test_extend_key_splits_bf16_and_fp8_caches(dtype):
    # the split path's partials and merge with bf16 queries and caches, and with an FP8 cache (float32 queries)
    g = torch.Generator().manual_seed(53)
    pairs = [(70, 9), (0, 6), (40, 15)]
    p, q, cu = _extend_batch(pairs, 2, 2, 32, 16, dtype, seed=53)
    trees = [_ancestor_mask(n, g) for _, n in pairs]
    sizes = [n * n for _, n in pairs]
    mask = torch.cat([t.flatten() for t in trees]).to(DEVICE)
    offsets = torch.tensor([0] + sizes[:-1], dtype=torch.int64).cumsum(0).to(DEVICE)
    fp8 = dict(k_scale=p["k_scale"], v_scale=p["v_scale"]) if dtype == FP8_DTYPE else {}
    kw = dict(mask=mask, mask_offsets=offsets, **fp8)
    out, ref = _run_extend(p, q, cu, 15, 0.2, num_splits=3, **kw)
    one, _ = _run_extend(p, q, cu, 15, 0.2, num_splits=1, **kw)
    bound = 2e-5 if dtype == FP8_DTYPE else BOUND[dtype]
    _close(out, ref, bound)
    _close(out, one, bound)


def test_extend_num_splits_from_shapes():
    # a batch-1 tree verify (3 kv heads) takes 4 splits, fewer as the programs near half the SMs or as the key
    # tiles a table row holds run out; long new runs (prefill) and full grids keep one
    assert extend_num_splits(1, 1, 3, 60, 2048, 64, 132) == 4
    assert extend_num_splits(1, 1, 3, 60, 128, 64, 132) == 2
    assert extend_num_splits(1, 8, 3, 60, 2048, 64, 132) == 2
    assert extend_num_splits(2, 8, 3, 123, 2048, 64, 132) == 1
    assert extend_num_splits(1, 64, 3, 60, 2048, 64, 132) == 1
    assert extend_num_splits(12, 1, 3, BIG_TILE_ROWS, 2048, 128, 132) == 1


def test_decode_num_splits_from_shapes():
    # the SMs filled twice (batch 1, 3 kv heads: 88 programs wanted), bounded by the key tiles of a table row and
    # by 64; the CPU (one program at a time under the interpreter) counts as one SM, and takes one split
    assert default_num_splits(1, 3, 64, 32, 64, 132) == 32
    assert default_num_splits(1, 3, 512, 32, 64, 132) == 64
    assert default_num_splits(8, 3, 512, 32, 64, 132) == 11
    assert default_num_splits(64, 3, 512, 32, 64, 132) == 2
    assert default_num_splits(1, 3, 512, 32, 64, sm_count(torch.device("cpu"))) == 1
    assert extend_num_splits(1, 1, 3, 60, 2048, 64, sm_count(torch.device("cpu"))) == 1


def test_extend_fp8_cache():
    p, q, cu = _extend_batch([(0, 9), (21, 14)], 2, 2, 32, 8, FP8_DTYPE, seed=29)
    fp8 = dict(k_scale=p["k_scale"], v_scale=p["v_scale"])
    out, ref = _run_extend(p, q, cu, 14, 0.2, **fp8)
    _close(out, ref, 2e-5)
    _close(out, _extend_dense(q, p, cu.cpu(), 0.2), FP8_LOOSE)  # p["k"] is the unquantized K


# --------------------------------------------------------------------------- API
def test_torch_backend_and_auto_agree():
    p, q, cu = _extend_batch([(3, 5), (0, 2)], 1, 2, 16, 8, torch.float32, seed=31)
    kw = dict(k_scale=None, v_scale=None)
    a = paged_extend_attention(q, *_cache_args(p), cu, 5, 0.3, backend="torch", **kw)
    b = paged_extend_attention(q, *_cache_args(p), cu, 5, 0.3, backend="auto", **kw)
    _close(a[:7], b[:7], 2e-6)
    qd = q[:2]
    _close(paged_decode_attention(qd, *_cache_args(p), 0.3, backend="torch"),
           paged_decode_attention(qd, *_cache_args(p), 0.3), 2e-6)


def test_bad_inputs():
    p = _paged([5, 9], 2, 16, 8, torch.float32, seed=37)
    kc, vc, bt, sl = _cache_args(p)
    q = torch.randn(2, 4, 16, device=DEVICE)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="q:"):
        paged_decode_attention(q[:, :3], kc, vc, bt, sl, 0.2)  # 3 heads over 2 kv heads
    with pytest.raises(ValueError, match="q:"):
        paged_decode_attention(q.half()[..., :8], kc, vc, bt, sl, 0.2)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, kc, vc, bt, sl.long(), 0.2)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, kc, vc, bt[:1], sl, 0.2)
    with pytest.raises(ValueError, match="v_cache"):
        paged_decode_attention(q, kc, vc[:, :1], bt, sl, 0.2)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, kc, vc, bt, sl, 0.2, k_scale=torch.ones(kc.shape[:3], device=DEVICE))
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, kc, vc, bt, sl, 0.2, num_splits=0)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(q, kc, vc, bt, sl, 0.2, sliding_window=-1)
    with pytest.raises(ValueError, match="scale"):
        paged_decode_attention(q, kc, vc, bt, sl, None)
    with pytest.raises(ValueError, match="out"):
        paged_decode_attention(q, kc, vc, bt, sl, 0.2, out=q.half())
    with pytest.raises(ValueError, match="backend"):
        paged_decode_attention(q, kc, vc, bt, sl, 0.2, backend="cuda")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_extend_attention(q, kc, vc, bt, sl, cu[:2], 1, 0.2)
    with pytest.raises(ValueError, match="mask"):
        paged_extend_attention(q, kc, vc, bt, sl, cu, 1, 0.2, mask=torch.ones(2, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="mask_offsets"):
        paged_extend_attention(q, kc, vc, bt, sl, cu, 1, 0.2, mask=torch.ones(2, dtype=torch.bool, device=DEVICE),
                               mask_offsets=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        paged_extend_attention(q, kc, vc, bt, sl, cu, 1.0, 0.2)
    fp8 = kc.to(FP8_DTYPE)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, fp8, fp8, bt, sl, 0.2)
    with pytest.raises(ValueError, match="k_cache"):
        paged_decode_attention(q, kc[:, :, :6], vc[:, :, :6], bt, sl, 0.2)  # block size 6
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_cache(q[:, :2], q[:, :2], kc, vc, torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="k:"):
        store_kv_cache(q, q[:, :2], kc, vc, torch.zeros(2, dtype=torch.int64, device=DEVICE))


# --------------------------------------------------------------------------- GPU
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_realistic_sizes_gpu(d, cache_dtype):
    # Llama-3-8B-like heads (32 q over 8 kv), 16-token blocks, sequences up to ~2k keys
    g = torch.Generator().manual_seed(d)
    lens = torch.randint(1, 2100, (12,), generator=g).tolist()
    p = _paged(lens, 8, d, 16, cache_dtype, seed=d)
    for b, n in enumerate(lens):  # real garbage past each sequence's blocks: reading it faults
        p["block_tables"][b, -(-n // 16):] = 2**31 - 1 if b % 2 else -12345
    fp8 = dict(k_scale=p["k_scale"], v_scale=p["v_scale"])
    q = torch.randn(len(lens), 32, d, generator=g).to(DEVICE, torch.bfloat16)
    ref = paged_decode_attention_ref(q, *_cache_args(p), d ** -0.5, **fp8)
    _close(paged_decode_attention(q, *_cache_args(p), d ** -0.5, **fp8), ref, 2e-2)
    _close(paged_decode_attention(q, *_cache_args(p), d ** -0.5, sliding_window=300, **fp8),
           paged_decode_attention_ref(q, *_cache_args(p), d ** -0.5, sliding_window=300, **fp8), 2e-2)
    qlens = [min(n, int(torch.randint(1, 600, (1,), generator=g))) for n in lens]
    cu = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).int().to(DEVICE)
    qe = torch.randn(int(cu[-1]) + 1, 32, d, generator=g).to(DEVICE, torch.bfloat16)
    out, ref = _run_extend(p, qe, cu, max(qlens), d ** -0.5, **fp8)
    _close(out, ref, 2e-2)


@pytest.mark.parametrize("n", [20, 41, 81, 180])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tree_verify_sizes_gpu(n):
    # SmolLM2's heads (9 over 3, d 64), trees of verify sizes over ~300 cached keys, four sequences and a
    # causal one beside them: 64-row tiles over several programs a sequence (180 nodes: the 128-row tiles)
    g = torch.Generator().manual_seed(n)
    pairs = [(300, n), (17, n), (0, n), (511, n), (40, 7)]
    p, q, cu = _extend_batch(pairs, 3, 3, 64, 16, torch.bfloat16, seed=n)
    trees = [_ancestor_mask(k, g) for _, k in pairs[:-1]] + [None]
    sizes = [k * k for _, k in pairs[:-1]]
    mask = torch.cat([t.flatten() for t in trees[:-1]]).to(DEVICE)
    offsets = torch.tensor([0] + sizes[:-1], dtype=torch.int64).cumsum(0).tolist() + [-1]
    out, ref = _run_extend(p, q, cu, n, 0.125, mask=mask, mask_offsets=torch.tensor(offsets, device=DEVICE))
    _close(out, ref, 2e-2)
    _close(ref, _extend_dense(q, p, cu.cpu(), 0.125, trees=trees), 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_cuda_graph_replay_gpu():
    lens = [700, 33, 1, 1500]
    p = _paged(lens, 8, 128, 16, torch.bfloat16, seed=41)
    q = torch.randn(4, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    bt, sl = p["block_tables"].clone(), p["seq_lens"].clone()
    out = torch.empty_like(q)
    run = lambda: paged_decode_attention(q, p["k_cache"], p["v_cache"], bt, sl, 128 ** -0.5, out=out)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the cache was written on the default stream
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for step in range(3):  # new lengths and a reordered batch, same buffers
        perm = torch.randperm(len(lens), generator=torch.Generator().manual_seed(step))
        bt.copy_(p["block_tables"][perm.to(DEVICE)])
        sl.copy_(torch.tensor([max(1, n - 37 * step) for n in lens], dtype=torch.int32)[perm])
        graph.replay()
        torch.cuda.synchronize()
        eager = paged_decode_attention(q, p["k_cache"], p["v_cache"], bt, sl, 128 ** -0.5)
        assert torch.equal(out, eager)
        ref = paged_decode_attention_ref(q, p["k_cache"], p["v_cache"], bt, sl, 128 ** -0.5)
        _close(out, ref, 2e-2)
