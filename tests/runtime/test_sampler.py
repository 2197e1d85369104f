"""Sampler: greedy, truncated sampling against the analytic distribution, penalties against
hand-computed logits, min_tokens, per-request seeds, logprobs; on CPU.

Distribution tests draw 20,000 samples (one batch of the same row) and require a total
variation distance below 0.03 from the float64 truncated + renormalised softmax (its expected
value here is about 0.01; the samples are seeded, so the test is deterministic), and no sample
outside the truncated support.
"""

import math

import pytest
import torch

from optllm.runtime.sampler import CHUNK_BYTES, Sampler, SamplerOutput, token_logprobs
from optllm.runtime.sampling_params import SamplingParams
from optllm.runtime.sequence import Sequence

N_SAMPLES = 20_000
TV_BOUND = 0.03


def _seq(outputs=(), prompt=(1, 2, 3), **params) -> Sequence:
    s = Sequence("r", list(prompt), SamplingParams(**params))
    for t in outputs:
        s.append_token(t)
    return s


def _logits(b, v, seed, scale=1.5, dtype=torch.float32):
    return (torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _expected(row: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> torch.Tensor:
    """The truncated, renormalised distribution in float64, straight from the definitions."""
    x = row.double() / temperature
    p = torch.softmax(x, -1)
    keep = torch.ones_like(p, dtype=torch.bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    order = torch.argsort(x, descending=True).tolist()
    if top_k:
        kept = [i for i in order if keep[i]]
        keep = torch.zeros_like(keep)
        keep[kept[:top_k]] = True
    if top_p < 1:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum()
        mass = 0.0
        for i in order:
            if keep[i]:
                keep[i] = mass < top_p  # keep while the more likely ones do not reach top_p yet
                mass += float(q[i])
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def _tv(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=expected.numel()).double() / tokens.numel()
    return 0.5 * float((freq - expected).abs().sum())


# ------------------------------------------------------------------------------ greedy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = _logits(9, 100, seed=1, dtype=dtype)
    logits[3, 10] = logits[3, 70] = logits[3].max() + 1  # a tie: the first index, as argmax
    seqs = [_seq(temperature=0.0) for _ in range(9)]
    out = Sampler(100, frozenset({0}))(logits, seqs)
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None and out.topk_ids is None
    assert torch.equal(out.token_ids, logits.argmax(-1)) and int(out.token_ids[3]) == 10
    # greedy rows with truncation settings, beside sampled rows: still the argmax
    seqs = [_seq(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2) if i % 2 else _seq(temperature=0.9, top_p=0.8)
            for i in range(9)]
    out = Sampler(100, frozenset({0}))(logits, seqs)
    assert torch.equal(out.token_ids[1::2], logits.argmax(-1)[1::2])


# ------------------------------------------------------------------------------ distributions
CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.3, top_k=5),
    dict(top_p=0.7),
    dict(min_p=0.15),
    dict(temperature=0.8, top_k=8, top_p=0.85, min_p=0.05),
    dict(temperature=2.0, top_k=12, min_p=0.1),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampled_distribution_matches_truncated_softmax(cfg):
    v = 24
    row = _logits(1, v, seed=len(str(cfg)))[0]
    seq = _seq(**cfg)
    out = Sampler(v, frozenset(), seed=3)(row.expand(N_SAMPLES, v), [seq] * N_SAMPLES)
    expected = _expected(row, **cfg)
    assert _tv(out.token_ids, expected) < TV_BOUND
    assert int((expected[out.token_ids] == 0).sum()) == 0, "sampled outside the truncated support"


def test_mixed_batch_greedy_and_sampled_rows():
    v = 24
    row = _logits(1, v, seed=5)[0]
    cfg = dict(temperature=0.7, top_k=6)
    seqs = [_seq(temperature=0.0) if i % 4 == 0 else _seq(**cfg) for i in range(N_SAMPLES)]
    out = Sampler(v, frozenset())(row.expand(N_SAMPLES, v), seqs)
    greedy = torch.arange(N_SAMPLES) % 4 == 0
    assert bool((out.token_ids[greedy] == row.argmax()).all())
    assert _tv(out.token_ids[~greedy], _expected(row, **cfg)) < TV_BOUND


@pytest.mark.parametrize("cfg,allowed", [
    (dict(top_k=3), lambda p: p >= p.topk(3).values[-1]),
    (dict(top_p=0.5), None),
    (dict(min_p=0.3), lambda p: p >= 0.3 * p.max()),
])
def test_truncated_tokens_never_sampled_large_vocab(cfg, allowed):
    v, n = 5000, 2000
    row = _logits(1, v, seed=7, scale=2.5)[0]
    out = Sampler(v, frozenset(), seed=1)(row.expand(n, v), [_seq(**cfg)] * n)
    p = torch.softmax(row.double(), -1)
    keep = _expected(row, **cfg) > 0 if allowed is None else allowed(p)
    assert bool(keep[out.token_ids].all())
    assert 1 < int(keep.sum()) < v  # the truncation is neither empty nor everything


# ------------------------------------------------------------------------------ penalties
def test_penalties_change_exactly_the_seen_logits():
    v = 16
    prompt, outputs = [3, 5, 5, 7], [5, 9, 9, 9, 11]
    base = _logits(1, v, seed=9, scale=0.5)[0]
    base[[3, 5, 7, 9, 11]] = torch.tensor([2.0, -1.0, 0.5, 2.2, -2.0])
    cfgs = [dict(), dict(repetition_penalty=1.5), dict(repetition_penalty=0.8), dict(presence_penalty=0.5),
            dict(frequency_penalty=0.25), dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=-0.25)]
    seqs = [_seq(outputs, prompt, temperature=0.0, **c) for c in cfgs]
    logits = base.expand(len(cfgs), v).clone()
    got = Sampler(v, frozenset({0}))(logits, seqs)
    x = Sampler(v, frozenset({0})).penalized_logits(logits, seqs)

    def rep(r):  # seen in prompt or output: 3, 5, 7, 9, 11
        e = base.clone()
        for t in (3, 5, 7, 9, 11):
            e[t] = e[t] / r if e[t] > 0 else e[t] * r
        return e

    counts = {5: 1.0, 9: 3.0, 11: 1.0}  # output tokens only
    pres, freq = base.clone(), base.clone()
    for t, c in counts.items():
        pres[t] -= 0.5
        freq[t] -= 0.25 * c
    both = rep(1.5)
    for t, c in counts.items():
        both[t] -= -0.25 * c + 0.5
    assert torch.equal(x[0], base)
    assert torch.equal(x[1], rep(1.5))
    assert torch.equal(x[2], rep(0.8))
    assert torch.equal(x[3], pres)
    assert torch.equal(x[4], freq)
    torch.testing.assert_close(x[5], both, rtol=0, atol=1e-6)
    assert torch.equal(x[:, [0, 1, 2, 4, 6, 8, 10, 12, 13, 14, 15]], logits[:, [0, 1, 2, 4, 6, 8, 10, 12, 13, 14, 15]])
    assert torch.equal(got.token_ids, x.argmax(-1))  # greedy is the argmax after penalties
    assert int(got.token_ids[0]) == 9 and int(got.token_ids[4]) == 3  # 2.2 - 3 * 0.25 < 2.0


def test_penalties_follow_growing_outputs_across_steps():
    # one sampler keeps each sequence's ids between steps; it must match a fresh one each step
    v = 50
    seqs = [_seq(prompt=[1, 2, 2], repetition_penalty=1.3, frequency_penalty=0.5, temperature=0.0),
            _seq(prompt=[7], presence_penalty=1.0, temperature=0.0)]
    kept = Sampler(v, frozenset())
    for step in range(6):
        logits = _logits(2, v, seed=step).t().contiguous().t()  # column-major: any layout works
        x = kept.penalized_logits(logits, seqs)
        assert torch.equal(x, Sampler(v, frozenset()).penalized_logits(logits, seqs))
        out = kept(logits, seqs)
        assert torch.equal(out.token_ids, x.argmax(-1))
        for s, t in zip(seqs, out.token_ids.tolist()):
            s.append_token(t)
    other = _seq(prompt=[1, 2, 2], outputs=[3], repetition_penalty=1.3, temperature=0.0)
    other.seq_id = seqs[0].seq_id  # a stale cache entry (different ids) must not leak in
    logits = _logits(1, v, seed=9)
    fresh = Sampler(v, frozenset()).penalized_logits(logits, [other])
    assert torch.equal(kept.penalized_logits(logits, [other]), fresh)


# ------------------------------------------------------------------------------ min_tokens
def test_min_tokens_blocks_eos_and_stop_ids():
    v, eos = 10, 2
    logits = torch.zeros(4, v)
    logits[:, eos], logits[:, 7], logits[:, 4] = 5.0, 4.0, 3.0
    seqs = [_seq([6], temperature=0.0, min_tokens=3, stop_token_ids=[7]),          # 1 out: blocked
            _seq([6, 6, 6], temperature=0.0, min_tokens=3, stop_token_ids=[7]),    # 3 out: free
            _seq([6], temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True),
            _seq([6], temperature=0.0, stop_token_ids=[7])]
    sampler = Sampler(v, frozenset({eos}))
    assert sampler(logits, seqs).token_ids.tolist() == [4, eos, eos, eos]
    x = sampler.penalized_logits(logits, seqs)
    assert x[0, eos] == -math.inf and x[0, 7] == -math.inf and x[2, 7] == -math.inf
    assert torch.equal(x[0, [0, 1, 3, 4, 5, 6, 8, 9]], logits[0, [0, 1, 3, 4, 5, 6, 8, 9]])
    assert torch.equal(x[1], logits[1]) and x[2, eos] == 5.0
    # sampled rows too: EOS holds ~70% of the mass but never comes out
    n = 2000
    out = sampler(logits[:1].expand(n, v), [_seq([6], temperature=1.0, min_tokens=2, stop_token_ids=[7])] * n)
    assert not bool(((out.token_ids == eos) | (out.token_ids == 7)).any())


# ------------------------------------------------------------------------------ seeds
def _run_seeded(seed_of_a: int, layout: str, sampler_seed: int, steps=24, v=1000):
    """Tokens of request A (seeded, sampled) over `steps` steps, in a batch laid out as `layout`."""
    tokens, outputs = [], []
    for step in range(steps):
        a_logits = _logits(1, v, seed=1000 + step, scale=0.5)[0]  # A's logits depend on its state only
        a = _seq(outputs, temperature=0.9, top_k=400, seed=seed_of_a)
        others = {"alone": [],
                  "middle": [_seq(top_p=0.5), _seq(outputs, temperature=0.0, repetition_penalty=1.2)],
                  "last": [_seq(min_p=0.1, seed=5), _seq(), _seq(temperature=0.3, logprobs=2), _seq()]}[layout]
        rows = others[: len(others) // 2] + [a] + others[len(others) // 2:]
        logits = _logits(len(rows), v, seed=step + 17 * len(layout), scale=0.5)
        logits[len(others) // 2] = a_logits
        out = Sampler(v, frozenset({0}), seed=sampler_seed)(logits, rows)
        tokens.append(int(out.token_ids[len(others) // 2]))
        outputs.append(tokens[-1])
    return tokens


def test_per_request_seed_is_independent_of_the_batch():
    ref = _run_seeded(1234, "alone", sampler_seed=0)
    assert _run_seeded(1234, "middle", sampler_seed=1) == ref
    assert _run_seeded(1234, "last", sampler_seed=2) == ref
    other = _run_seeded(1235, "alone", sampler_seed=0)
    assert sum(a != b for a, b in zip(ref, other)) >= 20  # different seed, different tokens


def test_unseeded_rows_follow_the_sampler_seed():
    logits = _logits(64, 500, seed=2, scale=0.3)
    seqs = [_seq() for _ in range(64)]
    a = Sampler(500, frozenset(), seed=7)(logits, seqs).token_ids
    b = Sampler(500, frozenset(), seed=7)(logits, seqs).token_ids
    c = Sampler(500, frozenset(), seed=8)(logits, seqs).token_ids
    assert torch.equal(a, b) and int((a != c).sum()) > 48


# ------------------------------------------------------------------------------ logprobs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_of_the_raw_logits(dtype):
    v = 40
    logits = _logits(6, v + 8, seed=4, dtype=dtype)  # 8 padded columns past the vocabulary
    logits[:, v:] = 100.0
    logits[2, 5] = logits[2, 6] = logits[2, 7]  # ties (rank counts strictly larger logits)
    seqs = [_seq(), _seq(logprobs=0), _seq(logprobs=3, temperature=0.0, repetition_penalty=2.0),
            _seq([4, 4], logprobs=5, temperature=0.5, top_k=4, frequency_penalty=1.0), _seq(top_p=0.3),
            _seq(logprobs=1, seed=3)]
    out = Sampler(v, frozenset({0}))(logits, seqs)
    raw = logits[:, :v].float()
    tok = out.token_ids
    assert bool((tok < v).all())
    assert out.logprobs.dtype == torch.float32 and out.ranks.dtype == torch.int64
    lsm = torch.log_softmax(raw, -1)
    torch.testing.assert_close(out.logprobs, lsm.gather(1, tok[:, None])[:, 0], rtol=0, atol=1e-6)
    ranks = [1 + int((raw[i] > raw[i, tok[i]]).sum()) for i in range(6)]
    assert out.ranks.tolist() == ranks
    assert out.topk_ids.shape == (6, 5) and out.topk_logprobs.shape == (6, 5)
    assert bool((out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:]).all())
    torch.testing.assert_close(out.topk_logprobs, lsm.topk(5, -1).values, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.topk_logprobs, lsm.gather(1, out.topk_ids), rtol=0, atol=0)
    # the greedy row with a penalty: token = argmax of the penalised logits, logprob of the raw
    x = Sampler(v, frozenset({0})).penalized_logits(logits, seqs)
    assert int(tok[2]) == int(x[2].argmax())


def test_token_logprobs_chunking_is_exact():
    n, v = 37, 1000
    logits = _logits(n, v, seed=6, dtype=torch.bfloat16)
    ids = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1))
    whole = token_logprobs(logits, ids, 4)
    chunked = token_logprobs(logits, ids, 4, chunk_bytes=5 * 4 * v)  # 5 rows per chunk
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)
    lp, rank, top_ids, top_lp = token_logprobs(logits, ids, 0)
    assert top_ids.shape == (n, 0) and top_lp.shape == (n, 0) and torch.equal(lp, whole[0])
    assert CHUNK_BYTES == 128 << 20


# ------------------------------------------------------------------------------ inputs
def test_bad_inputs():
    s = Sampler(10, frozenset({1}))
    with pytest.raises(ValueError, match="logits"):
        s(torch.zeros(2, 10), [_seq()])
    with pytest.raises(ValueError, match="logits"):
        s(torch.zeros(1, 9), [_seq()])
    with pytest.raises(ValueError, match="logits"):
        s(torch.zeros(1, 10, dtype=torch.int64), [_seq()])
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(0, frozenset())
    with pytest.raises(ValueError, match="eos_token_ids"):
        Sampler(10, frozenset({-1}))
    with pytest.raises(ValueError, match="k"):
        token_logprobs(torch.zeros(2, 10), torch.zeros(2, dtype=torch.int64), 11)
    with pytest.raises(ValueError, match="token_ids"):
        token_logprobs(torch.zeros(2, 10), torch.zeros(3, dtype=torch.int64), 1)
    assert isinstance(s(torch.zeros(0, 10), []), SamplerOutput)


# ------------------------------------------------------------------------------ the decode graph's own sampling
def test_graph_temperatures_only_where_a_temperature_is_all_a_row_needs():
    """What a decode graph can draw itself (kernels/sample.py): rows greedy or at a temperature
    alone, at least one sampling; anything the sampler must do sends the step back to it."""
    s = Sampler(100, frozenset({0}))
    t = dict(temperature=0.7)
    assert s.graph_temperatures([_seq(**t), _seq(temperature=0), _seq(temperature=1.3, top_k=100)]) == [0.7, 0.0, 1.3]
    shared = SamplingParams(**t)
    seqs = [Sequence(f"r{i}", [1, 2], shared) for i in range(3)]
    assert s.graph_temperatures(seqs) == [0.7] * 3  # one params object: checked once
    assert s.graph_temperatures([_seq(temperature=0), _seq(temperature=0)]) is None  # all greedy: the argmax path
    for extra in (dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(seed=3), dict(logprobs=2),
                  dict(repetition_penalty=1.2), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
                  dict(min_tokens=4)):
        assert s.graph_temperatures([_seq(**t), _seq(**t, **extra)]) is None, extra
        shared = SamplingParams(**t, **extra)
        assert s.graph_temperatures([Sequence("a", [1], shared), Sequence("b", [1], shared)]) is None, extra
    # a greedy row with a penalty, logprobs or an unmet min_tokens needs the sampler too
    for extra in (dict(repetition_penalty=1.2), dict(logprobs=1), dict(min_tokens=2)):
        assert s.graph_temperatures([_seq(**t), _seq(temperature=0, **extra)]) is None, extra
    # min_tokens met: the ban is over
    assert s.graph_temperatures([_seq(**t), _seq(outputs=(5, 6), temperature=0.5, min_tokens=2)]) == [0.7, 0.5]
