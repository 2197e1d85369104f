"""A speculative step's slots and positions in one launch (kernels/spec_slots.py) against its
torch reference and against the plain formula (block id x block size + offset, -1 before
position 0), for the three ranges a step uses: the catch-up window (negative start, sequences
shorter than the window), the EAGLE-2 levels' layout, the verify's nodes. Integers: exact.
Under TRITON_INTERPRET=1 on CPU (and on CUDA where present)."""

import pytest
import torch

from optllm.kernels.spec_slots import step_slots, step_slots_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(bsz, width, bs, seed):
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(bsz * width * 3, generator=g)[:bsz * width].view(bsz, width).to(torch.int32)
    ctx = torch.randint(0, (width - 3) * bs, (bsz,), generator=g)
    ctx[0] = 2  # shorter than any window here
    return tables, ctx


def _formula(tables, ctx, start, count, bs):
    out = torch.full((ctx.shape[0], count), -1, dtype=torch.int64)
    for b in range(ctx.shape[0]):
        for i in range(count):
            p = int(ctx[b]) + start + i
            if p >= 0 and p // bs < tables.shape[1]:
                out[b, i] = int(tables[b, p // bs]) * bs + p % bs
    return out


@pytest.mark.parametrize("start, count, group, lens_add", [(-13, 13, None, 0), (0, 32, 8, 0), (0, 41, None, 41),
                                                            (0, 12, 3, 0), (-1, 1, None, 5)])
def test_matches_the_reference_and_the_formula(start, count, group, lens_add):
    bsz, width, bs = 5, 9, 16
    tables, ctx = _case(bsz, width, bs, seed=count)
    ref = step_slots_ref(tables, ctx, start, count, bs, group, lens_add)
    got = step_slots(tables.to(DEV), ctx.to(DEV), start, count, bs, group=group, lens_add=lens_add, backend="triton")
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b)
    want = _formula(tables, ctx, start, count, bs)
    if group is None:
        assert torch.equal(ref.slots, want)
        assert torch.equal(ref.pos, (ctx[:, None] + torch.arange(start, start + count)).clamp_min(0))
        assert torch.equal(ref.lens, (ctx + lens_add).int())
    else:  # row l * group + j of sequence b at [l, b, j]; its position c + l, the level's length c + (l + 1) group
        levels = count // group
        assert torch.equal(ref.slots, want.view(bsz, levels, group).transpose(0, 1))
        for lv in range(levels):
            assert torch.equal(ref.pos[lv], (ctx + lv)[:, None].expand(bsz, group))
            assert torch.equal(ref.lens[lv], (ctx + (lv + 1) * group).int())


def test_a_table_too_short_stores_nothing():
    tables = torch.tensor([[3, 5]], dtype=torch.int32)
    ctx = torch.tensor([30])
    got = step_slots(tables.to(DEV), ctx.to(DEV), 0, 4, 16, backend="triton")
    assert got.slots.tolist() == [[94, 95, -1, -1]]
    assert torch.equal(step_slots_ref(tables, ctx, 0, 4, 16).slots, got.slots.cpu())


def test_bad_inputs_are_one_error():
    tables, ctx = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="tables, ctx"):
        step_slots(tables, ctx.int(), 0, 4, 16)
    with pytest.raises(ValueError, match="group"):
        step_slots(tables, ctx, 0, 4, 16, group=3)
    with pytest.raises(ValueError, match="count"):
        step_slots(tables, ctx, 0, 0, 16)
