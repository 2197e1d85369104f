import itertools

import pytest
import torch

from optllm.formats.packing import pack_int32, unpack_int32

SHAPES = [(5, 64), (7, 96), (3, 40), (4, 33)]


@pytest.mark.parametrize("bits,shape,dim", list(itertools.product((2, 3, 4, 8), SHAPES, (0, 1))))
def test_pack_unpack_round_trip(bits, shape, dim):
    g = torch.Generator().manual_seed(bits * 100 + shape[1] + dim)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), shape, dtype=torch.int8, generator=g)
    p = pack_int32(q, bits, dim)
    assert p.dtype == torch.int32
    assert p.shape[dim] == -(-shape[dim] * bits // 32)
    assert torch.equal(unpack_int32(p, bits, shape[dim], dim), q)


@pytest.mark.parametrize("bits", (2, 3, 4, 8))
@pytest.mark.parametrize("dim", (0, 1))
def test_matches_compressed_tensors_bit_for_bit(bits, dim):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (6, 80), dtype=torch.int8)
    assert torch.equal(pack_int32(q, bits, dim), helpers.pack_to_int32(q, bits, packed_dim=dim))


def test_int4_word_layout():
    # code j of a word sits in bits [4j, 4j+4), stored as q + 8
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=torch.int8)
    word = int(pack_int32(q, 4)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [0, 1, 8, 9, 10, 11, 14, 15]


def test_bad_input():
    with pytest.raises(ValueError, match="int8"):
        pack_int32(torch.zeros(2, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="num_bits"):
        pack_int32(torch.zeros(2, 8, dtype=torch.int8), 9)
    with pytest.raises(ValueError, match="words"):
        unpack_int32(torch.zeros(2, 3, dtype=torch.int32), 4, 8)
