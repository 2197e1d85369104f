"""kernels/sample.py: the graph-safe temperature sampler against references -- greedy rows exactly
torch's argmax (ties, 16-bit logits, a padded LM head's columns), sampled rows exactly the
exponential race over a numpy Philox4x32-10 written here from the paper's round function, the
step counters' advance, and the distribution (a chi-square test) on both backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from optllm.kernels.sample import sample_tokens, sample_tokens_ref

M32 = 0xFFFFFFFF
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def philox4x32(c, k0: int, k1: int, rounds: int = 10) -> list[np.ndarray]:
    """Philox4x32 (Salmon et al., SC 2011): counters c = 4 uint64 arrays holding 32-bit words,
    key (k0, k1); 10 rounds of the S-box pair and the Weyl key schedule."""
    a, b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    c0, c1, c2, c3 = (np.asarray(x, dtype=np.uint64) & np.uint64(M32) for x in c)
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(rounds):
        p0, p1 = b * c2, a * c0  # 64-bit products of 32-bit words: exact
        c0, c1, c2, c3 = ((p0 >> np.uint64(32)) ^ c1 ^ k0, p0 & np.uint64(M32),
                          (p1 >> np.uint64(32)) ^ c3 ^ k1, p1 & np.uint64(M32))
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & np.uint64(M32), (k1 + np.uint64(0xBB67AE85)) & np.uint64(M32)
    return [c0, c1, c2, c3]


def expected_scores(x: np.ndarray, temps: np.ndarray, steps: np.ndarray, seed: int, quarter: int,
                    first_row: int = 0) -> np.ndarray:
    """float32 [V]: the race's scores of one row (row index first_row) by the definition."""
    return _scores(x, temps, steps, seed, quarter, first_row)[0]


def _scores(x, temps, steps, seed, quarter, first_row=0):
    r, v = x.shape
    cols = np.arange(v)
    chunk, within = cols // (4 * quarter), cols % (4 * quarter)
    q, lane = within // quarter, within % quarter
    shape = (r, v)
    words = philox4x32((np.broadcast_to(chunk * quarter + lane, shape), np.broadcast_to(steps[:, None], shape),
                        np.broadcast_to(first_row + np.arange(r)[:, None], shape), np.zeros(shape)),
                       seed & M32, (seed >> 32) & M32)
    w = np.choose(np.broadcast_to(q, shape), words)
    u = ((w >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -23)
    t = np.maximum(temps, 1e-5).astype(np.float32)[:, None]
    return (x.astype(np.float32) / t - np.log(-np.log(u))).astype(np.float32)


def expected_tokens(x: np.ndarray, temps: np.ndarray, steps: np.ndarray, seed: int, quarter: int) -> np.ndarray:
    """The kernel's tokens from its definition, in float32 numpy: greedy rows' first argmax;
    sampled rows' argmax of x / t - log(-log u) with u from word q of Philox(seed; c * Q + i,
    step, row, 0) for column c * 4Q + q * Q + i."""
    score = _scores(x, temps, steps, seed, quarter)
    return np.where(temps < 1e-5, np.argmax(x, axis=1), np.argmax(score, axis=1))


def assert_definition(tok: torch.Tensor, x: torch.Tensor, temps: torch.Tensor, steps: torch.Tensor, seed: int,
                      quarter: int) -> None:
    """tok are the definition's tokens: exactly on the CPU (the interpreter computes in numpy's
    float32); on CUDA, whose log differs from numpy's in the last bits, a different token must tie
    the definition's within 1e-5 of its score."""
    xn, tn, sn = x.float().cpu().numpy(), temps.cpu().numpy(), steps.cpu().numpy()
    want = expected_tokens(xn, tn, sn, seed, quarter)
    got = tok.cpu().numpy()
    if DEV == "cpu":
        assert got.tolist() == want.tolist()
        return
    for row in np.nonzero(got != want)[0]:
        assert tn[row] >= 1e-5, row  # greedy rows: exact
        score = expected_scores(xn[row:row + 1], tn[row:row + 1], sn[row:row + 1], seed, quarter, row)
        assert abs(score[got[row]] - score[want[row]]) <= 1e-5 * max(1.0, abs(score[want[row]])), row


def test_greedy_rows_are_torchs_argmax_with_ties_and_padding():
    g = torch.Generator().manual_seed(0)
    for dtype, v, width in ((torch.float32, 300, 300), (torch.bfloat16, 1000, 1024), (torch.float16, 5000, 5120)):
        x = (torch.randn(6, width, generator=g) * 3).to(dtype).to(DEV)
        x[0, :v] = x[0, :v].round()  # many ties: the first maximal column wins
        x[1, 7] = x[1, 500 % v] = x[1, :v].max() + 1  # a tie of two maxima across chunks
        x[2, v:] = 1e4  # a padded LM head's columns: never picked
        x[3, :v] = -x[3, :v].abs() - 1  # all negative
        temps = torch.zeros(6, device=DEV)
        steps = torch.arange(6, dtype=torch.int64, device=DEV)
        tok = sample_tokens(x, temps, steps, seed=5, vocab_size=v, backend="triton")
        assert tok.tolist() == x[:, :v].float().argmax(dim=-1).tolist()
        assert steps.tolist() == list(range(6))  # greedy rows draw nothing


@pytest.mark.parametrize("v", [37, 128, 3000])
def test_sampled_rows_are_the_exponential_race_over_philox(v):
    g = torch.Generator().manual_seed(v)
    r = 5
    x = torch.randn(r, v, generator=g) * 2
    temps = torch.tensor([1.0, 0.0, 0.7, 1.6, 1e-6])
    steps = torch.tensor([0, 3, 11, (1 << 33) + 2, 4], dtype=torch.int64)
    seed = 0x1234_5678_9ABC
    from optllm.kernels.sample import _quarter

    x, temps, steps = x.to(DEV), temps.to(DEV), steps.to(DEV)
    before = steps.clone()
    tok = sample_tokens(x, temps, steps, seed=seed, backend="triton")
    assert_definition(tok, x, temps, before, seed, _quarter(v))
    # a sampled row's counter advanced by one; greedy rows' did not
    assert (steps - before).tolist() == [1, 0, 1, 1, 0]
    # the next call draws anew (the rows' counters moved): sampled rows change somewhere over a few calls
    seen = [tok.tolist()]
    for _ in range(6):
        seen.append(sample_tokens(x, temps, steps, seed=seed, backend="triton").tolist())
    assert len({s[0] for s in seen}) > 1 and len({s[1] for s in seen}) == 1


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """The p-value of Pearson's chi-square test of counts against probs."""
    return float(chisquare(counts, probs / probs.sum() * counts.sum()).pvalue)


LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5], dtype=np.float32)  # expected counts >= 11


