"""The fused top-k log-softmax kernel against torch, under TRITON_INTERPRET=1 on CPU (and on
CUDA where present).

Reference: log_softmax in float64, then a stable descending sort (ties: the lower column
first, the order the kernel promises). Columns must be equal exactly; values within 1e-5 of
the reference: the kernel's log-sum-exp sums exp in float32 in another order (a few ulps of a
log-sum-exp <= 16, about 1e-6); dropping one chunk of a row from the sum, or taking one word
from the wrong chunk, moves them by far more.
"""

import pytest
import torch

from optllm.kernels.topk import topk_logprobs, topk_logprobs_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 1e-5


def _ref(x: torch.Tensor, k: int):
    lp = torch.log_softmax(x.double(), dim=-1)
    order = torch.sort(x.float(), dim=-1, descending=True, stable=True).indices[..., :k]
    return lp.gather(-1, order).clamp_max(0.0), order


def _check(x, k):
    vals, ids = topk_logprobs(x, k, backend="triton")
    ref_vals, ref_ids = _ref(x, k)
    assert vals.dtype == torch.float32 and ids.dtype == torch.int64
    assert vals.shape == ids.shape == (*x.shape[:-1], k)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    assert (vals.double().cpu() - ref_vals.cpu()).abs().max() <= ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab, k", [(3, 300, 5), (2, 4096 * 2 + 77, 8), (5, 50, 1), (1, 4096, 16)])
def test_matches_reference(rows, vocab, k, dtype):
    g = torch.Generator().manual_seed(rows * vocab + k)
    x = (torch.randn(rows, vocab, generator=g) * 4).to(DEV, dtype)
    _check(x, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_go_to_the_lower_column_and_never_repeat(dtype):
    x = torch.zeros(2, 4096 + 500, device=DEV, dtype=dtype)
    x[0, [7, 4100, 4200, 3]] = 1.0  # equal maxima in two chunks
    x[1, 4096:] = 2.0  # the second chunk all equal
    vals, ids = topk_logprobs(x, 6, backend="triton")
    assert ids[0].tolist() == [3, 7, 4100, 4200, 0, 1]
    assert ids[1].tolist() == [4096, 4097, 4098, 4099, 4100, 4101]
    _check(x, 6)


def test_minus_infinity_words_and_chunks():
    """A reduced draft vocabulary maps into the target's with -inf elsewhere: whole chunks of
    -inf add nothing, and finite words always outrank them."""
    g = torch.Generator().manual_seed(1)
    x = torch.full((3, 4096 * 3 + 11), float("-inf"))
    x[0, 5000:5040] = torch.randn(40, generator=g)
    x[1, :3] = torch.tensor([0.5, -1.0, 2.0])  # three finite words, k = 3
    x[2] = torch.randn(x.shape[1], generator=g)
    x[2, 4096:8192] = float("-inf")
    _check(x.to(DEV, torch.bfloat16), 3)
    for dtype in (torch.float32, torch.bfloat16):
        vals, ids = topk_logprobs(x.to(DEV, dtype), 3, backend="triton")
        assert ids[1].tolist() == [2, 0, 1] and torch.isfinite(vals).all()


def test_leading_dims_and_strided_rows():
    g = torch.Generator().manual_seed(2)
    big = torch.randn(2, 3, 700, generator=g).to(DEV)
    x = big[:, :, :600]  # rows not contiguous with each other
    vals, ids = topk_logprobs(x, 4, backend="triton")
    assert vals.shape == (2, 3, 4)
    _check(x.reshape(6, 600), 4)
    assert torch.equal(ids.reshape(6, 4), topk_logprobs(x.reshape(6, 600).contiguous(), 4, backend="triton")[1])


def test_torch_backend_is_the_reference():
    x = torch.randn(4, 333)
    vals, ids = topk_logprobs(x, 5, backend="torch")
    rv, ri = topk_logprobs_ref(x, 5)
    assert torch.equal(vals, rv) and torch.equal(ids, ri)
    assert (vals <= 0).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_id_map_gives_mapped_ids_in_the_same_order(backend):
    """A reduced draft vocabulary's ids mapped to the target's inside the launch: the ids are
    id_map of the unmapped call's columns, the values unchanged."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 4096 + 300, generator=g) * 3).to(DEV, torch.bfloat16)
    id_map = torch.randperm(50000, generator=g)[:x.shape[1]].sort().values.to(DEV)
    vals, ids = topk_logprobs(x, 8, backend=backend)
    mv, mi = topk_logprobs(x, 8, backend=backend, id_map=id_map)
    assert torch.equal(mv, vals) and torch.equal(mi, id_map[ids]) and not torch.equal(mi, ids)


def test_bad_inputs_are_one_error():
    x = torch.randn(2, 10)
    for k in (0, 11, True, 2.0):
        with pytest.raises(ValueError, match="k="):
            topk_logprobs(x, k)
    with pytest.raises(ValueError, match="logits"):
        topk_logprobs(x.long(), 2)
    with pytest.raises(ValueError, match="logits"):
        topk_logprobs(torch.tensor(1.0), 1)
    with pytest.raises(ValueError, match="id_map"):
        topk_logprobs(x, 2, id_map=torch.arange(9))
    with pytest.raises(ValueError, match="id_map"):
        topk_logprobs(x, 2, id_map=torch.arange(10, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, k", [(1, 8), (8, 8), (512, 8), (64, 10)])
def test_cuda_full_vocabulary(rows, k):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 49152, generator=g) * 3).to("cuda", torch.bfloat16)
    _check(x, k)
