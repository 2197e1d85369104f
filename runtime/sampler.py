"""Sampler: the next token of every running sequence from its logits row, on the device.

Per row, in SamplingParams' order: repetition / presence / frequency penalties, min_tokens
(EOS and stop ids at -inf), then greedy rows take the argmax; sampled rows go on through
temperature, min_p, top_k, top_p and the exponential race argmax(probs / q), q ~ Exp(1),
evaluated as argmax(logits - log q) (the same argmax: log is monotone and log-softmax only
shifts a row; no softmax pass, no underflow of tiny probabilities). Stages no row uses are
skipped, and each is the identity for rows that do not use it, so a row's token does not
depend on which other rows share its batch. top_k and top_p mask by value: below the k-th
largest logit, below the last token of the nucleus; ties with that logit stay (as HF's top_k).
Per-step parameters travel to the device as one float tensor (penalties and min_tokens add
one int tensor of token ids each), through pinned memory: nothing here waits for the device.

Noise: a row with a seed draws its q from a generator seeded by mix(seed, index of the token),
so its tokens depend on nothing else (batch, position, preemption); rows without share the
sampler's own generator, seeded once at construction. A decode step whose rows are all greedy or
sampled at a temperature alone (``graph_temperatures``) does not come here on CUDA: its graph
draws the same race itself (kernels/sample.py), its noise Philox keyed by the engine's seed and
counted per graph row.
"""

from __future__ import annotations

import array
import math
from dataclasses import dataclass, field
from typing import Optional
from typing import Sequence as Seq

import torch

from .sampling_params import GREEDY_EPS
from .sequence import Sequence

CHUNK_BYTES = 128 << 20  # token_logprobs: the float32 row chunk it works on, at most
_MASK64 = (1 << 64) - 1


@dataclass
class SamplerOutput:
    """token_ids int64 [B] on the logits' device (from a decode graph's all-greedy step: the
    graph's own host copy of its argmax, cuda_graphs.HostTokens, read with tolist()). When any
    row asked for logprobs (else
    None): logprobs float32 [B] (of the sampled token), ranks int64 [B] (1 = most likely),
    topk_ids int64 [B, K] and topk_logprobs float32 [B, K], K = the largest request, sorted
    by decreasing log-probability. All log-probabilities are of the raw logits."""

    token_ids: torch.Tensor
    logprobs: Optional[torch.Tensor] = None
    ranks: Optional[torch.Tensor] = None
    topk_ids: Optional[torch.Tensor] = None
    topk_logprobs: Optional[torch.Tensor] = None


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int, *,
                   chunk_bytes: int = CHUNK_BYTES):
    """Log-probabilities of logits [N, V] (log_softmax in float32).

    Returns (logprob float32 [N] of token_ids [N], rank int64 [N]: 1 + the number of tokens
    with a strictly larger logit, topk_ids int64 [N, k], topk_logprobs float32 [N, k] in
    decreasing order). Works on row chunks whose float32 copy stays within chunk_bytes.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits: must be a float [N, V] tensor, got {logits.dtype} {tuple(logits.shape)}")
    n, v = logits.shape
    if token_ids.shape != (n,):
        raise ValueError(f"token_ids: must have shape ({n},), got {tuple(token_ids.shape)}")
    if not isinstance(k, int) or not 0 <= k <= v:
        raise ValueError(f"k: must be an integer in [0, {v}], got {k!r}")
    dev = logits.device
    lp = torch.empty(n, device=dev, dtype=torch.float32)
    rank = torch.empty(n, device=dev, dtype=torch.int64)
    top_ids = torch.empty((n, k), device=dev, dtype=torch.int64)
    top_lp = torch.empty((n, k), device=dev, dtype=torch.float32)
    ids = token_ids.to(dev, torch.int64).unsqueeze(1)
    step = max(1, chunk_bytes // (4 * max(v, 1)))
    for s in range(0, n, step):
        e = min(n, s + step)
        x, t = logits[s:e], ids[s:e]
        full = torch.log_softmax(x, dim=-1, dtype=torch.float32)
        lp[s:e] = full.gather(1, t).squeeze(1)
        # ranks from the raw logits: exact, where log_softmax's rounding could merge values
        torch.sum(x > x.gather(1, t), dim=1, out=rank[s:e]).add_(1)
        if k:
            torch.topk(full, k, dim=1, out=(top_lp[s:e], top_ids[s:e]))
    return lp, rank, top_ids, top_lp


def _mix(seed: int, index: int) -> int:
    """A 63-bit generator seed from (request seed, token index): splitmix64's finaliser."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _row_seed(s: Sequence) -> int:
    """The generator seed of a seeded row: (request seed, completion index, token index) mixed;
    completion 0 keeps the plain request seed, so n = 1 and the first of n draw alike."""
    seed = s.params.seed if s.index == 0 else _mix(s.params.seed, -1 - s.index)
    return _mix(seed, s.num_output_tokens)


