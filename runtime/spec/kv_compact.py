"""Moving the accepted path's KV into place after verification.

The verify step wrote node i's K/V at position context_len + i (tree order, see tree.py).
With the accepted path a_0 = 0 (the root) < a_1 < ... < a_k (node indices), the sequence
goes on with those tokens at positions context_len .. context_len + k, so node a_i's K/V, in
every layer, moves from position context_len + a_i to context_len + i. The engine then
appends the k accepted tokens and the final token, sets num_computed_tokens = context_len +
k + 1, and calls ``BlockManager.truncate(seq, seq.num_tokens)``, which gives back the blocks
that only rejected nodes used (and unregisters nothing it need not: those blocks were never
committed). Tensor ops only: no host sync, so it can run inside a captured step.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .tree import const_arange


def accepted_kv_slots(block_tables: torch.Tensor, context_lens: torch.Tensor, accepted: torch.Tensor,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) int64 [B * L] cache slots (block * block_size + offset) of the moves.

    block_tables int [B, W]; context_lens int [B] (the root's position); accepted int64 [B, L]:
    each path's node indices, root first, -1 after it (``AcceptResult.accepted``), strictly
    increasing (parents precede children). Entries that move nothing (the root, nodes already
    in place, padding) become copies of the root's slot onto itself, so every dst slot gets
    exactly one value and the result does not depend on the order of the writes.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} is not allowed; allowed: an integer >= 1")
    if accepted.dim() != 2 or block_tables.dim() != 2 or accepted.shape[0] != block_tables.shape[0] \
            or context_lens.shape != (accepted.shape[0],):
        raise ValueError(f"block_tables, context_lens, accepted: must be [B, W], [B], [B, L], got "
                         f"{tuple(block_tables.shape)}, {tuple(context_lens.shape)}, {tuple(accepted.shape)}")
    dev = accepted.device
    ctx = context_lens.to(dev, torch.int64)[:, None]
    table = block_tables.to(dev, torch.int64)
    i = const_arange(accepted.shape[1], dev)[None, :]
    moves = (accepted >= 0) & (accepted != i)
    src_pos = torch.where(moves, ctx + accepted, ctx)
    dst_pos = torch.where(moves, ctx + i, ctx)

    def slot(pos: torch.Tensor) -> torch.Tensor:
        return table.gather(1, pos // block_size) * block_size + pos % block_size

    return slot(src_pos).reshape(-1), slot(dst_pos).reshape(-1)


def move_kv_slots(caches: Sequence[Optional[torch.Tensor]], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the entries at slots ``src`` to slots ``dst`` (int64 [M]) in place, in each cache.

    caches: tensors in the KVCache layout, block dim 1 and offset dim 3: K / V [layers,
    num_blocks, kv_heads, block_size, head_dim] and fp8 scales [layers, num_blocks, kv_heads,
    block_size] (one layer: pass cache.unsqueeze(0)); None entries are skipped. All sources are
    read before any destination is written, so chains (a -> b, b -> c) move correctly.
    """
    if src.shape != dst.shape or src.dim() != 1:
        raise ValueError(f"src, dst: must be two [M] tensors, got {tuple(src.shape)} and {tuple(dst.shape)}")
    for t in caches:
        if t is None:
            continue
        if t.dim() not in (4, 5):
            raise ValueError(f"caches: must be [layers, num_blocks, kv_heads, block_size(, head_dim)] tensors, "
                             f"got {tuple(t.shape)}")
        bs = t.shape[3]
        # 1-byte caches (fp8) move as raw bytes: indexing kernels need not support the float type
        x = t.view(torch.uint8) if t.element_size() == 1 else t
        s, d = src.to(t.device), dst.to(t.device)
        vals = x[:, s // bs, :, s % bs]
        x[:, d // bs, :, d % bs] = vals