def _check_softmax(counts: np.ndarray, t: float) -> None:
    """Pearson's test at significance 1e-3 against softmax(LOGITS / t) (a wrong temperature, a
    missing or reused noise stream or a biased uniform fails it; a correct sampler fails 1 run in
    1000), and the test's power: the same counts against temperature 1 are rejected."""
    probs = torch.softmax(torch.from_numpy(LOGITS) / t, dim=-1).double().numpy()
    p = _chi_square_p(counts, probs)
    assert p > 1e-3, (counts, probs * counts.sum(), p)
    assert _chi_square_p(counts, torch.softmax(torch.from_numpy(LOGITS), dim=-1).double().numpy()) < 1e-4


def test_the_philox_race_follows_softmax_at_the_temperature():
    """The kernel's definition (exactly the kernel's tokens, above): 6000 draws at temperature 0.8,
    rows of one logits vector over three steps, each row its own Philox stream."""
    r, t = 2000, 0.8
    x = np.broadcast_to(LOGITS, (r, 8))
    counts = np.zeros(8)
    for step in range(3):
        tok = expected_tokens(x, np.full(r, t), np.full(r, step), seed=77, quarter=16)
        counts += np.bincount(tok, minlength=8)
    _check_softmax(counts, t)


def test_the_kernel_draws_a_row_s_steps_as_the_definition():
    """A few launches of the kernel over one logits row: step after step, its tokens are the
    definition's (whose distribution the test above checks)."""
    x = torch.from_numpy(LOGITS).expand(4, -1).contiguous().to(DEV)
    temps, steps = torch.full((4,), 0.8, device=DEV), torch.tensor([0, 5, 9, 1 << 40], dtype=torch.int64, device=DEV)
    for _ in range(3):
        before = steps.clone()
        assert_definition(sample_tokens(x, temps, steps, seed=77, backend="triton"), x, temps, before, 77, 16)


def test_the_torch_backend_follows_softmax_at_the_temperature():
    r, t = 2000, 0.8
    x = torch.from_numpy(LOGITS).expand(r, -1).contiguous()
    gen = torch.Generator().manual_seed(1)
    counts = np.zeros(8)
    for _ in range(3):
        tok = sample_tokens(x, torch.full((r,), t), torch.zeros(r, dtype=torch.int64), seed=0, backend="torch",
                            generator=gen)
        counts += np.bincount(tok.numpy(), minlength=8)
    _check_softmax(counts, t)


def test_the_reference_takes_greedy_rows_and_the_padding_out():
    x = torch.randn(3, 40)
    x[:, 30:] = 1e4
    tok = sample_tokens_ref(x, torch.tensor([0.0, 0.0, 1.0]), 30, torch.Generator().manual_seed(0))
    assert tok[:2].tolist() == x[:2, :30].argmax(dim=-1).tolist() and 0 <= int(tok[2]) < 30


def test_bad_inputs_are_one_line_errors():
    x = torch.randn(2, 10)
    steps = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="vocab_size"):
        sample_tokens(x, torch.zeros(2), steps, 0, vocab_size=11)
    with pytest.raises(ValueError, match="temps / steps"):
        sample_tokens(x, torch.zeros(2, dtype=torch.float64), steps, 0)
    with pytest.raises(ValueError, match="logits"):
        sample_tokens(x.t(), torch.zeros(10), torch.zeros(10, dtype=torch.int64), 0)
