"""Linear layers: fused shards land in the right rows, tensor-parallel ranks take the right
slices, and every linear method computes x W^T + b of the weights it was given.
Bounds: float32 products against float64 references within 1e-5 relative."""

from __future__ import annotations

import pytest
import torch

from optllm.formats.args import QuantArgs
from optllm.quant.rtn import rtn_quantize
from optllm.runtime.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from optllm.runtime.layers.linear_methods import DenseMethod, DequantMethod, W4A16Method, kernel_takes
from optllm.runtime.layers.parallel import ParallelContext


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_qkv_shards_are_concatenated_in_order():
    torch.manual_seed(0)
    layer = QKVParallelLinear(32, 8, num_heads=4, num_kv_heads=2, bias=True, method=DenseMethod())
    ws = {s: torch.randn(n, 32) for s, n in (("q", 32), ("k", 16), ("v", 16))}
    bs = {s: torch.randn(w.shape[0]) for s, w in ws.items()}
    for s in "qkv":
        layer.weight_loader("weight", ws[s], s)
        layer.weight_loader("bias", bs[s], s)
    assert layer.loaded == layer.expected_loads()
    x = torch.randn(5, 32)
    ref = torch.cat([x @ ws[s].T + bs[s] for s in "qkv"], dim=1)
    assert rel(layer(x), ref) < 1e-6


def test_tensor_parallel_ranks_take_their_slices():
    """Rank 1 of 2: column layers keep the second half of each shard's rows, row layers the
    second half of the columns (and of the group scales), the bias whole."""
    torch.manual_seed(1)
    ctx = ParallelContext(rank=1, world_size=2)
    gate, up = torch.randn(24, 16), torch.randn(24, 16)
    col = MergedColumnParallelLinear(16, [24, 24], False, DenseMethod(), ctx=ctx)
    col.weight_loader("weight", gate, 0)
    col.weight_loader("weight", up, 1)
    assert torch.equal(col.weight, torch.cat([gate[12:], up[12:]]))
    args = QuantArgs(num_bits=4, group_size=8, symmetric=False)
    row = RowParallelLinear(32, 6, True, DequantMethod(args, torch.float32), ctx=ctx)
    q = torch.randint(-8, 8, (6, 32), dtype=torch.int8)
    s, z = torch.rand(6, 4) + 0.1, torch.randint(-8, 8, (6, 4), dtype=torch.int8)
    b = torch.randn(6)
    for name, t in (("qweight", q), ("scales", s), ("zeros", z), ("bias", b)):
        row.weight_loader(name, t)
    row.process_weights_after_loading()
    expect = (q[:, 16:].float() - z[:, 2:].float().repeat_interleave(8, 1)) * s[:, 2:].repeat_interleave(8, 1)
    assert torch.equal(row.weight, expect) and torch.equal(row.bias, b)


def test_shape_mismatch_is_a_clear_error():
    layer = RowParallelLinear(16, 8, False, DenseMethod())
    with pytest.raises(ValueError, match="does not match"):
        layer.weight_loader("weight", torch.zeros(8, 12))


@pytest.mark.parametrize("sym", (True, False))
@pytest.mark.parametrize("group", (32, 64))
def test_w4a16_method_equals_dequantized_weights(sym, group):
    """The W4A16 method (repacked to the kernels' layout; torch backend on CPU) computes
    x @ ((q - zero) * scale)^T + b."""
    torch.manual_seed(group + sym)
    args = QuantArgs(num_bits=4, group_size=group, symmetric=sym)
    w = torch.randn(48, 128)
    qw = rtn_quantize(w, args, scale_dtype=torch.float32)
    layer = MergedColumnParallelLinear(128, [16, 32], True, W4A16Method(args, torch.float32, "torch"))
    bias = torch.randn(48)
    for i, sl in enumerate((slice(0, 16), slice(16, 48))):
        layer.weight_loader("qweight", qw.q[sl], i)
        layer.weight_loader("scales", qw.scale[sl], i)
        if not sym:
            layer.weight_loader("zeros", qw.zero[sl], i)
        layer.weight_loader("bias", bias[sl], i)
    layer.process_weights_after_loading()
    assert not hasattr(layer, "qweight")  # the codes are gone once repacked
    x = torch.randn(7, 128)
    ref = x.double() @ qw.dequantize(torch.float64).T + bias.double()
    assert rel(layer(x), ref) < 1e-5


@pytest.mark.parametrize("layout", ("auto", "k", "n"))
def test_w4a16_method_word_layout_per_shape(layout, monkeypatch):
    """The layout is chosen at load: per (N, K) from N_MAJOR_SHAPES, or for every layer by
    OPTLLM_W4A16_LAYOUT; the kernels (interpreter here) compute the same either way."""
    import optllm.runtime.layers.linear_methods as lm

    monkeypatch.setattr(lm, "N_MAJOR_SHAPES", frozenset({(48, 128)}))
    monkeypatch.setenv("OPTLLM_W4A16_LAYOUT", layout)
    torch.manual_seed(3)
    args = QuantArgs(num_bits=4, group_size=32, symmetric=False)
    w = torch.randn(48, 128)
    qw = rtn_quantize(w, args, scale_dtype=torch.float32)
    layer = RowParallelLinear(128, 48, False, W4A16Method(args, torch.float32, "triton"))
    for name, t in (("qweight", qw.q), ("scales", qw.scale), ("zeros", qw.zero)):
        layer.weight_loader(name, t)
    layer.process_weights_after_loading()
    n_major = layout in ("auto", "n")
    assert tuple(layer.packed.shape) == ((16, 48) if n_major else (48, 16))
    x = torch.randn(3, 128)
    assert rel(layer(x), x.double() @ qw.dequantize(torch.float64).T) < 1e-5
    monkeypatch.setenv("OPTLLM_W4A16_LAYOUT", "x")
    with pytest.raises(ValueError, match="OPTLLM_W4A16_LAYOUT"):
        W4A16Method(args, torch.float32, "triton")


