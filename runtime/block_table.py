"""The running sequences' block tables as one host array, updated incrementally.

Rebuilding a [batch, max_blocks] table from Python lists every step costs milliseconds at a
batch of 256; here each sequence owns a row, and a step copies only the blocks appended
since the last one (the whole row again after its table shrank: a free or a truncation
bumps Sequence.block_table_epoch). A step's table is then one numpy gather.
"""

from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, rows: int, width: int) -> None:
        self.table = np.zeros((rows, width), dtype=np.int32)
        self.width = width
        self._rows: dict[int, list[int]] = {}  # seq_id -> [row, blocks written, epoch]
        self._free = list(range(rows - 1, -1, -1))

    def gather(self, seqs, width: int) -> np.ndarray:
        """int32 [len(seqs), width]: each sequence's block ids, then unused entries."""
        idx = np.empty(len(seqs), dtype=np.int64)
        for i, s in enumerate(seqs):
            e = self._rows.get(s.seq_id)
            if e is None:
                e = self._rows[s.seq_id] = [self._take(seqs), 0, s.block_table_epoch]
            bt = s.block_table
            if e[2] != s.block_table_epoch or len(bt) < e[1]:
                e[1], e[2] = 0, s.block_table_epoch
            n = len(bt)
            if n > e[1]:
                self.table[e[0], e[1]:n] = bt[e[1]:n]
                e[1] = n
            idx[i] = e[0]
        return self.table[idx, :width]

    def _take(self, current) -> int:
        if not self._free:  # drop the rows of sequences not in this step (finished or waiting)
            live = {s.seq_id for s in current}
            for sid in [k for k in self._rows if k not in live]:
                self._free.append(self._rows.pop(sid)[0])
        return self._free.pop()
