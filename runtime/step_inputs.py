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

    @property
    def max_seqlen_q(self) -> int:
        """The most new tokens of one sequence."""
        cu = self.cu_seqlens
        return max(cu[j + 1] - cu[j] for j in range(len(cu) - 1))

    def sample_rows(self, logits_rows: torch.Tensor) -> torch.Tensor:
        """The rows of logits_rows (logits_rows on the device) that sample, in ``sample`` order:
        all of them unless prompt log-probs added rows."""
        return logits_rows[[r for _, r in self.sample]] if self.prompt_lp else logits_rows


def host_batch(seqs, num_new_tokens, block_size: int, tables: BlockTables, also=()) -> HostBatch:
    """also: sequences whose block tables follow seqs' in the table (rows len(seqs) on; a fused
    speculative step's), nothing else of them."""
    ids, pos, slots, seq_lens, cu = [], [], [], [], [0]
    rows, sample, prompt_lp = [], [], []
    width = 1
    for i, (seq, k) in enumerate(zip(seqs, num_new_tokens)):
        start = seq.num_computed_tokens
        end = start + k
        bt = seq.block_table
        if k == 1:  # a decode: one token, without the slices and ranges of the general case
            ids.append(seq.token_ids[start])
            pos.append(start)
            slots.append(bt[start // block_size] * block_size + start % block_size)
        else:
            ids += seq.token_ids[start:end]
            pos += range(start, end)
            slots += [bt[p // block_size] * block_size + p % block_size for p in range(start, end)]
        row0 = cu[-1]
        cu.append(row0 + k)
        seq_lens.append(end)
        if len(bt) > width:
            width = len(bt)
        if seq.params.prompt_logprobs is not None:
            # position q scores prompt token q + 1: q in [lo, hi) of this step's [start, end)
            lo = max(start, seq.next_prompt_logprob - 1)
            hi = min(end, seq.num_prompt_tokens - 1)
            if hi > lo:
                prompt_lp.append((i, len(rows), hi - lo, lo))
                rows += range(row0 + lo - start, row0 + hi - start)
        if end == len(seq.token_ids):
            sample.append((i, len(rows)))
            rows.append(row0 + k - 1)
    for seq in also:
        width = max(width, len(seq.block_table))
    table = tables.gather([*seqs, *also] if also else seqs, width)
    return HostBatch(ids, pos, slots, seq_lens, cu, table, rows, sample, prompt_lp)


def host_tensor(code: str, *parts: list[int]) -> torch.Tensor:
    """The lists concatenated as one CPU tensor (code "q": int64, "i": int32), through
    array.array: several times faster than torch.tensor on a Python list."""
    buf = array.array(code)
    for p in parts:
        buf.extend(p)
    if not buf:
        return torch.empty(0, dtype=torch.int64 if code == "q" else torch.int32)
    return torch.frombuffer(buf, dtype=torch.int64 if code == "q" else torch.int32)


def packed_to(device: torch.device, code: str, *parts) -> list[torch.Tensor]:
    """The parts (lists of ints, or int numpy arrays) on the device, through one host tensor and
    one copy: each part a view that starts on a 16-byte boundary. Triton specialises a kernel on
    whether each pointer argument is 16-byte aligned, so a view at an odd int64 offset (a part
    after one of odd length) compiles the kernel again, a stall of ~50 ms in the middle of a
    served step (H200: a batch-1 catch-up of 183 rows took 101.6 ms against 5.3 ms for 230)."""
    buf = array.array(code)
    per = 16 // buf.itemsize
    spans = []
    for p in parts:
        spans.append((len(buf), len(p)))
        if isinstance(p, np.ndarray):
            buf.frombytes(np.ascontiguousarray(p, dtype=np.int64 if code == "q" else np.int32).tobytes())
        else:
            buf.extend(p)
        buf.extend(_ZEROS[:(-len(buf)) % per])
    if not buf:
        buf.append(0)
    dev = torch.frombuffer(buf, dtype=torch.int64 if code == "q" else torch.int32).to(device, non_blocking=True)
    return [dev[s:s + n] for s, n in spans]


_ZEROS = (0, 0, 0, 0)


def to_device(hb: HostBatch, device: torch.device, decode: bool, num_splits: int | None) -> StepInputs:
    b = len(hb.seq_lens)
    width = hb.table.shape[1]
    ids, positions, slots, rows = packed_to(device, "q", hb.ids, hb.positions, hb.slots, hb.logits_rows)
    seq_lens, cu, tables = packed_to(device, "i", hb.seq_lens, hb.cu_seqlens, hb.table.reshape(-1))
    tables = tables.view(b, width)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, decode=decode,
                             cu_seqlens_q=None if decode else cu, max_seqlen_q=hb.max_seqlen_q, num_splits=num_splits)
    return StepInputs(ids, positions, meta, rows, hb.sample, hb.prompt_lp)
