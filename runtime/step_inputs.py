"""One step's model inputs, built on the host from the scheduled batch.

For sequence i computing tokens [start, end) (start = num_computed_tokens): its ids and
positions, the cache slot of each (block_table[p // block_size] * block_size + p %
block_size), its key count end, and the hidden rows that need logits: the last row when the
step completes the sequence (it samples), and, for prompt_logprobs requests, every row whose
next token is a prompt token still to score (seq.next_prompt_logprob on: not those before
prompt_logprobs_start, nor those scored before a preemption). Two host tensors (int64 and
int32) carry everything to the device in two copies.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import numpy as np
import torch

from .block_table import BlockTables
from .layers.attention import AttentionMetadata


@dataclass
class StepInputs:
    """input_ids / positions int64 [T]; meta: the attention metadata; logits_rows int64
    [R]: hidden rows to compute logits for; sample: (seq index, logits row) of the sequences
    that sample; prompt_lp: (seq index, first logits row, count, first position) of
    prompt-logprob spans (row j scores token first_position + j + 1)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    sample: list[tuple[int, int]]
    prompt_lp: list[tuple[int, int, int, int]]


@dataclass
class HostBatch:
    """The same on the host, as Python lists and the block-table array [B, width] (the
    CUDA-graph path copies them into its static buffers)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    cu_seqlens: list[int]
    table: np.ndarray
    logits_rows: list[int]
    sample: list[tuple[int, int]]
    prompt_lp: list[tuple[int, int, int, int]]


def host_batch(seqs, num_new_tokens, block_size: int, tables: BlockTables) -> HostBatch:
    ids, pos, slots, seq_lens, cu = [], [], [], [], [0]
    rows, sample, prompt_lp = [], [], []
    width = 1
    for i, (seq, k) in enumerate(zip(seqs, num_new_tokens)):
        start = seq.num_computed_tokens
        end = start + k
        bt = seq.block_table
        ids += seq.token_ids[start:end]
        pos += range(start, end)
        slots += [bt[p // block_size] * block_size + p % block_size for p in range(start, end)]
        row0 = cu[-1]
        cu.append(row0 + k)
        seq_lens.append(end)
        width = max(width, len(bt))
        if seq.params.prompt_logprobs is not None:
            # position q scores prompt token q + 1: q in [lo, hi) of this step's [start, end)
            lo = max(start, seq.next_prompt_logprob - 1)
            hi = min(end, seq.num_prompt_tokens - 1)
            if hi > lo:
                prompt_lp.append((i, len(rows), hi - lo, lo))
                rows += range(row0 + lo - start, row0 + hi - start)
        if end == seq.num_tokens:
            sample.append((i, len(rows)))
            rows.append(row0 + k - 1)
    return HostBatch(ids, pos, slots, seq_lens, cu, tables.gather(seqs, width), rows, sample, prompt_lp)


def host_tensor(code: str, *parts: list[int]) -> torch.Tensor:
    """The lists concatenated as one CPU tensor (code "q": int64, "i": int32), through
    array.array: several times faster than torch.tensor on a Python list."""
    buf = array.array(code)
    for p in parts:
        buf.extend(p)
    if not buf:
        return torch.empty(0, dtype=torch.int64 if code == "q" else torch.int32)
    return torch.frombuffer(buf, dtype=torch.int64 if code == "q" else torch.int32)


def to_device(hb: HostBatch, device: torch.device, decode: bool, num_splits: int | None) -> StepInputs:
    t, b = len(hb.ids), len(hb.seq_lens)
    width = hb.table.shape[1]
    i64 = host_tensor("q", hb.ids, hb.positions, hb.slots, hb.logits_rows)
    i32 = torch.from_numpy(np.concatenate([np.asarray(hb.seq_lens + hb.cu_seqlens, dtype=np.int32),
                                           hb.table.reshape(-1)]))
    i64, i32 = i64.to(device, non_blocking=True), i32.to(device, non_blocking=True)
    ids, positions, slots, rows = i64[:t], i64[t:2 * t], i64[2 * t:3 * t], i64[3 * t:]
    seq_lens, cu, tables = i32[:b], i32[b:2 * b + 1], i32[2 * b + 1:].view(b, width)
    max_q = max(hb.cu_seqlens[j + 1] - hb.cu_seqlens[j] for j in range(b))
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, decode=decode,
                             cu_seqlens_q=None if decode else cu, max_seqlen_q=max_q, num_splits=num_splits)
    return StepInputs(ids, positions, meta, rows, hb.sample, hb.prompt_lp)
