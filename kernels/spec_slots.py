"""A speculative step's cache slots and positions for a range of each sequence's positions, in
one launch.

Sequence b (context length c = ctx[b], block table tables[b]) gets, for i in 0 .. count - 1,
position p = c + start + i and its cache slot tables[b, p // block_size] * block_size +
p % block_size (-1 where p < 0, or where the table is too short: no store), plus one int32
sequence length. What three places of a step computed with ~10 small tensor ops each (an add,
a clamp, a floor division, a gather, a multiply, a remainder, a where, dtype casts): the draft's
catch-up window (start -G), the EAGLE-2 levels' scratch rows and the verify's tree nodes (start 0).

    flat (group None):  slots / pos int64 [B, count] (pos = max(p, 0)), lens int32 [B] = c + lens_add
    levels (group k):   slots / pos int64 [count / k, B, k]: row r = l k + j is level l's row j at
                        [l, b, j], pos = c + l (its depth - 1); lens int32 [count / k, B] = c + (l + 1) k
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .common import CompiledLaunch, int_kind, pow2, use_triton


class Slots(NamedTuple):
    slots: torch.Tensor
    pos: torch.Tensor
    lens: torch.Tensor


@triton.jit(do_not_specialize=["B", "W", "stride_t", "START", "LENS_ADD"])
def _slots_kernel(tables_ptr, ctx_ptr, slot_ptr, pos_ptr, lens_ptr, B, W, stride_t, START, LENS_ADD, BS,
                  COUNT: tl.constexpr, CP: tl.constexpr, GROUP: tl.constexpr, LEVELS: tl.constexpr):
    """grid (B,)."""
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, CP)
    ok = i < COUNT
    c = tl.load(ctx_ptr + b).to(tl.int64)
    p = c + START + i
    q = tl.maximum(p, 0)
    inside = ok & (p >= 0) & (q // BS < W)
    blk = tl.load(tables_ptr + b * stride_t + q // BS, mask=inside, other=0).to(tl.int64)
    slot = tl.where(inside, blk * BS + q % BS, -1)
    if LEVELS:
        lv = i // GROUP
        dst = lv * B * GROUP + b * GROUP + i % GROUP
        tl.store(pos_ptr + dst, c + lv, mask=ok)
        tl.store(lens_ptr + lv * B + b, (c + (lv + 1) * GROUP).to(tl.int32), mask=ok & (i % GROUP == 0))
    else:
        dst = b * COUNT + i
        tl.store(pos_ptr + dst, q, mask=ok)
        tl.store(lens_ptr + b, (c + LENS_ADD).to(tl.int32))
    tl.store(slot_ptr + dst, slot, mask=ok)


# the eager path's launches through the compiled launcher (a fused step's proposal runs eagerly)
_SLOTS = CompiledLaunch(_slots_kernel, pointers=5, runtime=True)


def step_slots_ref(tables: torch.Tensor, ctx: torch.Tensor, start: int, count: int, block_size: int,
                   group: Optional[int] = None, lens_add: int = 0) -> Slots:
    """torch: the same with tensor ops."""
    bsz, width = tables.shape
    p = ctx[:, None] + torch.arange(start, start + count, device=ctx.device)[None, :]
    q = p.clamp_min(0)
    inside = (p >= 0) & (q // block_size < width)
    blk = tables.long().gather(1, (q // block_size).clamp_max(max(width - 1, 0))) if width else torch.zeros_like(q)
    slots = torch.where(inside, blk * block_size + q % block_size, -1)
    if group is None:
        return Slots(slots, q, (ctx + lens_add).to(torch.int32))
    levels = count // group
    lv = torch.arange(levels, device=ctx.device)
    return Slots(slots.view(bsz, levels, group).transpose(0, 1).contiguous(),
                 (ctx[None, :, None] + lv[:, None, None]).expand(levels, bsz, group).contiguous(),
                 (ctx[None, :] + (lv[:, None] + 1) * group).to(torch.int32))


def step_slots(tables: torch.Tensor, ctx: torch.Tensor, start: int, count: int, block_size: int, *,
               group: Optional[int] = None, lens_add: int = 0, backend: str = "auto") -> Slots:
    """Slots, positions and lengths of positions ctx + start .. ctx + start + count - 1 of each
    sequence (module docstring): tables int32 [B, W] (block ids), ctx int64 [B]; group: the
    levels' layout (count a multiple of it)."""
    if tables.dim() != 2 or tables.dtype not in (torch.int32, torch.int64) or ctx.shape != (tables.shape[0],) \
            or ctx.dtype != torch.int64:
        raise ValueError(f"tables, ctx: must be int32/int64 [B, W] and int64 [B], got {tables.dtype} "
                         f"{tuple(tables.shape)} and {ctx.dtype} {tuple(ctx.shape)}")
    if count < 1 or block_size < 1 or (group is not None and (group < 1 or count % group)):
        raise ValueError(f"count={count}, block_size={block_size}, group={group}: allowed count >= 1, "
                         "block_size >= 1, group None or dividing count")
    if not use_triton(backend, ctx):
        return step_slots_ref(tables, ctx, start, count, block_size, group, lens_add)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    if ctx.stride(0) != 1:
        ctx = ctx.contiguous()
    bsz, width = tables.shape
    dev = ctx.device
    if group is None:
        out = Slots(torch.empty(bsz, count, dtype=torch.int64, device=dev),
                    torch.empty(bsz, count, dtype=torch.int64, device=dev),
                    torch.empty(bsz, dtype=torch.int32, device=dev))
    else:
        levels = count // group
        out = Slots(torch.empty(levels, bsz, group, dtype=torch.int64, device=dev),
                    torch.empty(levels, bsz, group, dtype=torch.int64, device=dev),
                    torch.empty(levels, bsz, dtype=torch.int32, device=dev))
    if bsz:
        warps = 1 if count <= 128 else 4
        ints = (bsz, width, tables.stride(0), start, lens_add)
        key = (tables.dtype, block_size, count, group, warps, *(int_kind(v) for v in ints))
        _SLOTS(key, (bsz, 1, 1), (tables, ctx, *out, *ints, block_size),
               dict(COUNT=count, CP=pow2(count), GROUP=group or count, LEVELS=group is not None),
               dict(num_warps=warps))
    return out