def test_kernel_takes_only_what_the_w4a16_kernels_run():
    assert kernel_takes(QuantArgs(4, 64), 576) and kernel_takes(QuantArgs(4, None), 100 * 8)
    assert not kernel_takes(QuantArgs(3, 64), 576)
    assert not kernel_takes(QuantArgs(4, 8), 64)  # groups must be multiples of 32 (or per channel)
    assert not kernel_takes(QuantArgs(8, 64), 576)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sym", (True, False))
def test_w4a16_method_decode_rows_on_the_tensor_core_gemv(sym, monkeypatch):
    """bf16, group 64: rows M <= 16 go to kernels/w4a16_mma.py, more rows to the Triton kernels (or with
    OPTLLM_W4A16_TILE=1, M = 17..256 to kernels/w4a16_mma_tile.py); all within bf16 rounding of the float64
    reference. OPTLLM_W4A16_MMA=0 leaves the second copy out."""
    from optllm.kernels import w4a16_mma, w4a16_mma_tile

    torch.manual_seed(sym)
    args = QuantArgs(num_bits=4, group_size=64, symmetric=sym)
    w = torch.randn(96, 256)
    qw = rtn_quantize(w, args, scale_dtype=torch.bfloat16)
    ref_w = qw.dequantize(torch.float64)
    bias = torch.randn(96)

    def build():
        layer = MergedColumnParallelLinear(256, [32, 64], True, W4A16Method(args, torch.bfloat16, "triton"),
                                           dtype=torch.bfloat16, device="cuda")
        for i, sl in enumerate((slice(0, 32), slice(32, 96))):
            layer.weight_loader("qweight", qw.q[sl], i)
            layer.weight_loader("scales", qw.scale[sl], i)
            if not sym:
                layer.weight_loader("zeros", qw.zero[sl], i)
            layer.weight_loader("bias", bias[sl].to(torch.bfloat16), i)
        layer.process_weights_after_loading()
        return layer

    layer = build()
    assert w4a16_mma.available() and layer.mma_weight is not None, w4a16_mma._UNAVAILABLE
    for m in (1, 3, 8, 9, 40):
        x = torch.randn(m, 256, device="cuda").to(torch.bfloat16)
        ref = x.double() @ ref_w.cuda().T + bias.to(torch.bfloat16).double().cuda()
        assert rel(layer(x), ref) < 5e-3, m
    assert layer.tile_rows == w4a16_mma_tile.route_rows(96, 256) == frozenset()  # no table entry: M > 16 on Triton
    # OPTLLM_W4A16_TILE=1: M = 17..256 on the tensor-core tiles (kernels/w4a16_mma_tile.py), the same bounds
    monkeypatch.setenv("OPTLLM_W4A16_TILE", "1")
    tiled = build()
    assert tiled.tile_rows == frozenset(range(17, 257))
    calls = []
    real = w4a16_mma_tile.w4a16_mma_tile_linear
    monkeypatch.setattr(w4a16_mma_tile, "w4a16_mma_tile_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in (8, 17, 40, 256, 257):
        x = torch.randn(m, 256, device="cuda").to(torch.bfloat16)
        ref = x.double() @ ref_w.cuda().T + bias.to(torch.bfloat16).double().cuda()
        assert rel(tiled(x), ref) < 5e-3, m
    assert calls == [17, 40, 256]
    # auto: the table's rows only, in its config
    monkeypatch.setenv("OPTLLM_W4A16_TILE", "auto")
    monkeypatch.setitem(w4a16_mma_tile.TILE_TABLE, (96, 256), ((40, 40, w4a16_mma_tile.TileConfig(2, 1, 2)),))
    tabled = build()
    assert tabled.tile_rows == frozenset({40})
    calls.clear()
    for m in (17, 40, 48):
        x = torch.randn(m, 256, device="cuda").to(torch.bfloat16)
        ref = x.double() @ ref_w.cuda().T + bias.to(torch.bfloat16).double().cuda()
        assert rel(tabled(x), ref) < 5e-3, m
    assert calls == [40]
    monkeypatch.setenv("OPTLLM_W4A16_TILE", "2")
    with pytest.raises(ValueError, match="OPTLLM_W4A16_TILE"):
        build()
    monkeypatch.setenv("OPTLLM_W4A16_TILE", "auto")
    monkeypatch.setenv("OPTLLM_W4A16_MMA", "0")
    assert build().mma_weight is None
