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
costs at most ``explore_budget`` of the plain steps' time. That budget is for estimates near the
bar; it shrinks as they fall further below it (``explore_gap``): where plain decoding is 1.5x
the best tree's expected rate, an exploration can only find what a 50% error in the estimates
would hide, and on the H100 the explorations of sampled batches (0.7x the bar) cost 1.5% of a
run whose speculation stayed off.

The start-up profile times the steps' GPU paths on an idle engine; a serving step also pays its
host side (building inputs, the per-sequence bookkeeping of acceptance, a catch-up outside the
graph), which grows with the batch and differs between plain and speculative steps. So the
engine reports each pure step's measured wall time (``observe_cost``: every eligible decode
plain, or every one speculating with the same tree), and cost(n, B) is the profile's time times
a running ratio measured / profiled, per tree size and power-of-two batch bucket (the profile
counts as one observation; each ratio is clamped to [1/4, 20] against a stray stall; a tree size
not yet measured at a bucket takes the plain step's ratio there). A tree
that looked cheap at start-up but is slow in service stops being chosen. The engine times the
whole step (scheduling, the runner, the output bookkeeping), so the host's share, which grows
with the batch and the tokens a step emits, is in the ratio too. Steps where a row samples keep
ratios of their own (``choose(sampled=True)``): the profile times greedy steps, and on the H100 a
sampled speculative step of 2 nodes at batch 64 took 2.07 ms (catch-ups aside) against its greedy
profile's 1.50 (a plain step: 1.33), yet under one shared ratio, learned mostly from greedy steps, the policy
chose it in 88 of 759 steps of a temperature-1 run, 7% slower than no draft (docs/BENCHMARKS.md,
twenty-eighth session).

Switching speculation on has a cost of its own: EAGLE's draft must first run over every row the
plain steps computed without it (``catch_up``: c0 + c1 * rows milliseconds, profiled at start-up
and corrected by a measured ratio like the steps'). A step whose sequences are behind by R rows
carries catch_up(R) spread over the speculative steps a switch is expected to last (the running
mean length of the stretches of speculative steps so far, 4 before any): the H200 measured
catch-ups of 6000-7500 rows at 7-12 ms each at batch 64 (docs/BENCHMARKS.md, sixteenth session),
5-8 plain steps' worth, that the policy did not see.

A step can speculate for some decodes only: the others (near max_model_len, inside min_tokens,
with penalties) then run first, in a plain step of their own (a split step), where without
speculation every decode shares one step. So a choice's rate counts every decode's tokens over the
speculative step plus that plain part (``choose(rest=...)``); charged nothing, it made a continuous
load at batch 64 on the H100 0.88x of plain decoding (most of its steps split by a few sequences
near max_model_len, each paying a whole plain step more).

A batch that drains is judged by its slowest sequence. Where its requests have fixed lengths (EOS
ignored, no stop) and none waits for a place (``choose(left=...)``, each sequence's tokens left, from
the scheduler through ``SpecDecoder.plan``), the batch is done when its longest is: plain decoding
takes L steps (L the most tokens left), speculation as many as the sequence that falls furthest
behind, and a place freed early stays empty until then. A step's mean rate overstates such a
batch's gain: on the H100 a Medusa draft gained ~12% a step in greedy waves at batch 32 and lost 7%
over the run, its speculative steps advancing the wave 1.30 tokens each against a mean of 1.57. So a
tree is judged there by the drain's expected length (``drain_taus``): sequence i needs T_i =
left_i / (1 + a) speculative steps, give or take the noise of its steps' accepted tokens and a true
rate of its own above or below the mean, and the drain lasts max_i T_i plus the expected largest of
those deviations over the sequences that could be last. a and the steps' variance are the class's,
engine-wide (each sequence's own moving average is too noisy to take the slowest of); how much
sequences' true rates differ is learnt from the lifetime means of those that finished
(``_learn_spread``). Its tokens a step are L over that, for every decode of the batch. With a waiting
request a freed place is refilled at once, and the step's mean rate is the server's.

Greedy and sampled sequences keep separate engine-wide estimates (``track``): rejection sampling
accepts about half the tokens greedy acceptance does, and on the H100 a sampled request that
started from the greedy requests' record speculated its first steps (and paid the draft's
catch-up of its prompt) at a loss, 2-3% of a temperature-1 run.

Host arithmetic only, no torch: the per-sequence estimates are rows of one numpy array (a
sequence's slot), so a step's observations and its choice's sums are a few array operations, not
a dictionary update per sequence and size (a choice and its step's observations: 67 -> 26 µs at
batch 64 on the CPU runner, 6 -> 9 µs at batch 1).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import KeysView
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np


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
    # sampled steps' own start-up profile (None: they start from the greedy one, their ratios apart)
    cost_sampled: CostTable | None = None
    prior: dict[int, float] | None = None
    max_accept: dict[int, int] | None = None  # the most draft tokens each size can give (None: n - 1)
    decay: float = 0.8  # weight of the past in each sequence's average
    margin: float = 1.05  # speculation must be this much faster than a plain step
    # ... and a step of several sequences where a row samples this much: rejection sampling's accepted
    # lengths vary more between sequences, and a batch that ends together waits for its slowest one
    # (a lone sequence waits for none: batch 1 keeps margin). On the H100 the
    # temperature-1 waves at batch 8 speculated 248 of 700 steps on estimates of a 5% gain, steps
    # that gained ~1% each, and the run lost 12%: the wave's length is its slowest sequence's
    margin_sampled: float = 1.15
    drain_every: int = 4  # a draining batch's expected length: computed again after this many choices
    spread_min: int = 8  # verifies a sequence needs for its mean to teach the spread between sequences
    spread_recent: int = 64  # finished sequences after which a draining batch's running ones no longer count
    # whether a drain counts the spread between sequences' true rates (learnt all the same, and reported
    # by snapshot()). Off: on the H100 (thirty-sixth session) EAGLE-3's greedy waves with it fell from
    # 1.04x / 0.99x (012f98f, without) to 0.97x / 0.93x at batch 32 / 64, speculating mostly with
    # 2-node trees. The spread it had learnt, 0.33-0.58 tokens^2 at 20-41 nodes, reads high: a size
    # is scored only by steps of that size or larger, so a sequence's lifetime mean and the class's
    # recent one come from different steps. In CPU simulations of sequences that differ it held
    # 0.98-0.99x of plain where speculating every step ran 0.78-0.84x.
    drain_spread: bool = False
    explore_every: int = 16
    explore_budget: float = 0.01
    # the budget is for estimates at the bar; below it, the budget times explore_gap / (gap - 1),
    # gap being how many times faster than the best tree's expected rate plain decoding is (with the
    # margin): at 1.5x the bar a step's estimates would have to be 50% low to flip the choice, and
    # explorations that kept confirming a sampled batch's 0.7x cost an H100 run 1.5% (None: the
    # whole budget at any gap)
    explore_gap: float | None = 0.1
    relax: float = 0.9  # a plain step keeps this share of each sequence's distance from the engine-wide estimate
    cost_decay: float = 0.9  # weight of the past in each measured / profiled ratio
    # sampled sequences' engine-wide estimate starts at this share of the prior (greedy acceptance):
    # on the H100, SmolLM2's EAGLE-3 draft accepted 0.43-0.55x as many tokens at temperature 1 as
    # at 0 (docs/BENCHMARKS.md, twenty-fifth session)
    sampled_prior: float = 0.5
    # measured / profiled step time by (tree size, batch bucket, cost class: 1 when a row samples)
    _ratio: dict[tuple[int, int, int], float] = field(default_factory=dict)
    _ratio_n: dict[tuple[int, int, int], int] = field(default_factory=dict)
    _cost_cls: int = 0  # the cost class of the last choose()'s step (observe_cost's)
    _idle: int = 0
    _plain_run: int = 0  # plain steps since the last speculative one (the estimates' relaxation)
    last_choice: int = 1
    last_explored: bool = False  # whether the last choice was an exploration (the stats count them)
    # choose()'s last plain choice: the plain steps after it until one could explore (inf: no tree
    # could win at that batch however good its acceptance)
    explore_due: float = math.inf
    # the draft's catch-up over rows of plain steps: (c0 ms, c1 ms a row) from the start-up profile
    # (None: free, Medusa's), times a measured ratio; the mean length of speculative stretches
    catch_up: tuple[float, float] | None = None
    run_len: float = 4.0
    _cu_ratio: float = 1.0
    _cu_n: int = 0
    _run: int = 0
    # the summed estimates of the last choose()'s sequences, kept while neither the set nor any
    # estimate changed (a plain stretch observes nothing: each of its steps costs a tuple compare),
    # with their classes' engine-wide ones once _relaxed() needed them
    _version: int = 0
    _sums: tuple | None = None
    _drain_cache: tuple | None = None  # (seq ids, choices since computed, drain_taus' rates)

    def __post_init__(self) -> None:
        self.sizes = sorted(set(self.sizes))
        if not self.sizes or self.sizes[0] < 2:
            raise ValueError(f"sizes={self.sizes!r}: allowed: tree sizes >= 2")
        for table in (self.cost, self.cost_sampled):
            missing = [] if table is None else [n for n in [1, *self.sizes] if n not in table.ms]
            if missing:
                raise ValueError(f"the cost table has no times for tree sizes {missing}")
        base = self.prior or {n: 1.0 * (n - 1) / (self.sizes[-1] - 1) if self.sizes[-1] > 1 else 0.0
                              for n in self.sizes}
        self._col = {n: j for j, n in enumerate(self.sizes)}
        g = np.array([float(base.get(n, 0.0)) for n in self.sizes])
        # the engine-wide estimates of greedy (0) and sampled (1) sequences, and their observation counts
        self._G = np.stack([g, g * self.sampled_prior])
        # ... and their second moments (the spread of a step's accepted tokens: choose(left=)'s
        # drains), starting as if the variance were the mean (Poisson-like)
        self._G2 = self._G * self._G + self._G
        self._gn = [0, 0]
        self._n_sampled = 0  # tracked sampled sequences
        self._slot: dict[int, int] = {}  # a sequence's row of _est (and of _cls: its class)
        # a sequence's row: its estimates per size (_est), and its accepted draft tokens summed per size
        # over its whole life (_sum) with the verifies that scored each size (_cnt), which at forget()
        # say how sequences differ: views of one array, so that a step's update is one gather and one
        # scatter of the rows (three arrays cost observe_many 16 -> 33 µs at batch 32 on the CPU)
        self._rows = np.zeros((64, 3 * len(self.sizes)))
        self._views()
        self._cls = np.zeros(64, dtype=np.int64)
        # per class and size, the variance between sequences' true means (their lifetime means'
        # spread less what their per-step noise explains), and how many sequences taught it
        self._H = np.zeros((2, len(self.sizes)))
        self._hn = [0, 0]
        self._free: list[int] = []
        self._wcache: dict[int, tuple[np.ndarray, float]] = {}
        self._menus: dict[tuple, tuple] = {}  # observe_many's column maps by the sizes it was given

    @property
    def _global(self) -> dict[int, float]:
        """The greedy sequences' engine-wide estimates by tree size (a copy)."""
        return dict(zip(self.sizes, self._G[0].tolist()))

    @_global.setter
    def _global(self, values: dict[int, float]) -> None:
        """Sets both classes' engine-wide estimates (tests and benchmarks that force a choice)."""
        self._G[:] = np.array([float(values[n]) for n in self.sizes])
        self._G2 = self._G * self._G + self._G
        self._version += 1

    @property
    def _global_n(self) -> int:
        """Observations so far (both classes)."""
        return self._gn[0] + self._gn[1]

    def track(self, seq_id: int, sampled: bool) -> None:
        """A sequence about to be chosen for: from now on it has estimates of its own, starting
        from its class's engine-wide ones (greedy or sampled: rejection sampling accepts fewer
        tokens, and greedy observations must not make a sampled request's first steps speculate,
        nor the other way round). A sequence never tracked counts as greedy."""
        if seq_id not in self._slot:
            self._new_slot(seq_id, 1 if sampled else 0, self._G[1 if sampled else 0])
            self._version += 1

    @property
    def _seq(self) -> dict[int, dict[int, float]]:
        """Each tracked sequence's estimates by tree size (a copy, for tests and reports)."""
        return {sid: dict(zip(self.sizes, self._est[j].tolist())) for sid, j in self._slot.items()}

    def tracked(self) -> KeysView[int]:
        """The sequences with estimates of their own (a view: forget() changes it)."""
        return self._slot.keys()

    def _views(self) -> None:
        s = len(self.sizes)
        self._est, self._sum, self._cnt = self._rows[:, :s], self._rows[:, s:2 * s], self._rows[:, 2 * s:]

    def _new_slot(self, sid: int, c: int, init: np.ndarray) -> int:
        """A row of _est for sequence sid, of class c, its estimates init."""
        if self._free:
            j = self._free.pop()
        else:
            j = len(self._slot)
            if j == len(self._rows):
                self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)])
                self._views()
                self._cls = np.concatenate([self._cls, np.zeros_like(self._cls)])
        self._slot[sid] = j
        row = self._rows[j]
        row[:] = 0.0
        row[:len(self.sizes)] = init
        self._cls[j] = c
        self._n_sampled += c
        return j

    @staticmethod
    def _bucket(batch: int) -> int:
        """The power of two >= batch."""
        return 1 << max(batch - 1, 0).bit_length()

    def step_cost(self, n: int, batch: int) -> float:
        """Expected milliseconds of a step of `batch` decodes with trees of n nodes (1: plain), in
        the last choose()'s cost class: the profile's time times the measured ratio of its (n, batch
        bucket, class) (``_ratio_of``: until a tree size is measured there, the plain step's; 1 until
        either is)."""
        return self._table(self._cost_cls).cost(n, batch) * self._ratio_of(n, self._bucket(batch), self._cost_cls)

    def _ratio_of(self, n: int, bucket: int, cls: int) -> float:
        """The measured / profiled ratio of (tree size n, batch bucket, cost class); a tree size not
        yet measured there takes the plain step's (what serving adds to the profile -- the host's
        scheduling and bookkeeping -- adds to every step alike), 1 where neither is. At 1, a tree
        looked cheaper against plain than it was wherever plain's ratio had been learnt first: on the
        H100 sampled plain steps at batch 64 ran 1.42x their profile, and the temperature-1 runs at
        batch 32-64 each paid 2-3 explorations (~1% of the run) that a tree at its bare profile
        invited, each teaching one size's ratio (docs/BENCHMARKS.md, thirty-seventh session)."""
        r = self._ratio.get((n, bucket, cls))
        return r if r is not None else self._ratio.get((1, bucket, cls), 1.0)

    def _table(self, cls: int) -> CostTable:
        """The start-up profile of a cost class (1: sampled steps, their own where measured)."""
        return self.cost_sampled if cls and self.cost_sampled is not None else self.cost

    def observe_cost(self, n: int, batch: int, ms: float) -> None:
        """A pure step's measured wall milliseconds: `batch` decodes, all plain (n = 1) or all
        verifying trees of n nodes; the step the last choose() decided (its cost class)."""
        if n not in self.cost.ms or batch < 1 or not ms > 0:
            return
        key = (n, self._bucket(batch), self._cost_cls)
        count = self._ratio_n.get(key, 0) + 1
        self._ratio_n[key] = count
        profiled = self._table(self._cost_cls).cost(n, batch)
        self._ratio[key] = self._updated_ratio(self._ratio_of(*key), count, ms / profiled)

    def catch_up_cost(self, rows: int) -> float:
        """Expected milliseconds of the draft's catch-up over `rows` rows (0 without a profile)."""
        if self.catch_up is None or rows <= 0:
            return 0.0
        c0, c1 = self.catch_up
        return (c0 + c1 * rows) * self._cu_ratio

    @property
    def catch_up_ratio(self) -> float:
        """The catch-ups' running measured / profiled ratio (1 until one is measured)."""
        return self._cu_ratio

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
        j = self._slot.get(seq_id)
        return self._global if j is None else dict(zip(self.sizes, self._est[j].tolist()))

    def choose(self, seq_ids: list[int], budget: int | None = None, behind: int = 0, sampled: bool = False,
               rest: int = 0, left=None) -> int:
        """The tree size for a step whose eligible decodes are seq_ids (1: no speculation);
        budget: the step's token budget (sizes whose B * n exceeds it are not considered);
        behind: the rows the draft must catch up on first (their cost spread over a stretch);
        sampled: whether any of them samples (the step's cost class: its times are measured apart);
        rest: the step's other decodes, which cannot speculate. Plain, all B + rest decode in one
        step; speculating, the rest run in a plain step of their own before the trees' (a split
        step): its time is charged to speculation. Uncharged, the policy speculated in 404 of 437
        steps of a continuous load at batch 64 on the H100, ~317 of them split by a few sequences
        near max_model_len, each paying a whole plain step more: 0.88x of plain decoding.
        left: where the batch drains (fixed lengths, no request waiting for a place: it is done when
        its longest is), each of seq_ids' tokens left; a tree of a batch of several is then judged by
        the drain's expected length (``drain_taus``), not by a step's mean rate."""
        self._cost_cls = cls = int(sampled)
        b = len(seq_ids)
        if b == 0:
            return self._chose(1)
        extra = self.catch_up_cost(behind) / max(self.run_len, 1.0)
        # step_cost(n, b) written out, the batch's bucket found once (a scan of a plain stretch: ~30%
        # of choose()'s time was these calls)
        cost, ratio = self._table(cls).cost, self._ratio
        bucket = self._bucket(b)
        everyone = b + rest  # the decodes a plain step runs
        plain_ms = cost(1, everyone) * ratio.get((1, self._bucket(everyone), cls), 1.0)
        plain_ratio = ratio.get((1, bucket, cls), 1.0)  # an unmeasured tree's (_ratio_of)
        plain = everyone / plain_ms
        # a split step's plain part: charged to every tree (its tokens are in `everyone`)
        split_ms = self.step_cost(1, rest) if rest else 0.0
        extra += split_ms
        margin = self.margin_sampled if cls and b > 1 else self.margin
        drain = None
        if left is not None and b > 1:
            # recomputed when the set changes and every drain_every steps (~30 µs at batch 32 on the
            # CPU): a drain's rates move slowly, a step's host time is the engine's
            key = tuple(seq_ids)
            got = self._drain_cache
            if got is not None and got[0] == key and got[1] < self.drain_every:
                self._drain_cache = (key, got[1] + 1, got[2])
                drain = got[2]
            else:
                drain = self._drain_inputs(seq_ids, left)
        best, best_rate = 1, plain * margin
        win = best_rate  # what a tree must beat even if every draft token were accepted
        max_accept = self.max_accept or {}
        last = None  # (size, step_cost) of the largest size that could win
        sums = None
        top = 0.0  # the best expected rate of a tree
        for n in self.sizes:
            if budget is not None and b * n > budget:
                continue
            r = ratio.get((n, bucket, cls))  # (_ratio_of written out: a plain stretch's scans call it per size)
            step_ms = cost(n, b) * (r if r is not None else plain_ratio)
            spec_ms = step_ms + extra
            if (everyone + b * max_accept.get(n, n - 1)) / spec_ms <= win:
                continue  # slower than plain even if every draft token were accepted
            last = (n, step_ms)
            if drain is not None:  # every decode at the drain's rate: L tokens over its expected steps
                if not isinstance(drain, np.ndarray):
                    drain = self.drain_taus(drain)
                    self._drain_cache = (key, 1, drain)
                rate = everyone * float(drain[self._col[n]]) / spec_ms
            else:
                if sums is None:
                    sums = self._relaxed(self._summed(seq_ids))
                rate = (everyone + sums[n]) / spec_ms
            top = max(top, rate)
            if rate > best_rate:
                best, best_rate = n, rate
        self.explore_due = math.inf
        if best == 1:
            self._idle += 1
            if last is not None:
                n, step_ms = last
                # an exploring step is one step, so it pays the whole catch-up, not a stretch's share
                # (charged a share, explorations after long plain stretches took ~3% of a batch-8
                # run on the H200 against the 1% budget)
                over = max((step_ms + split_ms + self.catch_up_cost(behind)) / plain_ms - 1.0, 0.0)
                need = max(self.explore_every, math.ceil(over / self._explore_share(best_rate / top)))
                if self._idle >= need:
                    self._idle = 0
                    return self._chose(n, explored=True)
                self.explore_due = need - self._idle
        else:
            self._idle = 0
        return self._chose(best)

    def _explore_share(self, gap: float) -> float:
        """The share of the plain steps' time exploring may cost when plain decoding's rate (with
        the margin) is gap times the best tree's expected one (>= 1: plain chosen)."""
        if self.explore_gap is None or gap - 1.0 <= self.explore_gap:
            return self.explore_budget
        return self.explore_budget * self.explore_gap / (gap - 1.0)

    def _drain_inputs(self, seq_ids: list[int], left) -> tuple:
        """``drain_taus``' inputs for a draining batch: the expected accepted draft tokens per size of
        each sequence's class (greedy or sampled; engine-wide, not the sequence's own estimate), its
        per-step variance and the variance between sequences' true rates (``_learn_spread``), [B or
        1, S] each, and the tokens left float [B].

        Not the sequences' own estimates: each is a moving average of a few verifies, and the slowest
        of 32 such noisy estimates reads far below any sequence's real rate. With them, the H100's
        EAGLE-3 waves went plain for much of each wave: 1.39x -> 1.14x at batch 8, 1.07x -> 0.95x at
        32 (docs/BENCHMARKS.md, thirty-fifth session). Sequences that really differ add to the class's
        variance, which the drain's spread then carries."""
        b = len(seq_ids)
        lefts = np.maximum(np.asarray(left, dtype=np.float64), 1.0)
        if lefts.shape != (b,):
            raise ValueError(f"left: one count of tokens left per sequence ({b}), got shape {lefts.shape}")
        # each sequence's row (-1: untracked, which counts as greedy) and class, one pass in C: per-element
        # numpy indexing in Python loops cost a sampled batch of 64 ~70 µs a drain on the CPU
        rows = c = None
        if self._n_sampled or self.drain_spread:
            rows = np.fromiter(map(self._slot.get, seq_ids, itertools.repeat(-1)), np.int64, b)
        if self._n_sampled:
            c = np.where(rows >= 0, self._cls[rows], 0)
        one = 0 if c is None or not c.any() else 1 if c.all() else None
        # one class (the usual case): its rows [1, S], broadcast over the batch
        g, g2 = (self._G[one:one + 1], self._G2[one:one + 1]) if one is not None else (self._G[c], self._G2[c])
        if not self.drain_spread:
            return g, np.maximum(g2 - g * g, 0.0), np.zeros_like(g), lefts
        known = rows >= 0
        if one is not None:
            h = np.maximum(self._spread_with_running(one, rows[known]), 0.0)[None]
        else:
            hs = [self._spread_with_running(k, rows[known & (c == k)]) for k in (0, 1)]
            h = np.maximum(np.stack(hs)[c], 0.0)
        # the class's variance of a step holds both the steps' noise and the spread between sequences
        return g, np.maximum(g2 - g * g - h, 0.0), h, lefts

    def _spread_with_running(self, c: int, rows: np.ndarray) -> np.ndarray:
        """Class c's between-sequence variance per size: what finished sequences taught (``_learn_spread``),
        pooled with what these running ones' lifetime means say so far, each sequence counted once,
        until ``spread_recent`` sequences have finished (from then on their record alone). Before any
        sequence has finished -- a server's first batch, an eval's first wave -- the
        running ones are all there is: on a CPU simulation of waves whose sequences differ, the
        first wave ran 0.82-0.89x of plain on the finished sequences' record alone (none yet), the
        later ones 0.99-1.0x."""
        h, seen = self._H[c], self._hn[c]
        if len(rows) < 2 or seen >= self.spread_recent:  # (a long-served engine: its record alone, ~10 µs less)
            return h
        n = self._cnt[rows]
        ok = n >= self.spread_min
        m = ok.sum(0)
        if not m.any():  # (none has verified enough: a dormant draft's batches; the terms' ~8 µs spared)
            return h
        terms, _ = self._spread_terms(c, rows, n)
        return (seen * h + np.where(ok, terms, 0.0).sum(0)) / np.maximum(seen + m, 1)

    def _spread_terms(self, c: int, rows, n: np.ndarray | None = None):
        """What sequences at these rows of class c say of the spread between sequences, per size:
        (lifetime mean - class mean)^2 less the noise of a mean of n steps (a step's variance, the
        learnt spread taken out, over n), and where it counts (n >= ``spread_min``). rows: one row
        (arrays [S]) or an index array ([R, S]); n: their verify counts, if already read."""
        if n is None:
            n = self._cnt[rows]
        g = self._G[c]
        var = np.maximum(self._G2[c] - g * g - np.maximum(self._H[c], 0.0), 0.0)
        per = np.maximum(n, 1.0)
        return (self._sum[rows] / per - g) ** 2 - var / per, n >= self.spread_min

    @staticmethod
    def drain_taus(drain: tuple) -> np.ndarray:
        """Tokens a step of a draining batch, for each size of the menu (float [S]): L (the most tokens
        left) over the expected speculative steps until its last sequence is done. Sequence i has
        left_i + o_i tokens to emit (o_i = (var_i + mu_i^2) / (2 mu_i) - 1/2: what its last step emits
        past its end, renewal theory's mean residual) at mu_i a step (1 + its expected accepted draft
        tokens): T_i steps, give or take s_i, from two sources: the steps' noise, sqrt(var_i T_i) /
        mu_i (var_i a step's variance), and a true rate slower or faster than mu_i by sqrt(het_i)
        over all its steps, T_i sqrt(het_i) / mu_i (the slow side longer: T_i sqrt(het_i) / (mu_i -
        z sqrt(het_i)) for the tail). The drain lasts max_i T_i plus z(B') s of that longest, B' the
        sequences whose T_i + s_i reach it (any of them may be last: z(B') is the expected largest
        of B' standard normals), and never more than L steps (each emits a token). Within 5% of
        simulated drains (tests: sequences alike or differing, lengths equal or spread); given the
        pooled figures of sequences whose means differ as if they were noise, it reads the drain up
        to 7% long, erring toward plain decoding. drain: (est, var, het, lefts), est, var and het [B,
        S], or [1, S] for every sequence alike (the policy's: its classes' engine-wide rows)."""
        est, var, het, lefts = drain
        mu = est + 1.0
        inv = 1.0 / mu
        # tokens to emit, the last step's overshoot included
        steps = (lefts[:, None] + 0.5 * (var * inv + mu) - 0.5) * inv
        noise = var * steps * inv * inv  # the noise's variance of T_i
        dev = np.sqrt(het) * steps  # a true rate one sd off moves the tokens done by this much
        sd = np.sqrt(noise + (dev * inv) ** 2)
        cols = _arange(steps.shape[1])
        k = steps.argmax(0)
        most = steps[k, cols]
        tied = np.count_nonzero(steps + sd >= most, axis=0)
        z = _max_normals(len(lefts))[tied]
        slow = (dev / np.maximum(mu - z * np.sqrt(het), 0.5))[k, cols]  # the slow tail of the rates
        longest = lefts.max()
        return longest / np.minimum(most + z * np.sqrt(noise[k, cols] + slow * slow), longest)

    def _chose(self, best: int, explored: bool = False) -> int:
        """Record a choice: the stretch of speculative steps it ends feeds run_len. An exploring
        step is not a stretch the estimates chose: counted as one, explorations (each a single
        step) would pull run_len toward 1, which charges a switch the whole catch-up, which keeps
        speculation off, which leaves only explorations."""
        self.last_explored = explored
        if best > 1 and not explored:
            self._run += 1
        elif self._run:
            self.run_len = self.decay * self.run_len + (1 - self.decay) * self._run
            self._run = 0
        if best == 1:
            self._plain_run += 1
        elif self._plain_run:  # the estimates this choice saw become the ones the verify updates
            keep = self.relax ** self._plain_run
            if self._slot:
                rows = list(self._slot.values())
                g = self._G[self._cls[rows]]
                self._est[rows] = g + (self._est[rows] - g) * keep
            self._version += 1
            self._plain_run = 0
        self.last_choice = best
        return best

    def _relaxed(self, sums: dict[int, float]) -> dict[int, float]:
        """The last _summed()'s sums after the plain steps since the last speculative one: each
        sequence's distance from its class's engine-wide estimate times relax per step (a sequence
        without estimates of its own has none)."""
        if not self._plain_run or self.relax >= 1.0:
            return sums
        keep = self.relax ** self._plain_run
        g = self._sums[4]  # summed over the same sequences as sums (_summed's), kept with them
        if g is None:
            g = self._global_summed(self._sums[3])
            self._sums = (*self._sums[:4], g)
        return {n: g[j] + (v - g[j]) * keep for j, (n, v) in enumerate(sums.items())}

    def idle(self) -> None:
        """A step the caller decided plainly without asking (nothing changed since a choice of 1):
        counts toward exploring as a choice of 1 would."""
        self._idle += 1
        if self._run or self.last_choice != 1:
            self._chose(1)
        else:  # (what _chose(1) does after a choice of 1, without the call)
            self._plain_run += 1

    def _summed(self, seq_ids: list[int]) -> dict[int, float]:
        """Per tree size, the expected accepted draft tokens summed over seq_ids."""
        key = tuple(seq_ids)
        if self._sums is not None and self._sums[0] == self._version and self._sums[1] == key:
            return self._sums[2]
        slot = self._slot
        rows = [slot.get(s, -1) for s in seq_ids]
        if len(rows) == 1 and rows[0] >= 0:  # (batch 1: a row, without numpy's fancy indexing)
            sums = dict(zip(self.sizes, self._est[rows[0]].tolist()))
        else:
            own = [j for j in rows if j >= 0]
            total = self._est[own].sum(0) if own else np.zeros(len(self.sizes))
            if len(own) < len(rows):  # the sequences without estimates of their own: the greedy engine-wide ones
                total = total + (len(rows) - len(own)) * self._G[0]
            sums = dict(zip(self.sizes, total.tolist()))
        self._sums = (self._version, key, sums, rows, None)  # (the last: _relaxed's engine-wide sums)
        return sums

    def _global_summed(self, rows: list[int]) -> list[float]:
        """The engine-wide estimates of the classes of the sequences at these rows of _est (-1: one
        without a row, greedy), summed per size."""
        own = [j for j in rows if j >= 0]
        total = self._G[self._cls[own]].sum(0) if own else np.zeros(len(self.sizes))
        return (total + (len(rows) - len(own)) * self._G[0]).tolist()

    def observe(self, seq_id: int, accepted: dict[int, int]) -> None:
        """One verify's accepted draft tokens for sequence seq_id, per tree size it scores."""
        self.observe_many([seq_id], list(accepted), [list(accepted.values())])

    def observe_many(self, seq_ids, sizes, rows) -> None:
        """``observe`` for a step's sequences at once, in order: rows[i][j] = the draft tokens
        seq_ids[i]'s verify accepted under a tree of sizes[j] nodes (sizes outside the menu are
        ignored; rows: nested lists or an array). Each sequence's estimate moves by decay, the
        engine-wide one by g = 1 - 1 / (observations + 1) (the prior counts as one) capped at 0.98,
        observation by observation; a sequence seen for the first time starts from the engine-wide
        estimate as it stands when its row is reached. Once g is at its cap, the engine-wide
        update of the whole step is one weighted sum: g^B G + (1 - g) sum_i g^(B-1-i) k_i."""
        self._version += 1
        b = len(seq_ids)
        if not b:
            return
        menu = self._menus.get(key := tuple(sizes))
        if menu is None:  # which of these sizes the menu has, and where: (k's columns, _est's, the latter as an index)
            keep = [(j, self._col[n]) for j, n in enumerate(sizes) if n in self._col]
            src, cols = [j for j, _ in keep], [c for _, c in keep]
            # _est's columns as a slice where they are a run (the usual case: a step of n nodes scores
            # the menu's sizes <= n, its first ones): a view, where a list indexes by copy (np.ix_ and
            # the fancy update cost ~10 us a step at batch 1)
            run = bool(cols) and cols == list(range(cols[0], cols[0] + len(cols)))
            menu = self._menus[key] = (None if src == list(range(len(sizes))) else src, cols,
                                       slice(cols[0], cols[0] + len(cols)) if run else cols)
        src, cols, cs = menu
        k = np.asarray(rows, dtype=np.float64)
        if k.ndim != 2 or k.shape != (b, len(sizes)):
            raise ValueError(f"rows: one row per sequence ({b}) of one count per size ({len(sizes)}), "
                             f"got shape {k.shape}")
        slot = self._slot
        idx = [slot.get(s, -1) for s in seq_ids]
        if self._n_sampled:  # each row's class (the untracked: greedy)
            cl = [int(self._cls[j]) if j >= 0 else 0 for j in idx]
        if not cols:
            for i in range(b):
                self._gn[cl[i] if self._n_sampled else 0] += 1
            return
        if src is not None:
            k = k[:, src]
        run = isinstance(cs, slice)  # a run of the menu's columns (all of them, or the first few)
        if not self._n_sampled:  # every sequence greedy: one class
            self._observe_class(0, range(b), seq_ids, idx, k, cs)
        else:
            for c in (0, 1):
                pos = [i for i in range(b) if cl[i] == c]
                if pos:
                    self._observe_class(c, pos, seq_ids, idx, k, cs)
        d, s = self.decay, len(self.sizes)
        if run:  # (the usual case: the columns a run -- batch 1: the row itself, a view; else one gather)
            r = self._rows[idx[0]][None] if b == 1 else self._rows[idx]
            lo, hi = cs.start, cs.stop
            e = r[:, lo:hi]
            e *= d
            e += (1.0 - d) * k
            r[:, s + lo:s + hi] += k
            r[:, 2 * s + lo:2 * s + hi] += 1.0
            if b > 1:
                self._rows[idx] = r
            return
        sub = np.ix_(idx, cols)
        self._est[sub] = d * self._est[sub] + (1.0 - d) * k
        self._sum[sub] += k
        self._cnt[sub] += 1.0

    def _observe_class(self, c: int, pos, seq_ids, idx: list[int], k: np.ndarray, cs) -> None:
        """The engine-wide estimate of class c after the observations k[pos] (in order), and the
        untracked sequences among them given rows (idx[i], from that estimate as it stands when
        their row is reached)."""
        G, G2, gn = self._G[c], self._G2[c], self._gn[c]
        b = len(pos)
        every = isinstance(pos, range)
        if not every:
            k = k[pos]
        self._gn[c] = gn + b
        if gn >= 49:  # g at its cap from here on: the engine-wide update in closed form
            w, gb = self._weights(b)
            if (-1 in idx) if every else any(idx[i] < 0 for i in pos):
                g0 = G.copy()
                for r, i in enumerate(pos):
                    if idx[i] < 0:  # first seen: the engine-wide estimate after the rows before it
                        init = g0.copy()
                        if r:
                            init[cs] = 0.98 ** r * g0[cs] + w[b - r:] @ k[:r]
                        idx[i] = self._new_slot(seq_ids[i], c, init)
            if isinstance(cs, slice):  # (a view: in place)
                g = G[cs]
                g *= gb
                g += w @ k
                g2 = G2[cs]
                g2 *= gb
                g2 += w @ (k * k)
            else:
                G[cs] = gb * G[cs] + w @ k
                G2[cs] = gb * G2[cs] + w @ (k * k)
        else:
            for r, i in enumerate(pos):  # a class's first 49 observations: one by one
                gn += 1
                g = min(0.98, 1.0 - 1.0 / (gn + 1))
                if idx[i] < 0:
                    idx[i] = self._new_slot(seq_ids[i], c, G)
                G[cs] = g * G[cs] + (1.0 - g) * k[r]
                G2[cs] = g * G2[cs] + (1.0 - g) * k[r] * k[r]

    def _weights(self, b: int) -> tuple[np.ndarray, float]:
        """The capped (g = 0.98) engine-wide update of b observations in order: each one's weight
        (1 - g) g^(b-1-i), and g^b, the old estimate's."""
        got = self._wcache.get(b)
        if got is None:
            got = self._wcache[b] = ((1.0 - 0.98) * 0.98 ** np.arange(b - 1, -1, -1, dtype=np.float64), 0.98 ** b)
        return got

    def forget(self, seq_id: int) -> None:
        self._version += 1
        j = self._slot.pop(seq_id, None)
        if j is not None:
            self._learn_spread(j)
            self._n_sampled -= int(self._cls[j])
            self._free.append(j)

    def _learn_spread(self, j: int) -> None:
        """A departing sequence's lifetime mean per size (where at least ``spread_min`` verifies
        scored it) into its class's between-sequence variance: (mean - class mean)^2 less the noise
        of a mean of n steps, var / n, so that what remains estimates how much sequences' true
        rates differ. Averaged over sequences as the class mean is over steps (the prior, 0, counts
        as one; the weight of the past capped at 0.98)."""
        c = int(self._cls[j])
        terms, ok = self._spread_terms(c, j)
        if not ok.any():
            return
        seen = self._hn[c] = self._hn[c] + 1
        w = min(0.98, 1.0 - 1.0 / (seen + 1))
        h = self._H[c]
        h[ok] = w * h[ok] + (1.0 - w) * terms[ok]

    def snapshot(self) -> dict:
        """What the policy has learnt so far, for a report: per class (greedy, sampled) the engine-wide
        expected accepted draft tokens per size, how many verifies taught them, their per-step
        variance and the spread between sequences; the measured / profiled step-cost ratios, keyed
        "size/batch bucket/class" (a tree size not listed takes its bucket's plain ratio, ``_ratio_of``;
        1 where that is not listed either); the catch-up's ratio."""
        classes = ("greedy", "sampled")
        return {"sizes": list(self.sizes),
                "accepted": {c: self._G[i].tolist() for i, c in enumerate(classes)},
                "verifies": {c: self._gn[i] for i, c in enumerate(classes)},
                "step_variance": {c: np.maximum(self._G2[i] - self._G[i] ** 2, 0.0).tolist()
                                  for i, c in enumerate(classes)},
                "spread_between": {c: self.spread_between(i).tolist() for i, c in enumerate(classes)},
                "cost_ratio": {f"{n}/{b}/{classes[c]}": r for (n, b, c), r in sorted(self._ratio.items())},
                "catch_up_ratio": self.catch_up_ratio}

    def spread_between(self, cls: int = 0) -> np.ndarray:
        """The variance between sequences' true rates per size (class cls), as learnt so far (>= 0)."""
        return np.maximum(self._H[cls], 0.0)


@functools.lru_cache(maxsize=1024)
def expected_max_normal(n: int) -> float:
    """The expected largest of n independent standard normals, by Blom's approximation
    inv_cdf((n - 0.375) / (n + 0.25)): 0 for n = 1, within 4% of the exact value at n = 2 and
    1% from n = 8 on (2.067 for 32 against 2.070)."""
    return 0.0 if n <= 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


@functools.lru_cache(maxsize=64)
def _arange(n: int) -> np.ndarray:
    return np.arange(n)


def _max_normals(n: int) -> np.ndarray:
    """expected_max_normal(m) for m = 0 .. n at least, one array (one per power of two: cached)."""
    return _max_normals_upto(1 << max(n, 64).bit_length())


@functools.lru_cache(maxsize=32)
def _max_normals_upto(n: int) -> np.ndarray:
    return np.array([expected_max_normal(m) for m in range(n + 1)])


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