def _to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One host-to-device copy that does not wait for the device (pinned staging on CUDA)."""
    if device.type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, device=device)


@dataclass
class _Step:
    """What one pass over the rows found: per-row fields and the stages some row needs."""

    greedy: list = field(default_factory=list)
    temp: list = field(default_factory=list)
    log_min_p: list = field(default_factory=list)
    top_p: list = field(default_factory=list)
    top_k: list = field(default_factory=list)
    rep: list = field(default_factory=list)
    pres: list = field(default_factory=list)
    freq: list = field(default_factory=list)
    pen_rows: list = field(default_factory=list)  # rows with any penalty
    ban_rows: list = field(default_factory=list)  # (ban_rows[j], ban_ids[j]) -> -inf
    ban_ids: list = field(default_factory=list)
    seeded: list = field(default_factory=list)  # (row, generator seed) of seeded sampled rows
    k_max: int = -1  # the most logprobs asked for, -1: none


class Sampler:
    """Batched sampling over a vocabulary of ``vocab_size`` tokens (wider logits rows, e.g. a
    padded LM head, are cut to it). eos_token_ids: what min_tokens suppresses (unless the
    request ignores EOS), with each request's stop_token_ids. seed: the generator of the
    rows without their own seed."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], seed: int = 0) -> None:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size={vocab_size!r} is not allowed; allowed: an integer >= 1")
        if not all(isinstance(t, int) and t >= 0 for t in eos_token_ids):
            raise ValueError(f"eos_token_ids={eos_token_ids!r} is not allowed; allowed: token ids >= 0")
        if not isinstance(seed, int):
            raise ValueError(f"seed={seed!r} is not allowed; allowed: an integer")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}  # per device, seeded once
        self._scratch: dict[torch.device, torch.Generator] = {}  # re-seeded per seeded row
        self._token_cache: dict[int, array.array] = {}  # seq_id -> token ids, penalised rows

    def _generator(self, table: dict, device: torch.device) -> torch.Generator:
        g = table.get(device)
        if g is None:
            g = table[device] = torch.Generator(device=device).manual_seed(self.seed)
        return g

    def graph_temperatures(self, seqs: Seq[Sequence]) -> list[float] | None:
        """Each row's temperature (0.0: greedy) when some row samples and every row's token is the
        argmax or a draw at its temperature alone -- what a decode graph's own sampling
        (kernels/sample.py) computes; None when a row needs this sampler: penalties, an unmet
        min_tokens, logprobs, a seed, min_p, top_p or top_k, or when every row is greedy (the
        graph's argmax serves that case through ``__call__``)."""
        p = seqs[0].params if seqs else None
        if p is not None and all(s.params is p for s in seqs):  # LLM.generate's usual case: one params
            if p.temperature < GREEDY_EPS or not self._temperature_only(p):
                return None
            if p.min_tokens and any(s.num_output_tokens < p.min_tokens for s in seqs):
                return None
            return [p.temperature] * len(seqs)
        out, sampled = [], False
        for s in seqs:
            p = s.params
            if not self._temperature_only(p) or (p.min_tokens and s.num_output_tokens < p.min_tokens):
                return None
            g = p.temperature < GREEDY_EPS
            sampled = sampled or not g
            out.append(0.0 if g else p.temperature)
        return out if sampled else None

    def _temperature_only(self, p) -> bool:
        """Whether a row of these params takes the argmax or a draw at its temperature, nothing else."""
        if p.uses_penalties or p.logprobs is not None:
            return False
        return p.temperature < GREEDY_EPS or (p.seed is None and p.temperature_only(self.vocab_size))

    def _check(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        V = self.vocab_size
        if logits.dim() != 2 or logits.shape[0] != len(seqs) or logits.shape[1] < V \
                or not logits.is_floating_point():
            raise ValueError(f"logits: must be a float [{len(seqs)}, >= {V}] tensor (one row per "
                             f"sequence), got {logits.dtype} {tuple(logits.shape)}")
        return logits[:, :V] if logits.shape[1] > V else logits

    def _scan(self, seqs: Seq[Sequence]) -> _Step:
        p = seqs[0].params if seqs else None
        if p is not None and all(s.params is p for s in seqs):
            return self._scan_shared(seqs, p)
        return self._scan_rows(seqs)

    def _scan_shared(self, seqs: Seq[Sequence], p) -> _Step:
        """_scan_rows when every row shares one SamplingParams (LLM.generate's usual case):
        the per-row lists are one value repeated; only min_tokens and seeds look at rows."""
        V, B, st = self.vocab_size, len(seqs), _Step()
        st.k_max = -1 if p.logprobs is None else p.logprobs
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            st.pen_rows = list(range(B))
        if p.min_tokens:
            ids = set(p.stop_token_ids) if p.ignore_eos else self.eos_token_ids.union(p.stop_token_ids)
            ids = sorted(t for t in ids if t < V)
            for i, s in enumerate(seqs):
                if s.num_output_tokens < p.min_tokens:
                    st.ban_rows += [i] * len(ids)
                    st.ban_ids += ids
        st.rep, st.pres, st.freq = [p.repetition_penalty] * B, [p.presence_penalty] * B, [p.frequency_penalty] * B
        g = p.temperature < GREEDY_EPS
        st.greedy = [g] * B
        if g:
            st.temp, st.log_min_p, st.top_p, st.top_k = [1.0] * B, [-math.inf] * B, [1.0] * B, [0] * B
            return st
        st.temp = [p.temperature] * B
        st.log_min_p = [math.log(p.min_p) if p.min_p > 0 else -math.inf] * B
        st.top_p = [p.top_p] * B
        st.top_k = [p.top_k if p.top_k < V else 0] * B
        if p.seed is not None:
            st.seeded = [(i, _row_seed(s)) for i, s in enumerate(seqs)]
        return st

    def _scan_rows(self, seqs: Seq[Sequence]) -> _Step:
        """Per-row parameter lists; each distinct SamplingParams is read once."""
        V, st = self.vocab_size, _Step()
        if not seqs:
            return st
        derived: dict[int, tuple] = {}
        vals = []
        for s in seqs:
            p = s.params
            v = derived.get(id(p))
            if v is None:
                g = p.temperature < GREEDY_EPS
                pen = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                # greedy rows carry neutral values: they ride through the sampling stages unchanged
                v = derived[id(p)] = (
                    p.repetition_penalty, p.presence_penalty, p.frequency_penalty, g,
                    1.0 if g else p.temperature,
                    -math.inf if g or p.min_p <= 0 else math.log(p.min_p),
                    1.0 if g else p.top_p, 0 if g or p.top_k >= V else p.top_k, pen)
            vals.append(v)
        st.rep, st.pres, st.freq, st.greedy, st.temp, st.log_min_p, st.top_p, st.top_k, pens = (
            list(col) for col in zip(*vals))
        st.pen_rows = [i for i, pen in enumerate(pens) if pen]
        for i, s in enumerate(seqs):
            p = s.params
            if p.logprobs is not None and p.logprobs > st.k_max:
                st.k_max = p.logprobs
            if p.min_tokens and s.num_output_tokens < p.min_tokens:
                ids = set(p.stop_token_ids) if p.ignore_eos else self.eos_token_ids.union(p.stop_token_ids)
                ids = sorted(t for t in ids if t < V)
                st.ban_rows += [i] * len(ids)
                st.ban_ids += ids
            if p.seed is not None and not st.greedy[i]:
                st.seeded.append((i, _row_seed(s)))
        return st

    def _adjust(self, x: torch.Tensor, seqs: Seq[Sequence], st: _Step, P: dict) -> None:
        """Penalties, then min_tokens, in place on x [B, V] float32."""
        if st.pen_rows:
            self._penalize(x, seqs, st.pen_rows, st.rep, P)
        if st.ban_rows:
            ban = _to_device([st.ban_rows, st.ban_ids], torch.int64, x.device)
            # fill with a scalar: x[rows, ids] = value would copy the value from the host (a sync)
            x.view(-1).index_fill_(0, ban[0] * x.shape[1] + ban[1], -math.inf)

    @torch.no_grad()
    def penalized_logits(self, logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
        """float32 [B, vocab_size]: logits after the penalties and min_tokens, i.e. what a
        greedy row takes the argmax of (a new tensor; for tests and inspection)."""
        logits = self._check(logits, seqs)
        st = self._scan(seqs)
        P = _params(st, ("rep", "pres", "freq") if st.pen_rows else (), logits.device)
        x = _float_copy(logits)
        self._adjust(x, seqs, st, P)
        return x

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence], greedy: torch.Tensor | None = None) -> SamplerOutput:
        """logits [B, >= vocab_size] (any float dtype), row i for seqs[i] -> SamplerOutput.
        greedy: int64 [B], the logits' argmax over the vocabulary if the caller has it (a decode
        graph computes it inside; or that graph's host copy, HostTokens): taken as is when every
        row decodes greedily, unmodified."""
        logits = self._check(logits, seqs)
        st = self._scan(seqs)
        all_greedy, any_greedy = all(st.greedy), any(st.greedy)
        modify = bool(st.pen_rows or st.ban_rows)
        if all_greedy and not modify and st.k_max < 0:
            return SamplerOutput(logits.argmax(dim=-1) if greedy is None else greedy)
        # the parameters that some stage reads, in one float tensor (one copy to the device)
        used = [name for name, on in (
            ("greedy", any_greedy and not all_greedy), ("temp", any(t != 1.0 for t in st.temp)),
            ("log_min_p", any(m > -math.inf for m in st.log_min_p)),
            ("top_p", any(t < 1.0 for t in st.top_p)), ("top_k", any(st.top_k)),
            ("rep", bool(st.pen_rows)), ("pres", bool(st.pen_rows)), ("freq", bool(st.pen_rows))) if on]
        P = _params(st, used, logits.device)
        x = _float_copy(logits) if modify or not all_greedy else logits
        self._adjust(x, seqs, st, P)
        if all_greedy:
            token_ids = x.argmax(dim=-1)
        else:
            greedy_ids = x.argmax(dim=-1) if any_greedy else None
            unseeded = len(st.seeded) < len(seqs) - sum(st.greedy)
            token_ids = self._sample(x, P, max(st.top_k), st.seeded, unseeded)
            if greedy_ids is not None:
                token_ids = torch.where(P["greedy"] > 0, greedy_ids, token_ids)
        if st.k_max < 0:
            return SamplerOutput(token_ids)
        return SamplerOutput(token_ids, *token_logprobs(logits, token_ids, st.k_max))

    def _tokens(self, seqs: Seq[Sequence], rows: list[int]) -> tuple[bytearray, list[int], list[int]]:
        """All token ids (prompt + output) of the rows, as int64 bytes, with each row's
        length and prompt length. Each sequence's ids are kept as an int64 array between
        calls and only the new outputs are appended (Sequence's ids only grow), so a step costs
        a memcpy, not a Python-int conversion of every prompt; sequences absent from this call
        leave the cache."""
        cache, fresh = self._token_cache, {}
        arrays, lens, prompt_lens = [], [], []
        for i in rows:
            s = seqs[i]
            ids = s.token_ids
            a = cache.get(s.seq_id)
            n = 0 if a is None else len(a)
            if a is None or n > len(ids) or (n and a[-1] != ids[n - 1]):
                a = array.array("q", ids)
            elif n < len(ids):
                a.extend(ids[n:])
            fresh[s.seq_id] = a
            arrays.append(a)
            lens.append(len(a))
            prompt_lens.append(s.num_prompt_tokens)
        self._token_cache = fresh
        return bytearray().join(arrays), lens, prompt_lens

    def _penalize(self, x: torch.Tensor, seqs: Seq[Sequence], rows: list[int], rep: list[float],
                  P: dict) -> None:
        """Repetition (over prompt + output tokens), then frequency and presence (over output
        tokens) penalties, in place on x [B, V] float32 (contiguous)."""
        B, V = x.shape
        dev = x.device
        flat, lens, prompt_lens = self._tokens(seqs, rows)
        n = len(flat) // 8
        meta = _to_device([rows, lens, prompt_lens], torch.int64, dev)
        width = V + 1  # flat index row * (V + 1) + id; ids outside the vocabulary land in column V
        counts = torch.zeros(B * width, device=dev, dtype=torch.float32)
        if n:
            ids = torch.frombuffer(flat, dtype=torch.int64)
            ids = (ids.pin_memory() if dev.type == "cuda" else ids).to(dev, non_blocking=True).clamp_(0, V)
            lens_t = meta[1]
            starts = torch.cumsum(lens_t, 0) - lens_t
            row_of = torch.repeat_interleave(torch.arange(len(rows), device=dev), lens_t, output_size=n)
            is_out = torch.arange(n, device=dev) - starts[row_of] >= meta[2][row_of]
            flat_idx = meta[0][row_of] * width + ids
            counts.index_add_(0, flat_idx, is_out.float())
        if any(rep[i] != 1.0 for i in rows):
            seen = torch.zeros(B * width, device=dev, dtype=torch.bool)
            if n:  # fill with a scalar: x[idx] = value would copy the value from the host
                seen.index_fill_(0, flat_idx, True)
            seen = seen.view(B, width)[:, :V]
            penalty = P["rep"][:, None]
            x.copy_(torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x))
        counts = counts.view(B, width)[:, :V]
        x.sub_(counts * P["freq"][:, None] + (counts > 0) * P["pres"][:, None])

    def _sample(self, x: torch.Tensor, P: dict, top_k_max: int, seeded: list,
                use_unseeded: bool) -> torch.Tensor:
        """Temperature, min_p, top_k, top_p, then the exponential race, on x [B, V] float32
        (modified in place) -> token ids [B]. seeded: (row, generator seed) pairs;
        use_unseeded: whether any sampled row draws from the shared generator."""
        if "temp" in P:
            x.div_(P["temp"][:, None])
        if "log_min_p" in P:  # p < min_p * p_max  <=>  logit < max logit + log(min_p)
            x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + P["log_min_p"][:, None], -math.inf)
        if "top_p" in P:  # one sort serves top_k and top_p
            sx = x.sort(dim=-1, descending=True).values
            kth = _kth_largest(sx, P["top_k"]) if "top_k" in P else None
            if kth is not None:
                sx.masked_fill_(sx < kth, -math.inf)
            probs = sx.softmax(dim=-1)
            before = probs.cumsum(dim=-1).sub_(probs)  # mass of the more likely tokens
            # keep while the more likely ones hold less than top_p (the first always); top_p = 1
            # keeps all, also where the cumsum rounds up to 1 before the tail
            p = torch.where(P["top_p"] < 1.0, P["top_p"], math.inf)[:, None]
            n_keep = (before < p).sum(dim=-1, keepdim=True)
            # mask by value below the last kept one (ties with it stay): no scatter back
            last = sx.gather(1, n_keep - 1)
            x.masked_fill_(x < (last if kth is None else torch.maximum(last, kth)), -math.inf)
        elif "top_k" in P:  # no top_p: the k_max largest are enough, no full sort
            x.masked_fill_(x < _kth_largest(torch.topk(x, top_k_max, dim=-1).values, P["top_k"]), -math.inf)
        q = torch.empty_like(x)
        if use_unseeded:
            q.exponential_(generator=self._generator(self._shared, x.device))
        if seeded:
            g = self._generator(self._scratch, x.device)
            for row, s in seeded:
                q[row].exponential_(generator=g.manual_seed(s))
        if not q.is_cuda:  # CUDA's exponential_ never returns 0; elsewhere 0 would give -inf + inf
            q.clamp_min_(torch.finfo(torch.float32).tiny)
        return x.sub_(q.log_()).argmax(dim=-1)


def _float_copy(logits: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 copy, for the in-place stages (flat indexing needs contiguity)."""
    return torch.empty(logits.shape, device=logits.device, dtype=torch.float32).copy_(logits)


def _kth_largest(sorted_desc: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, 1]: each row's k-th largest logit, -inf where k = 0 (off). sorted_desc: the rows
    sorted descending, at least max(k) wide; k [B] float. Masking below it keeps ties, as HF."""
    kk = k.long().clamp(1, sorted_desc.shape[1])
    return torch.where(k[:, None] > 0, sorted_desc.gather(1, (kk - 1)[:, None]), -math.inf)


def _params(st: _Step, names, device: torch.device) -> dict:
    """{name: float32 [B] on device} for the named _Step fields, in one copy."""
    names = list(names)
    if not names:
        return {}
    return dict(zip(names, _to_device([getattr(st, n) for n in names], torch.float32, device)))
