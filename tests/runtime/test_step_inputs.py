"""packed_to (runtime/step_inputs.py): a step's integer inputs in one host tensor and one copy,
each part a view on a 16-byte boundary (Triton compiles a kernel again for a pointer that is not)."""

from __future__ import annotations

import random

import numpy as np
import torch

from optllm.runtime.step_inputs import packed_to


def test_every_part_is_itself_and_16_byte_aligned():
    rng = random.Random(0)
    for code, dtype in (("q", torch.int64), ("i", torch.int32)):
        for _ in range(50):
            parts = [[rng.randrange(-2**31, 2**31) for _ in range(rng.randrange(0, 9))]
                     for _ in range(rng.randrange(1, 5))]
            parts.append(np.array([rng.randrange(0, 1000) for _ in range(rng.randrange(0, 7))], dtype=np.int64))
            views = packed_to(torch.device("cpu"), code, *parts)
            assert len(views) == len(parts)
            base = views[0].data_ptr() - views[0].storage_offset() * views[0].element_size()
            for p, v in zip(parts, views):
                assert v.dtype == dtype and v.tolist() == [int(x) for x in p]
                assert (v.data_ptr() - base) % 16 == 0
