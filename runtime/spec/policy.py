"""Adaptive speculation: how big a token tree each step verifies -- down to none -- so that
speculation never makes a busy engine slower.

A step's choice is a tree size n from a menu (the configured tree and prefixes of it: the
first n nodes of a static tree, the n - 1 best-scored nodes of an EAGLE-2 tree; both are
trees, every parent kept before its children), or 1: no speculation. It maximises the
expected tokens per second of the step's eligible decodes,

    sum_i (1 + acc_i(n)) / cost(n, B)      against      B / cost(1, B)

with B the eligible sequences, acc_i(n) sequence i's expected accepted draft tokens under a
tree of n nodes, and cost(n, B) the measured time of a speculative step (draft proposal plus
the target's verify forward over B * n tokens; cost(1, B) a plain decode) from the start-up
profile (``CostTable``). Speculation must win by ``margin`` to be chosen: 5%, since the
estimates are noisy and are all taken in the engine that holds the draft, whose plain steps ran
2-7% slower than a draft-less engine's on the H200 at batch 64 (host work; the same decode graph
time), so a choice the estimates call a 2% win could lose against decoding without a draft.

acc_i(n) for every menu size comes from each verify of the largest tree: under greedy acceptance
the path a smaller prefix-tree accepts is the full tree's accepted path cut at its first node
outside the prefix (only one child of a node can match the target's argmax), so one verify
scores every smaller size exactly (sampling: the same count, an estimate). Each sequence keeps
an exponential moving average per size, starting from the engine-wide average of the sequences
seen so far, which starts from the draft's training record (``acceptance_prior``: its held-out
top-1 accuracy; without one, an uninformed guess of one token at the largest size, under which
the H200's policy hardly ever speculated at batch 1 where the 41-node tree won 1.2x). A size
that could not win even if every draft token were accepted (``max_accept``: the tree's depth) is
never chosen. While speculation is off nothing is observed, so each plain step moves every
sequence's estimates back toward the engine-wide ones (``relax``: it keeps 0.9 of its distance a
step): a few rejected steps in a row, common when half the first draft tokens are rejected, had
kept a sequence's estimate low, and so speculation off, until the next exploration -- at batch 1
on the H200 speculation ran 127 of 605 steps while its steps gave 1.26x a plain step's tokens a
ms. And now and then a step verifies the largest size that could win -- its one verify scores
every smaller size too, while a small tree's says nothing of the larger ones (exploring with the
smallest, the H200's policy never learned that its 41-node tree accepted 2.1-2.3 tokens) --
after ``explore_every`` steps without speculation at least, and rarely enough that exploring
costs at most ``explore_budget`` of the plain steps' time.

The start-up profile times the steps' GPU paths on an idle engine; a serving step also pays its
host side (building inputs, the per-sequence bookkeeping of acceptance, a catch-up outside the
graph), which grows with the batch and differs between plain and speculative steps. So the
engine reports each pure step's measured wall time (``observe_cost``: every eligible decode
plain, or every one speculating with the same tree), and cost(n, B) is the profile's time times
a running ratio measured / profiled, per tree size and power-of-two batch bucket (the profile
counts as one observation; each ratio is clamped to [1/4, 20] against a stray stall). A tree
that looked cheap at start-up but is slow in service stops being chosen. The engine times the
whole step (scheduling, the runner, the output bookkeeping), so the host's share, which grows
with the batch and the tokens a step emits, is in the ratio too.

Switching speculation on has a cost of its own: EAGLE's draft must first run over every row the
plain steps computed without it (``catch_up``: c0 + c1 * rows milliseconds, profiled at start-up
and corrected by a measured ratio like the steps'). A step whose sequences are behind by R rows
carries catch_up(R) spread over the speculative steps a switch is expected to last (the running
mean length of the stretches of speculative steps so far, 4 before any): the H200 measured
catch-ups of 6000-7500 rows at 7-12 ms each at batch 64 (docs/BENCHMARKS.md, sixteenth session),
5-8 plain steps' worth, that the policy did not see. Plain Python, no torch.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class CostTable:
    """ms[n][j]: measured milliseconds of one step for batch sizes batches[j] and tree size n
    (n = 1: a plain decode step). Linear interpolation in the batch size between measured
    points, linear extrapolation past the last one (proportional below the first)."""

    batches: list[int]
    ms: dict[int, list[float]]

    def __post_init__(self) -> None:
        if not self.batches or sorted(set(self.batches)) != list(self.batches) or self.batches[0] < 1:
            raise ValueError(f"batches={self.batches!r}: allowed: increasing batch sizes >= 1")
        for n, row in self.ms.items():
            if len(row) != len(self.batches) or any(not v > 0 for v in row):
                raise ValueError(f"ms[{n}]: one positive time per batch size, got {row!r}")
        if 1 not in self.ms:
            raise ValueError("ms: the plain decode step (n = 1) must be measured")

    def cost(self, n: int, batch: int) -> float:
        row, xs = self.ms[n], self.batches
        if batch <= xs[0]:
            return row[0] * batch / xs[0] if batch < xs[0] else row[0]
        j = bisect.bisect_left(xs, batch)
        if j == len(xs):  # past the last point: the slope of the last segment (or proportional)
            if len(xs) == 1:
                return row[0] * batch / xs[0]
            slope = (row[-1] - row[-2]) / (xs[-1] - xs[-2])
            return row[-1] + max(slope, 0.0) * (batch - xs[-1])
        if xs[j] == batch:
            return row[j]
        t = (batch - xs[j - 1]) / (xs[j] - xs[j - 1])
        return row[j - 1] + t * (row[j] - row[j - 1])


@dataclass
class AdaptivePolicy:
    """sizes: the menu of tree sizes (> 1), the largest being the configured tree; cost: the
    start-up profile, measured for every size in the menu and for 1; prior: expected accepted
    draft tokens per size before anything is observed."""

    sizes: list[int]
    cost: CostTable
    prior: dict[int, float] | None = None
    max_accept: dict[int, int] | None = None  # the most draft tokens each size can give (None: n - 1)
    decay: float = 0.8  # weight of the past in each sequence's average
    margin: float = 1.05  # speculation must be this much faster than a plain step
    explore_every: int = 16
    explore_budget: float = 0.01
    relax: float = 0.9  # a plain step keeps this share of each sequence's distance from the engine-wide estimate
    cost_decay: float = 0.9  # weight of the past in each measured / profiled ratio
    _seq: dict[int, dict[int, float]] = field(default_factory=dict)
    _ratio: dict[tuple[int, int], float] = field(default_factory=dict)
    _ratio_n: dict[tuple[int, int], int] = field(default_factory=dict)
    _global: dict[int, float] = field(default_factory=dict)
    _global_n: int = 0
    _idle: int = 0
    _plain_run: int = 0  # plain steps since the last speculative one (the estimates' relaxation)
    last_choice: int = 1
    # the draft's catch-up over rows of plain steps: (c0 ms, c1 ms a row) from the start-up profile
    # (None: free, Medusa's), times a measured ratio; the mean length of speculative stretches
    catch_up: tuple[float, float] | None = None
    run_len: float = 4.0
    _cu_ratio: float = 1.0
    _cu_n: int = 0
    _run: int = 0
    # the summed estimates of the last choose()'s sequences, kept while neither the set nor any
    # estimate changed (a plain stretch observes nothing: each of its steps costs a tuple compare)
    _version: int = 0
    _sums: tuple | None = None

    def __post_init__(self) -> None:
        self.sizes = sorted(set(self.sizes))
        if not self.sizes or self.sizes[0] < 2:
            raise ValueError(f"sizes={self.sizes!r}: allowed: tree sizes >= 2")
        missing = [n for n in [1, *self.sizes] if n not in self.cost.ms]
        if missing:
            raise ValueError(f"the cost table has no times for tree sizes {missing}")
        base = self.prior or {n: 1.0 * (n - 1) / (self.sizes[-1] - 1) if self.sizes[-1] > 1 else 0.0
                              for n in self.sizes}
        self._global = {n: float(base.get(n, 0.0)) for n in self.sizes}

    @staticmethod
    def _bucket(batch: int) -> int:
        """The power of two >= batch."""
        return 1 << max(batch - 1, 0).bit_length()

    def step_cost(self, n: int, batch: int) -> float:
        """Expected milliseconds of a step of `batch` decodes with trees of n nodes (1: plain):
        the profile's time times the measured ratio of its (n, batch bucket), 1 until measured."""
        return self.cost.cost(n, batch) * self._ratio.get((n, self._bucket(batch)), 1.0)

    def observe_cost(self, n: int, batch: int, ms: float) -> None:
        """A pure step's measured wall milliseconds: `batch` decodes, all plain (n = 1) or all
        verifying trees of n nodes."""
        if n not in self.cost.ms or batch < 1 or not ms > 0:
            return
        key = (n, self._bucket(batch))
        count = self._ratio_n.get(key, 0) + 1
        self._ratio_n[key] = count
        self._ratio[key] = self._updated_ratio(self._ratio.get(key, 1.0), count, ms / self.cost.cost(n, batch))

    def catch_up_cost(self, rows: int) -> float:
        """Expected milliseconds of the draft's catch-up over `rows` rows (0 without a profile)."""
        if self.catch_up is None or rows <= 0:
            return 0.0
        c0, c1 = self.catch_up
        return (c0 + c1 * rows) * self._cu_ratio

    def observe_catch_up(self, rows: int, ms: float) -> None:
        """A catch-up's measured wall milliseconds over `rows` rows."""
        if self.catch_up is None or rows <= 0 or not ms > 0:
            return
        self._cu_n += 1
        c0, c1 = self.catch_up
        self._cu_ratio = self._updated_ratio(self._cu_ratio, self._cu_n, ms / (c0 + c1 * rows))

    def _updated_ratio(self, ratio: float, count: int, measured: float) -> float:
        """A running measured / profiled ratio after its count-th observation `measured`: the
        profile counts as one observation, the past weighs cost_decay at most, each observation
        clamped to [1/4, 20] against a stray stall."""
        w = min(self.cost_decay, 1.0 - 1.0 / (count + 1))
        return w * ratio + (1.0 - w) * min(max(measured, 0.25), 20.0)

    def expected(self, seq_id: int) -> dict[int, float]:
        return self._seq.get(seq_id) or self._global

    def choose(self, seq_ids: list[int], budget: int | None = None, behind: int = 0) -> int:
        """The tree size for a step whose eligible decodes are seq_ids (1: no speculation);
        budget: the step's token budget (sizes whose B * n exceeds it are not considered);
        behind: the rows the draft must catch up on first (their cost spread over a stretch)."""
        b = len(seq_ids)
        if b == 0:
            return self._chose(1)
        extra = self.catch_up_cost(behind) / max(self.run_len, 1.0)
        plain_ms = self.step_cost(1, b)
        plain = b / plain_ms
        best, best_rate = 1, plain * self.margin
        can_win = []
        sums = None
        for n in self.sizes:
            if budget is not None and b * n > budget:
                continue
            top = (self.max_accept or {}).get(n, n - 1)
            spec_ms = self.step_cost(n, b) + extra
            if b * (1.0 + top) / spec_ms <= plain * self.margin:
                continue  # slower than plain even if every draft token were accepted
            can_win.append(n)
            if sums is None:
                sums = self._relaxed(self._summed(seq_ids), b)
            rate = (b + sums[n]) / spec_ms
            if rate > best_rate:
                best, best_rate = n, rate
        if best == 1:
            self._idle += 1
            if can_win:
                n = can_win[-1]
                # an exploring step is one step, so it pays the whole catch-up, not a stretch's share
                # (charged a share, explorations after long plain stretches took ~3% of a batch-8
                # run on the H200 against the 1% budget)
                over = max((self.step_cost(n, b) + self.catch_up_cost(behind)) / plain_ms - 1.0, 0.0)
                if self._idle >= max(self.explore_every, math.ceil(over / self.explore_budget)):
                    self._idle = 0
                    return self._chose(n, explored=True)
        else:
            self._idle = 0
        return self._chose(best)

    def _chose(self, best: int, explored: bool = False) -> int:
        """Record a choice: the stretch of speculative steps it ends feeds run_len. An exploring
        step is not a stretch the estimates chose: counted as one, explorations (each a single
        step) would pull run_len toward 1, which charges a switch the whole catch-up, which keeps
        speculation off, which leaves only explorations."""
        if best > 1 and not explored:
            self._run += 1
        elif self._run:
            self.run_len = self.decay * self.run_len + (1 - self.decay) * self._run
            self._run = 0
        if best == 1:
            self._plain_run += 1
        elif self._plain_run:  # the estimates this choice saw become the ones the verify updates
            keep = self.relax ** self._plain_run
            for est in self._seq.values():
                for n, g in self._global.items():
                    est[n] = g + (est[n] - g) * keep
            self._version += 1
            self._plain_run = 0
        self.last_choice = best
        return best

    def _relaxed(self, sums: dict[int, float], b: int) -> dict[int, float]:
        """Summed estimates of b sequences after the plain steps since the last speculative one:
        each sequence's distance from the engine-wide estimate times relax per step (a sequence
        without estimates of its own has none)."""
        if not self._plain_run or self.relax >= 1.0:
            return sums
        keep = self.relax ** self._plain_run
        return {n: b * self._global[n] + (v - b * self._global[n]) * keep for n, v in sums.items()}

    def idle(self) -> None:
        """A step the caller decided plainly without asking (nothing changed since a choice of 1):
        counts toward exploring as a choice of 1 would."""
        self._idle += 1
        self._chose(1)

    def _summed(self, seq_ids: list[int]) -> dict[int, float]:
        """Per tree size, the expected accepted draft tokens summed over seq_ids."""
        key = tuple(seq_ids)
        if self._sums is not None and self._sums[0] == self._version and self._sums[1] == key:
            return self._sums[2]
        sums = dict.fromkeys(self.sizes, 0.0)
        for s in seq_ids:
            e = self._seq.get(s) or self._global
            for n in self.sizes:
                sums[n] += e[n]
        self._sums = (self._version, key, sums)
        return sums

    def observe(self, seq_id: int, accepted: dict[int, int]) -> None:
        """One verify's accepted draft tokens for sequence seq_id, per tree size it scores."""
        self.observe_many([seq_id], list(accepted), [list(accepted.values())])

    def observe_many(self, seq_ids, sizes, rows) -> None:
        """``observe`` for a step's sequences at once, in order: rows[i][j] = the draft tokens
        seq_ids[i]'s verify accepted under a tree of sizes[j] nodes (sizes outside the menu are
        ignored). One call a step: a speculative step at batch 64 spent ~0.2 ms of host time
        observing its sequences one call each."""
        self._version += 1
        d = self.decay
        e = 1.0 - d
        glob, seqs = self._global, self._seq
        cols = [(j, n) for j, n in enumerate(sizes) if n in glob]
        gn = self._global_n
        g = h = 0.0
        for sid, row in zip(seq_ids, rows):
            est = seqs.get(sid)
            if est is None:
                est = seqs[sid] = dict(glob)
            gn += 1
            if g != 0.98:  # (0.98 from the 49th observation on)
                g = min(0.98, 1.0 - 1.0 / (gn + 1))  # the prior counts as one observation
                h = 1.0 - g
            for j, n in cols:
                k = row[j]
                est[n] = d * est[n] + e * k
                glob[n] = g * glob[n] + h * k
        self._global_n = gn

    def forget(self, seq_id: int) -> None:
        self._version += 1
        self._seq.pop(seq_id, None)


def acceptance_prior(heldout_top1, depths: dict[int, int]) -> dict[int, float] | None:
    """Expected accepted draft tokens per tree size from the draft's training record: the held-out
    top-1 accuracy a_i of its i-th step ahead (EAGLE: one value, every step alike; Medusa: one per
    head), as a chain, sum_{i <= depth} prod_{j <= i} a_j for a tree of that depth -- the tokens a
    path accepts when each step's top guess is right with probability a_i. A tree's other
    branches only add to it, a held-out set of another family only takes from it: a starting
    point that the observations replace (None without a record)."""
    acc = [float(a) for a in (heldout_top1 or []) if a is not None]
    if not acc or not all(0.0 <= a <= 1.0 for a in acc):
        return None
    out = {}
    for n, depth in depths.items():
        total, run = 0.0, 1.0
        for i in range(depth):
            run *= acc[min(i, len(acc) - 1)]
            total += run
        out[n] = min(total, float(n - 1))
    return out
