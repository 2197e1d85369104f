import pytest

from optllm.formats.args import QuantArgs
from optllm.formats.vllm_compat import vllm_incompatibility


@pytest.mark.parametrize("bits, group, sym", [
    (4, 32, True), (4, 64, True), (4, 128, True), (4, None, True), (8, 128, True), (8, None, True),
    (4, 32, False), (4, None, False),
])
def test_what_vllm_loads(bits, group, sym):
    assert vllm_incompatibility(QuantArgs(num_bits=bits, group_size=group, symmetric=sym)) is None


@pytest.mark.parametrize("args, why", [
    (QuantArgs(num_bits=3, group_size=128), "not 3-bit"),
    (QuantArgs(num_bits=2, group_size=64), "not 2-bit"),
    (QuantArgs(num_bits=4, group_size=16), "not 16"),
    (QuantArgs(num_bits=4, group_size=256), "not 256"),
    (QuantArgs(num_bits=8, group_size=96), "not 96"),
    (QuantArgs(num_bits=8, group_size=128, symmetric=False), "only on Hopper"),
])
def test_what_vllm_does_not_load_is_one_sentence(args, why):
    note = vllm_incompatibility(args)
    assert why in note and note.count(". ") == 0 and note.endswith(".") and "\n" not in note
