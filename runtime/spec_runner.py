"""Speculative decoding inside the model runner: draft a token tree per sequence, verify every
tree in one target forward under the tree mask over the paged KV, accept, and move the
accepted path's KV into place.

The engine's step splits its decodes in two: sequences that can speculate (``eligible``) go
through ``SpecDecoder.step``; the rest (prefill chunks, requests with penalties or a seed,
those still inside min_tokens or too near max_model_len) run the ordinary step. Where those rows
run eager anyway (prefill chunks; plain decodes without a graph), the runner fuses the two
(``ModelRunner._execute_fused``): ``propose`` drafts the trees (a propose graph on CUDA), one target
forward carries the plain rows and the trees' nodes, then ``accept`` and ``emit`` finish the
speculative half.

The draft's inputs live in a feature cache paged like the KV (``FeatureStore``: one row per
cache slot): every target forward -- ordinary steps eager or under the decode graphs, and the
accepted rows of a speculative step -- stores the draft's input for each position it computed
(Medusa: the target's last hidden state; EAGLE: the same; EAGLE-3: its fused low / middle /
high states). An ordinary step runs nothing of the draft, so with speculation off (the adaptive
policy's choice on a busy engine) a step costs what it costs without a draft. The draft catches
up when a sequence speculates.

Per sequence with c = num_computed_tokens and root x_c (its last, sampled token):
- the draft state: Medusa, the feature at c - 1 (the row that sampled x_c); EAGLE, the draft's
  predicted feature at c: its output on (f_{c-1}, x_c), after the draft has run over every
  row p < c, p >= u (u: the rows it ran over before, ``seq.spec_state``), each on (f_p,
  x_{p+1}), its own KV for those positions in its cache layer (one prefill-like forward).
- propose: Medusa, the heads' top-k over the static tree's choices; EAGLE-2, a dynamic tree
  grown ``depth - 1`` times from the top_k best frontier nodes (tree.py), each expansion one
  draft forward over the frontier nodes so far under their ancestor mask, their K/V in the
  draft's scratch slots c + row.
- verify: the target over the N tree nodes at positions c + depth, K/V to slots c + i,
  logits at every node; acceptance greedy (every row greedy) or by rejection sampling over the
  tree (lossless, acceptance.py); the accepted path's KV moved to c .. c + k (kv_compact.py) and
  its features stored at those slots.
- the sequence gains k accepted draft tokens and one token of the target's: k + 1 tokens of
  KV computed (root + accepted nodes).
Greedy steps, and sampling steps whose rows ask for a temperature and nothing else, run under CUDA
graphs (``SpecStepGraphs``: catch-up of the last G rows, proposal, verify, acceptance, KV move --
one replay and one host sync a step); other sampling steps run eager, their verify forward under
``VerifyGraphs``.
Blocks: the scheduler allocates ``lookahead`` slots past the root for an eligible decode;
what rejected nodes wrote past the new length is never read and is overwritten next step.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kernels.common import use_triton
from ..kernels.fc_scatter import fc_scatter, fc_scatter_ref
from ..kernels.spec_accept import greedy_accept_move_packed, pack_results
from ..kernels.spec_slots import step_slots
from ..kernels.topk import topk_logprobs
from ..kernels.tree_grow import MAX_NODES as TREE_MAX_NODES
from ..kernels.tree_grow import grow, new_pool, pool_size, select
from .cuda_graphs import (
    GraphFence,
    GraphSampling,
    HostStaging,
    ReplayFence,
    capture_graphs,
    captured_download_ok,
    download_into,
    graph_buckets,
    graph_fence_ok,
)
from .inference import inference
from .kv_cache import KVCache, KVCacheSpec
from .layers.attention import AttentionMetadata
from .sampler import token_logprobs
from .sampling_params import GREEDY_EPS, SamplingParams
from .spec.acceptance import (
    AcceptResult,
    accepted_per_size,
    greedy_accept,
    rejection_accept,
    target_probs,
)
from .spec.kv_compact import accepted_kv_slots, move_kv_slots
from .spec.tree import StaticTree, TreeBatch, const_arange, const_full
from .step_inputs import HostBatch, packed_to

# EAGLE-3's feature store as one fused launch where the draft runs Triton kernels (kernels/fc_scatter.py),
# opt-in (OPTLLM_FUSED_STORE=1): on the H100 it took 7.3 µs, no less than fc + index_put (dormant_cost.py)
FUSED_STORE = os.environ.get("OPTLLM_FUSED_STORE", "0") == "1"

# EAGLE: plain steps a speculative step's graphed catch-up window covers beyond its own last step's
# tokens (the draft reruns those rows every speculative step: B * 8 more rows of one layer)
CATCH_SLACK = 8

# Medusa's tree when none is given: ranks of the heads' top-k along each path, widest near the
# root (where acceptance is likeliest), cut to the heads the draft has.
DEFAULT_MEDUSA_CHOICES = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
)


@dataclass(frozen=True)
class SpecOptions:
    """EAGLE: top_k children per expanded node, depth (draft tokens along a path at most),
    num_draft (tree nodes besides the root). Medusa: choices (None: DEFAULT_MEDUSA_CHOICES cut
    to the draft's heads). policy: "fixed" (every eligible decode verifies the whole tree) or
    "adaptive" (spec/policy.py: a tree size per step, down to none, from the sequences'
    acceptance and a cost profile measured at start-up)."""

    top_k: int = 8
    depth: int = 5
    num_draft: int = 40
    medusa_choices: tuple | None = None
    policy: str = "fixed"


@dataclass
class SpecStats:
    """Counters over the engine's life: speculative steps and sequence-steps, draft tokens
    proposed and accepted, and how many sequence-steps accepted k draft tokens (index k)."""

    steps: int = 0
    seq_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)
    steps_by_size: dict[int, int] = field(default_factory=dict)  # speculative steps per tree size
    explored: int = 0  # of those, the adaptive policy's explorations (its estimates alone chose plain)
    # where the time went (wall milliseconds, each part ending in its host sync): the speculative
    # parts of steps, and the plain parts (prefill chunks, plain decodes) of the same engine
    spec_ms: float = 0.0
    plain_ms: float = 0.0
    plain_parts: int = 0
    # steps whose plain rows (prefill chunks, plain decodes) rode in the speculative rows' verify
    # forward (one target forward instead of two), and their whole time
    fused_steps: int = 0
    fused_ms: float = 0.0
    # steps whose plain rows ran a forward of their own before the speculative part (split: unfused)
    split_steps: int = 0
    caught_up_steps: int = 0  # speculative steps that first ran the draft over earlier plain steps' rows
    catch_up_rows: int = 0  # the rows those catch-ups ran over (outside a graphed step's own window)
    catch_up_ms: float = 0.0  # their time (synchronised)

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per sequence-step (accepted draft tokens + the target's own)."""
        return (self.accepted + self.seq_steps) / self.seq_steps if self.seq_steps else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "seq_steps": self.seq_steps, "drafted": self.drafted, "accepted": self.accepted,
                "mean_accepted_length": self.mean_accepted_length, "histogram": list(self.histogram),
                "steps_by_size": dict(self.steps_by_size), "explored": self.explored, "spec_ms": self.spec_ms,
                "plain_ms": self.plain_ms,
                "plain_parts": self.plain_parts, "fused_steps": self.fused_steps, "fused_ms": self.fused_ms,
                "split_steps": self.split_steps,
                "caught_up_steps": self.caught_up_steps,
                "catch_up_rows": self.catch_up_rows, "catch_up_ms": self.catch_up_ms}


_GREEDY = SamplingParams(temperature=0)


@dataclass
class Proposal:
    """A speculative step's first half (``SpecDecoder.propose``) for seqs: their trees (N nodes
    each) and each node's rank int64 [B, N], context lengths ctx int64 [B], block tables int32
    [B, W], the nodes' cache slots int64 [B * N] (where the verify forward writes their K/V) and
    the verify's sequence lengths ctx + N int32 [B]."""

    seqs: list
    tree: TreeBatch
    ranks: torch.Tensor
    ctx: torch.Tensor
    tables: torch.Tensor
    slots: torch.Tensor
    lens: torch.Tensor


class FeatureStore:
    """The draft's per-position inputs, paged like the KV cache: features[slot] for every cache
    slot, plus one dump row (index num_slots, the last: slot -1 indexes it) where rows with slot -1
    (padding) go. ``store`` is what every target forward calls on the rows it computed (the decode
    graphs call it inside their capture). Holds no reference to the runner (the graphs keep it)."""

    def __init__(self, draft, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.draft = draft
        self.fused = draft.method in ("eagle", "eagle3")  # EAGLE's context_features (EAGLE-3: fc over 3 states)
        self.features = torch.zeros(num_slots + 1, draft.hidden_size, dtype=dtype, device=device)
        # EAGLE-3 where the draft's kernels are Triton and FUSED_STORE: fc and the scatter in one launch
        # (kernels/fc_scatter.py; the two kernels were a dormant draft's 1% of a decode step on the H100)
        fc = getattr(draft, "fc", None) if draft.method == "eagle3" else None
        self.fc_weight = None
        if fc is not None and fc.bias is None and fc.weight.dtype == dtype and FUSED_STORE \
                and use_triton(getattr(draft, "backend", "auto"), self.features):
            self.fc_weight = fc.weight if fc.weight.is_contiguous() else fc.weight.contiguous()
            if device.type == "cuda" and not self._fused_store_ok():
                self.fc_weight = None

    def _fused_store_ok(self) -> bool:
        """The fused kernel against fc + index_put on random rows, once (a compile or numerics failure on
        this GPU falls back to the two kernels, with a warning)."""
        w = self.fc_weight
        g = torch.Generator(device=w.device).manual_seed(0)
        x = torch.randn(5, w.shape[1], generator=g, device=w.device).to(w.dtype)
        slots = torch.tensor([3, -1, 0, 7, 1], dtype=torch.int64, device=w.device)
        try:
            got = fc_scatter(x, w, slots, torch.zeros(9, w.shape[0], dtype=w.dtype, device=w.device))
        except Exception as e:  # noqa: BLE001 (any failure of the kernel: the unfused path stays)
            warnings.warn(f"the fused feature store failed on this device ({type(e).__name__}: {e}); using fc + "
                          "index_put", stacklevel=2)
            return False
        want = fc_scatter_ref(x.float(), w.float(), slots, torch.zeros_like(got))
        ok = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        if not ok:
            warnings.warn("the fused feature store disagreed with fc + index_put on this device; using those",
                          stacklevel=2)
        return ok

    def store(self, hidden: torch.Tensor, aux: torch.Tensor | None, slots: torch.Tensor) -> None:
        """hidden [T, H] (and EAGLE-3's aux [T, 3H]) of rows whose cache slots are slots [T] (-1: none)."""
        if self.fc_weight is not None and aux is not None and aux.dtype == self.fc_weight.dtype:
            fc_scatter(aux, self.fc_weight, slots if slots.is_contiguous() else slots.contiguous(), self.features)
            return
        feats = self.draft.context_features(hidden, aux) if self.fused else hidden
        # slot -1 indexes the last row, the dump row (num_slots): one kernel, where an int64 copy of
        # the slots, a remainder and index_copy_ were three (each a node of every decode graph)
        self.features[slots] = feats.to(self.features.dtype)

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        return self.features[slots]


def fixed_length(params) -> bool:
    """Whether a request's output length is known from its parameters: max_tokens, with EOS ignored
    and no stop string or stop token (or min_tokens reaching max_tokens)."""
    if params.max_tokens is None:
        return False
    return params.min_tokens >= params.max_tokens or (
        params.ignore_eos and not params.stop and not params.stop_token_ids)


def drain_left(seqs) -> list[int] | None:
    """Each sequence's tokens left where every one's length is fixed (``fixed_length``: each distinct
    parameters object checked once, a batch of one generate() call shares one), else None: what the
    adaptive policy judges a draining batch by (it is done when its longest is). plan()'s ``_scan``
    has this written out in its pass: change both (test_scan_drain_left_as_drain_left checks that
    they agree)."""
    last, left = None, []
    for s in seqs:
        p = s.params
        if p is not last:
            if not fixed_length(p):
                return None
            last = p
        left.append(p.max_tokens - (len(s.token_ids) - s.num_prompt_tokens))
    return left


def catch_up_rows(rows: int) -> int:
    """The rows an eager catch-up over `rows` rows runs (padded): multiples of 16 up to 128, then
    eight steps an octave (at most 1/8 more rows), so that a served engine's catch-ups reuse a
    few dozen GEMM shapes instead of making a new one each."""
    if rows <= 128:
        return -(-rows // 16) * 16
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def warm_shape(rows: int, max_len: int) -> tuple[int, int]:
    """The (sequences, rows each) a start-up warm-up of the draft over `rows` rows runs: one
    sequence while it fits max_len (the rotary table's and the draft KV's bound: positions must stay
    below it), else `rows` split into equal sequences of the largest power of two <= max_len that
    divides it, so the GEMMs still see exactly `rows` rows (catch_up_rows' sizes are multiples of 16)."""
    if rows <= max_len:
        return 1, rows
    g = 1 << (max_len.bit_length() - 1)
    while rows % g:
        g //= 2
    return rows // g, g


@functools.lru_cache(maxsize=256)
def _level_offsets(bsz: int, k: int, levels: int, device: torch.device):
    """EAGLE-2 expansion levels d = 1 .. levels over bsz sequences, each running its k frontier
    rows over the m = d k scratch rows written so far: the mask offsets b * k * m of each level's
    [k, m] blocks (int64 [levels, bsz]) and the query offsets b * k (int32 [bsz + 1]); made once
    per shape (constants of the step: no kernels inside its graph)."""
    m = torch.arange(1, levels + 1, device=device)[:, None] * k
    return (torch.arange(bsz, device=device)[None, :] * k * m,
            torch.arange(bsz + 1, device=device, dtype=torch.int32) * k)


class SpecDecoder:
    """The speculative half of a ModelRunner: ``runner`` gives the target model, its KV cache,
    block size, block tables, device and max_model_len. ``bind(num_slots)`` (once the cache is
    sized) allocates the feature cache."""

    def __init__(self, runner, draft, options: SpecOptions, seed: int = 0) -> None:
        # the runner owns this decoder (runner.spec): a proxy, not a reference back, so that an engine
        # is freed by reference counting when its last user lets go, with its KV caches, instead of
        # waiting for the cyclic collector, which counts objects, not the gigabytes they hold
        self.runner = weakref.proxy(runner)
        self.draft, self.options = draft, options
        self.model = runner.model
        self.device = runner.device
        self.block_size = runner.block_size
        self.eagle = draft.method in ("eagle", "eagle3")  # a draft layer with its own KV; EAGLE-2 trees
        self.stats = SpecStats()
        self.seed = seed
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.store: FeatureStore | None = None
        self.graphs = None  # SpecStepGraphs (runner on CUDA)
        if options.policy not in ("fixed", "adaptive"):
            raise ValueError(f"policy={options.policy!r} is not allowed; allowed: fixed, adaptive")
        if self.eagle:
            o = options
            for name, v in (("top_k", o.top_k), ("depth", o.depth), ("num_draft", o.num_draft)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"{name}={v!r} is not allowed; allowed: an integer >= 1")
            if not o.num_draft < min(pool_size(o.top_k, o.depth), TREE_MAX_NODES):
                raise ValueError(f"num_draft={o.num_draft} is not allowed; allowed: at most "
                                 f"{min(pool_size(o.top_k, o.depth), TREE_MAX_NODES) - 1} (the candidates top_k="
                                 f"{o.top_k} and depth={o.depth} produce, and {TREE_MAX_NODES - 1} at most)")
            self.num_nodes = o.num_draft + 1
            self.scratch = (o.depth - 1) * o.top_k
            # a graphed step's catch-up window: rows c - G .. c - 1. A step emits <= depth + 1 tokens;
            # CATCH_SLACK rows more cover that many plain steps since the last speculative one, so a
            # short plain stretch needs no eager catch-up (about 2 ms on the H200 even for a few rows,
            # which the policy charges to switching back on: short stretches made it stay off)
            self.catch_rows = o.depth + 1 + CATCH_SLACK
        else:
            choices = options.medusa_choices or tuple(c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= draft.num_heads)
            full = StaticTree.from_choices(choices)
            if full.num_heads > draft.num_heads:
                raise ValueError(f"medusa_choices reach depth {full.num_heads}; the draft has "
                                 f"{draft.num_heads} heads")
            self.num_nodes = full.tree.size
            # its first n nodes are a tree too (parents precede children): the smaller sizes
            self.trees = {n: StaticTree.from_choices(full.choices[1:n]) for n in range(2, self.num_nodes + 1)}
            self.scratch = 0
            self.catch_rows = 1
        # the tree sizes a step may verify: the whole tree and, adaptively, about halves of it
        self.sizes = sorted({self.num_nodes} | ({max(2, self.num_nodes >> i) for i in range(1, 5)}
                                                if options.policy == "adaptive" else set()))
        self.n = self.num_nodes  # this step's tree size (plan() sets it)
        # eligible(): the longest sequence whose largest tree (or EAGLE's scratch rows) still fits
        self._longest = runner.max_model_len - max(self.num_nodes, self.scratch) + 1
        self._planned: set[int] | None = None  # the seq ids plan()'s last scan found eligible
        # (the sequences plan() scanned, their rows_behind): a step of exactly those reuses the count
        self._plan_behind: tuple[list, int] | None = None
        self.last_step_caught_up = False  # step() ran the draft over earlier plain steps' rows first
        self.policy = None
        self.adaptive = options.policy == "adaptive"
        self.pending_cost: tuple[int, int] | None = None  # this step's (tree size, batch) when pure
        # plan(): steps a choice of no speculation stands unscanned, doubled after each scan that
        # confirms it for the same running set, up to recheck_most (by ~30 plain steps each
        # sequence's estimates have relaxed to its class's, which no plain step moves: what is left
        # to change the choice is the running set and the exploration's turn, which bounds the skip)
        self.recheck_every, self.recheck_most = 8, 64
        self._recheck = self.recheck_every
        self._plan_sig: tuple | None = None
        self._plan_rest = 0  # the last scan's decodes that could not speculate
        self._plan_skips = 0
        self.scanned = True  # whether the last plan() scanned the running sequences (else: a skipped step)
        self._sizes_t: tuple[tuple, torch.Tensor] | None = None  # (sizes, int64 [S] on the device)
        self._pad_tables: dict[int, torch.Tensor] = {}  # a catch-up's padding rows' block table, by width

    def bind(self, num_blocks: int) -> None:
        """The feature cache over num_blocks blocks (the KV cache's, its padding block included);
        EAGLE's own KV cache layer over the same blocks."""
        spec = self.runner.kv_spec
        self.store = FeatureStore(self.draft, num_blocks * self.block_size, self.runner.dtype, self.device)
        # a sampled step graph's per-node draws: a noise counter a verified row, Philox keyed apart
        # from the decode and extend graphs'
        self.sampling = GraphSampling(self.runner.config.max_num_seqs * self.num_nodes,
                                      (self.seed * 0xD1B54A32D192ED03 + 7) & 0x7FFFFFFFFFFFFFFF, self.runner.backend,
                                      self.device)
        if self.eagle:
            self.draft_kv = KVCache(KVCacheSpec(1, self.draft.num_kv_heads, self.draft.head_dim, spec.block_size,
                                                spec.dtype), num_blocks, self.device)
            self.draft_kv.bind(self.draft.attention_layers())

    def start(self) -> None:
        """Once the runner is complete (its graphs captured): the adaptive policy, with the cost
        profile measured on the paths the steps will take."""
        self._warm_catch_up()
        if self.adaptive and self.policy is None:
            from .spec.policy import AdaptivePolicy, acceptance_prior

            depths = {n: self.max_accept(n) for n in self.sizes}
            # sampled steps' own profile where their graphs run (CUDA): else their ratios learn it
            sampled = self.measure(sampled=True) if self.graphs is not None and self.device.type == "cuda" else None
            self.policy = AdaptivePolicy(self.sizes, self.measure(), cost_sampled=sampled, max_accept=depths,
                                         prior=acceptance_prior(getattr(self.draft, "heldout_top1", None), depths),
                                         catch_up=self.measure_catch_up())

    @torch.inference_mode()
    def _warm_catch_up(self) -> None:
        """EAGLE: run the draft over 1, 2, 4, ... 64 rows once, so that the attention tile
        variants an eager catch-up picks by its longest run are compiled at start-up, not in the
        middle of a served step (the H200 measured a batch of 8 at 0.38x of plain decoding where
        three speculative steps each compiled one); on CUDA also over each padded catch-up size
        (``catch_up_rows``) up to 4096, whose GEMMs' first calls cost ~2 ms each on the H100.
        Rows past max_model_len are split into sequences (``warm_shape``: a position past it reads
        beyond the rotary table, an illegal address on the H100), all over the same blocks from 0,
        before any request (what they write there is never read)."""
        if not self.eagle:
            return
        dev, bs = self.device, self.block_size
        warm = [1, 2, 4, 8, 16, 32, 64]
        if dev.type == "cuda":  # and the draft's GEMMs at every padded catch-up size up to 4096 rows
            warm += sorted({catch_up_rows(r) for r in range(65, 4097)})
        for rows in warm:
            seqs, g = warm_shape(rows, self.runner.max_model_len)
            blocks = -(-g // bs)
            if blocks > self.runner.num_blocks:
                break
            tables = torch.arange(blocks, dtype=torch.int32, device=dev)[None, :].expand(seqs, blocks)
            self._states_fixed(torch.zeros(seqs, g, dtype=torch.int64, device=dev),
                               torch.full((seqs,), g, dtype=torch.int64, device=dev), tables.contiguous())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def tree_depth(self, n: int) -> int:
        """EAGLE: the depth a tree of n nodes is grown to (the option, at most n - 1)."""
        return max(1, min(self.options.depth, n - 1))

    def tree_width(self, n: int) -> int:
        """EAGLE: the frontier nodes a level of an n-node tree expands, and the children each gets
        (top_k, at most n - 1). The same tree as top_k's, fewer draft rows: the tree keeps the n - 1
        best candidates, and a node ranked behind n - 1 others of its own level (or behind n - 1
        siblings) is behind n - 1 candidates of the pool, as all its descendants are (a child never
        outscores its parent; ties go to the earlier). So neither it nor anything grown from it is
        kept, and the kept nodes' ranks count the same candidates ahead of them."""
        return max(1, min(self.options.top_k, n - 1))

    def max_accept(self, n: int) -> int:
        """The most draft tokens a tree of n nodes can give: its depth."""
        return self.tree_depth(n) if self.eagle else self.trees[n].num_heads

    @property
    def lookahead(self) -> int:
        """Slots past the root this step's speculative decodes write (tree nodes; EAGLE's scratch rows)."""
        return max(self.n, self.scratch) - 1

    def plan(self, running, draining: bool = False) -> int:
        """Called by the scheduler before it schedules a step: picks this step's tree size from
        the running sequences that would speculate; returns the lookahead (0: no speculation).
        draining: no request waits for a place, so a sequence that finishes early leaves its place
        empty; where the speculating decodes' lengths are fixed (``drain_left``), the batch is done
        when its longest is, and the policy judges a tree by the drain's expected length.
        While the policy keeps speculation off and the running set looks the same (its size and
        its ends) or has only lost sequences (fewer, the same ends), the choice stands for
        ``recheck_every`` steps without a scan of every sequence
        (a scan cost about 1 µs a sequence on the H200's host, every step), then for twice as many
        after each scan that confirms it, up to ``recheck_most``, and never past the policy's turn
        to explore."""
        self.pending_cost = None
        self._planned = self._plan_behind = None
        if self.policy is None:
            self.n = self.num_nodes
            return self.lookahead
        pol = self.policy
        sig = (len(running), id(running[0]), id(running[-1]), draining)
        last = self._plan_sig
        # the scanned set, or fewer with the same ends: only sequences that finished left it (admissions
        # join at the end), so no class of sequence is new to the choice -- unless the scan found decodes
        # that cannot speculate, whose leaving ends the split steps that may have kept speculation off.
        # (Rescanned on every change, a continuous load at batch 64 scanned in 46% of its steps, ~37 µs
        # each on this CPU.)
        if self.n == 1 and last is not None and self._plan_skips < self._recheck \
                and (sig == last or (not self._plan_rest and sig[0] < last[0] and sig[1:] == last[1:])):
            self._plan_skips += 1
            self.scanned = False
            pol.idle()
            return 0
        confirm = self.n == 1 and sig == last  # a scan after a skipped stretch of the same set
        self._plan_sig, self._plan_skips, self.scanned = sig, 0, True
        seqs, ids, behind, sampled, rest, left = self._scan(running, draining)
        self._plan_rest = rest
        self._planned = planned = set(ids)  # speculates() answers from it (the scheduler asks per sequence)
        self._plan_behind = (seqs, behind)
        tracked = pol.tracked()
        if len(tracked) > 2 * len(running) + 64:  # forget the sequences that left
            live = {s.seq_id for s in running}
            for sid in [k for k in tracked if k not in live]:
                pol.forget(sid)
        if not tracked >= planned:  # (most scans: every one tracked already, a subset test in C)
            for s in seqs:  # a new sequence starts from its class's estimates (greedy or sampled)
                if s.seq_id not in tracked:
                    pol.track(s.seq_id, s.params.temperature >= GREEDY_EPS)
        self.n = pol.choose(ids, self.runner.config.max_num_batched_tokens, behind, sampled=sampled, rest=rest,
                            left=left)
        if self.n > 1:
            self._recheck = self.recheck_every
            return self.lookahead
        # the next scan: doubled while plain choices repeat for one running set, no later than the
        # step whose choice could explore
        skip = min(2 * self._recheck, self.recheck_most) if confirm else self.recheck_every
        self._recheck = min(skip, max(pol.explore_due - 1, 0))
        return 0

    def observe_step(self, ms: float) -> None:
        """The engine's whole step (scheduling, runner, output bookkeeping) took ms: the policy
        learns it when the step was a pure one (``pending_cost``: (tree size, batch), set by the
        runner)."""
        if self.policy is not None and self.pending_cost is not None:
            n, b = self.pending_cost
            self.policy.observe_cost(n, b, ms)
        self.pending_cost = None

    # ---- the start-up cost profile
    @torch.inference_mode()
    def measure(self, batches: list[int] | None = None, repeats: int = 2, sampled: bool = False):
        """The policy's CostTable: milliseconds of a plain decode step (n = 1: the decode graph's
        replay to its tokens' read-back; the feature store, which runs after the fence -- inside
        the graph after its mark, or as a graph of its own -- falls in the host's turnaround in
        service, so it is waited for before each timed call, not inside it) and of a greedy
        speculative step of each menu size (the
        draft's catch-up over two rows a sequence, proposal, verify, acceptance, KV move: the
        speculative step's graph where one exists), for batch sizes up to max_num_seqs whose B * n
        fits the step budget, on the engine's own caches before any request (blocks from 0,
        contexts of 32 tokens, fewer where max_model_len leaves no room for them). One warm-up run
        each, then the best of ``repeats``. sampled: the same steps at temperature 1 where their
        graphs exist (sampled decode and speculative step graphs; elsewhere the greedy path's
        time): on the H100 a sampled speculative step of 2 nodes
        at batch 64 took 2.07 ms against its greedy profile's 1.50, and until its measured ratio
        had learned that, the policy chose it at a loss (42 steps of a batch-32 run, 3.5%)."""
        from .spec.policy import CostTable

        cfg, dev, bs = self.runner.config, self.device, self.block_size
        ctx_len = max(1, min(32, self._longest - 1))  # (a shorter max_model_len: positions stay inside it)
        if batches is None:
            batches, b = [], 1
            while b < cfg.max_num_seqs:
                batches.append(b)
                b *= 2
            batches.append(cfg.max_num_seqs)
        per_row = -(-(ctx_len + max(self.num_nodes, self.scratch + 1)) // bs)
        batches = [b for b in batches if b * per_row <= self.runner.num_blocks] or [1]

        def sync():
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        graphs = self.runner.graphs

        def prepare(n: int, b: int):
            """The step of n nodes at batch b as a call, its inputs made beforehand and a plain step's
            tokens read back as the runner reads them (the graph's own host copy). Timed with its input
            uploads, two read-backs and an argmax over the vocabulary, the H100's profile put a plain
            step at batch 1 at 1.135 ms where served ones took 0.93 (thirty-fifth session), so that
            speculation looked better than it was until the measured ratios had learnt otherwise."""
            tables = torch.arange(b * per_row, device=dev, dtype=torch.int32).view(b, per_row)
            ctx = torch.full((b,), ctx_len, dtype=torch.int64, device=dev)
            temps = np.ones(b, dtype=np.float32) if sampled else None
            if n == 1:  # an ordinary decode step as the runner runs it: a graph replay when one fits
                slots = tables.long()[:, ctx_len // bs] * bs + ctx_len % bs
                if graphs is not None and b <= graphs.max_batch:
                    hb = HostBatch([0] * b, [ctx_len] * b, slots.tolist(), [ctx_len + 1] * b, None,
                                   tables.cpu().numpy(), list(range(b)), [(i, i) for i in range(b)], [])
                    tl = None if temps is None else temps.tolist()
                    return lambda: graphs.replay(hb, tl)[1].tolist()  # the graph's tokens: the runner's read-back
                meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=(ctx + 1).to(torch.int32),
                                         decode=True, num_splits=self.runner.decode_splits(b))

                def eager() -> None:
                    hidden = self.model(torch.zeros(b, dtype=torch.int64, device=dev), ctx, meta)
                    self.store.store(hidden, self.model.model.aux_hidden, slots)
                    self.model.compute_logits(hidden).argmax(dim=-1).tolist()
                return eager
            ids = torch.zeros(b, self.catch_rows, dtype=torch.int64, device=dev)
            if self.graphs is not None and self.graphs.bucket(b, n, sampled) is not None:
                return lambda: self.graphs.run(ids, ctx, tables, n, temps)  # (its read-back: the step's sync)

            def spec() -> None:
                states = self._states_fixed(ids[:, -2:] if self.eagle else ids, ctx, tables)
                self._draft_and_verify(ids[:, -1], states, ctx, tables, [_GREEDY] * b, n)[3].num_accepted.tolist()
            return spec

        ms: dict[int, list[float]] = {}
        for n in [1, *self.sizes]:
            row = []
            for b in batches:
                if n > 1 and b * n > cfg.max_num_batched_tokens:
                    row.append(row[-1] * 2 if row else 1e9)  # never scheduled: priced out
                    continue
                one = prepare(n, b)
                one()
                best = float("inf")
                for _ in range(repeats):
                    sync()
                    t0 = time.perf_counter()
                    one()  # (each call ends in its step's read-back, the host sync the runner waits on)
                    best = min(best, (time.perf_counter() - t0) * 1e3)
                row.append(max(best, 1e-3))
            ms[n] = row
        table = CostTable(batches, ms)
        if sampled:
            self.cost_table_sampled = table
        else:
            self.cost_table = table
        return table

    @torch.inference_mode()
    def measure_catch_up(self, repeats: int = 2) -> tuple[float, float] | None:
        """EAGLE: (c0 ms, c1 ms a row) of the draft's eager catch-up, c0 + c1 * rows, fitted to two
        timed runs of its forward over 32 rows a sequence (fewer where max_model_len is shorter; one
        sequence, then as many as the cache holds, up to max_num_seqs); best of ``repeats`` after a
        warm-up. None for Medusa."""
        if not self.eagle:
            return None
        dev, bs, rows = self.device, self.block_size, min(32, self.runner.max_model_len)
        per_row = -(-rows // bs)
        most = max(1, min(self.runner.config.max_num_seqs, self.runner.num_blocks // per_row))
        points = []
        for b in sorted({1, most}):
            tables = torch.arange(b * per_row, device=dev, dtype=torch.int32).view(b, per_row)
            ids = torch.zeros(b, rows, dtype=torch.int64, device=dev)
            ctx = torch.full((b,), rows, dtype=torch.int64, device=dev)
            best = float("inf")
            for i in range(repeats + 1):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                self._states_fixed(ids, ctx, tables)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                if i:
                    best = min(best, (time.perf_counter() - t0) * 1e3)
            points.append((b * rows, max(best, 1e-3)))
        if len(points) == 1:
            return points[0][1], 0.0
        (r1, t1), (r2, t2) = points
        c1 = max((t2 - t1) / (r2 - r1), 0.0)
        return max(t1 - c1 * r1, 1e-3), c1

    # ---- which sequences speculate
    def eligible(self, seq) -> bool:
        """Whether the sequence's next decode can be a speculative step (asked of every running
        sequence when the policy scans: kept to attribute reads and one call the first time). plan()'s
        ``_scan`` has these conditions written out: change both (test_eligible_decodes_is_eligible_per_decode
        checks that they agree)."""
        num_tokens = len(seq.token_ids)
        ok = seq.spec_params_ok
        if ok is None:
            ok = self._params_allow(seq)
        return (ok and seq.num_computed_tokens > 0 and num_tokens <= self._longest
                and num_tokens - seq.num_prompt_tokens >= seq.params.min_tokens)

    @staticmethod
    def _params_allow(seq) -> bool:
        """What of eligibility the sequence's sampling parameters fix (no penalties; no per-request
        seed under sampling): worked out once and kept on the sequence."""
        ok = seq.spec_params_ok
        if ok is None:
            p = seq.params
            ok = seq.spec_params_ok = not p.uses_penalties and (p.seed is None or p.temperature < GREEDY_EPS)
        return ok

    def eligible_decodes(self, running) -> list:
        """The running sequences whose next step is a decode (one token to compute) that can
        speculate (``eligible``)."""
        return self._scan(running)[0]

    def _scan(self, running, draining: bool = False) -> tuple[list, list[int], int, bool, int, list[int] | None]:
        """plan()'s one pass over the running sequences: ``eligible_decodes(running)``, their seq ids,
        their ``rows_behind``, whether any of them samples, how many other decodes there are (they
        run plain: a step that speculates runs them in a forward of their own), and, if draining and
        two or more are eligible, their tokens left (``drain_left``; None when not draining, or where
        a length is open), with ``eligible``, ``_upto`` and ``drain_left`` written out (a method call
        less per sequence, each of three passes fewer: a scan at batch 64 cost ~21 -> ~11 µs on the
        CPU; draining, a second pass after it cost 16 µs more, written out here 2.5 µs)."""
        longest, allow = self._longest, self._params_allow
        g = self.catch_rows if self.eagle else None
        seqs, ids, behind, sampled, rest = [], [], 0, False, 0
        together, last, left = draining, None, []
        for s in running:
            n, c = len(s.token_ids), s.num_computed_tokens
            if n - c != 1:
                continue
            ok = s.spec_params_ok
            if ok is None:
                ok = allow(s)
            p, out = s.params, n - s.num_prompt_tokens
            if not (ok and c > 0 and n <= longest and out >= p.min_tokens):
                rest += 1
                continue
            seqs.append(s)
            ids.append(s.seq_id)
            if not sampled and p.temperature >= GREEDY_EPS:
                sampled = True
            if g is not None:
                st = s.spec_state
                r = c - (st[1] if st is not None and st[0] == s.num_preemptions else 0) - g
                if r > 0:
                    behind += r
            if together and p is not last:
                together, last = fixed_length(p), p
            if together:
                left.append(p.max_tokens - out)
        return seqs, ids, behind, sampled, rest, left if together and len(seqs) > 1 else None

    def speculates(self, seq) -> bool:
        """The scheduler's question for each decode of a step whose plan() returned a lookahead:
        whether seq is among the sequences plan() found eligible (its set, when the policy
        scanned them; else ``eligible``)."""
        planned = self._planned
        return seq.seq_id in planned if planned is not None else self.eligible(seq)

    def rows_behind(self, seqs) -> int:
        """EAGLE: the rows a speculative step of seqs must run the draft over before its graph's own
        window of the last G (earlier plain steps' rows): summed over seqs (0: none behind)."""
        if not self.eagle:
            return 0
        g = self.catch_rows
        return sum(max(s.num_computed_tokens - self._upto(s) - g, 0) for s in seqs)

    def _upto(self, seq) -> int:
        """EAGLE: the positions the draft has run over (its KV), 0 after a preemption."""
        st = seq.spec_state
        return st[1] if st is not None and st[0] == seq.num_preemptions else 0

    # ---- the draft states
    def _context(self, seqs) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_computed_tokens int64 [B], block tables int32 [B, width]) on the device."""
        ctx = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.int64, device=self.device)
        width = max(len(s.block_table) for s in seqs)
        return ctx, torch.from_numpy(self.runner.block_tables.gather(seqs, width)).to(self.device)

    def _medusa_states(self, ctx: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Medusa's states: the features at c - 1 (the rows that sampled the roots)."""
        at = step_slots(tables, ctx, -1, 1, self.block_size, backend=self.runner.backend)
        return self.store[at.slots.view(-1)]

    @torch.inference_mode()
    def states(self, seqs, stop: list[int] | None = None) -> torch.Tensor:
        """The draft states [B, H] of sequences about to speculate (EAGLE: the draft runs over each
        sequence's rows [u, c) first: one forward). stop[b] < c: run over [u, stop[b]) only (the
        rows a graphed step's catch-up leaves out); the states returned are then meaningless."""
        return self._catch_up(seqs, *self._context(seqs), stop)

    def _catch_up(self, seqs, ctx: torch.Tensor, tables: torch.Tensor, stop: list[int] | None = None):
        """``states`` with the sequences' context lengths and block tables already on the device.
        The rows are padded to ``catch_up_rows(rows)`` (pads: sequences of one row each in the
        padding block, whose outputs nobody reads), so the draft's GEMMs see few shapes: on the H100
        a cuBLAS GEMM's first call at a new row count took 2.1-2.6 ms against 0.06 ms for the next
        (benchmarks/first_call_cost.py), and served catch-ups, each over a new count, took 4-5 ms."""
        if not self.eagle:
            return self._medusa_states(ctx, tables)
        dev, bs = self.device, self.block_size
        ids, pos, which, cu, ends = [], [], [], [0], []
        for b, s in enumerate(seqs):
            u, c = self._upto(s), s.num_computed_tokens if stop is None else stop[b]
            if c <= u:
                continue
            ids += s.token_ids[u + 1: c + 1]
            pos += range(u, c)
            which += [b] * (c - u)
            cu.append(cu[-1] + c - u)
            ends.append(c)
            s.spec_state = (s.num_preemptions, c)
        if len(cu) == 1:
            return None
        real, rows = len(cu) - 1, len(ids)
        sel = sorted(set(which))
        pad = catch_up_rows(rows) - rows
        if pad:  # each pad its own one-row sequence over the padding block (its KV and feature slots)
            pad_row = len(seqs)
            tables = torch.cat([tables, self._pad_table(tables.shape[1])])
            ids += [0] * pad
            pos += [0] * pad
            which += [pad_row] * pad
            sel += [pad_row] * pad
            cu += range(cu[-1] + 1, cu[-1] + pad + 1)
            ends += [1] * pad
        ids_t, pos_t, which_t = packed_to(dev, "q", ids, pos, which)  # each view 16-byte aligned
        lens_t, cu_t = packed_to(dev, "i", ends, cu)
        slots = tables.long()[which_t, pos_t // bs] * bs + pos_t % bs
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables[sel], seq_lens=lens_t,
                                 decode=False, cu_seqlens_q=cu_t,
                                 max_seqlen_q=max(b - a for a, b in zip(cu[:real], cu[1:real + 1])))
        pred = self.draft(self.store[slots], ids_t, pos_t, meta)
        return pred[cu_t[1:real + 1].long() - 1]

    def _pad_table(self, width: int) -> torch.Tensor:
        """int32 [1, width] of the padding block (the block after those the scheduler hands out)."""
        t = self._pad_tables.get(width)
        if t is None:
            t = self._pad_tables[width] = torch.full((1, width), self.runner.num_blocks, dtype=torch.int32,
                                                     device=self.device)
        return t

    def _states_fixed(self, ids: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Tensor-only states (a graphed step's): EAGLE, the draft over the last G rows of each
        sequence, positions c - G .. c - 1, ids int64 [B, G] the tokens at c - G + 1 .. c (the root
        last); rows the draft ran over before are recomputed to the same values. A sequence with
        c < G has G - c rows before position 0: they store nothing (slot -1), read the feature
        store's dump row and position 0, and no later row sees them (the extend kernel places
        query i at c - G + i). Medusa: the feature at c - 1 (ids unused)."""
        bsz, bs, dev = ctx.shape[0], self.block_size, self.device
        if not self.eagle:
            return self._medusa_states(ctx, tables)
        g = ids.shape[1]
        win = step_slots(tables, ctx, -g, g, bs, backend=self.runner.backend)  # positions c - G .. c - 1
        slots = win.slots.view(-1)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=win.lens, decode=False,
                                 cu_seqlens_q=const_arange(bsz + 1, dev, torch.int32, step=g),
                                 max_seqlen_q=g)
        pred = self.draft(self.store[slots], ids.reshape(-1), win.pos.view(-1), meta)
        return pred.view(bsz, g, -1)[:, -1]

    # ---- the speculative step
    @inference
    def step(self, seqs) -> list[list[int]]:
        """One speculative step for sequences that are all eligible decodes (their blocks cover
        num_computed_tokens + lookahead); returns each one's new tokens (accepted + 1)."""
        bsz = len(seqs)
        params = [s.params for s in seqs]
        greedy = all(p.temperature < GREEDY_EPS and p.logprobs is None for p in params)
        # sampled rows whose only parameter is a temperature have graphs too (SamplingParams.temperature_only)
        sampled = not greedy and all(p.logprobs is None and p.temperature_only(self.runner.vocab_size) for p in params)
        key = self.graphs.bucket(bsz, self.n, sampled) if self.graphs is not None and (greedy or sampled) else None
        behind = self._count_behind(seqs)
        if key is not None:
            self._catch_up_before_window(seqs, behind)
            temps = [p.temperature for p in params] if sampled else None
            h = self.graphs.run_seqs(seqs, self.n, temps)
            return self._emit_host(seqs, h, self.n, (h.shape[1] - 1 - self.graphs.num_sizes) // 2)
        ctx, tables = self._context(seqs)
        states = self._eager_states(seqs, ctx, tables, behind)
        tree, _, logits, res, ranks = self._draft_and_verify(self._roots(seqs), states, ctx, tables, params, self.n)
        return self._emit(seqs, res, self._per_size(res, ranks), tree.num_nodes, logits)

    # ---- a speculative step whose verify forward carries other rows (the runner's fused step)
    @inference
    def propose(self, seqs, ctx: torch.Tensor, tables: torch.Tensor) -> Proposal:
        """The first half of a speculative step for eligible decodes whose trees the runner
        verifies in one forward with the step's plain rows (prefill chunks, plain decodes): the
        draft's states and trees, under a propose graph where one fits. ctx int64 [B] and tables
        int32 [B, W] on the device, as ``_context`` gives them."""
        behind = self._count_behind(seqs)
        if self.graphs is not None and self.graphs.propose_bucket(len(seqs), self.n) is not None:
            self._catch_up_before_window(seqs, behind)
            tree, ranks = self.graphs.run_propose_seqs(seqs, self.n)
        else:
            tree, ranks = self._propose(self._roots(seqs), self._eager_states(seqs, ctx, tables, behind), ctx,
                                        tables, self.n)
        return Proposal(seqs, tree, ranks, ctx, tables, *self._node_slots(ctx, tables, tree.num_nodes))

    def accept(self, prop: Proposal, hidden: torch.Tensor, aux: torch.Tensor | None,
               logits: torch.Tensor) -> AcceptResult:
        """The second half, up to its host sync: acceptance over the proposal's trees from the
        target's rows of the nodes (hidden [B * N, H], EAGLE-3's aux, logits [B, N, V]), the
        accepted KV moved into place and its features stored."""
        return self._accept(prop.tree, hidden, aux, logits, prop.ctx, prop.tables, prop.slots,
                            [s.params for s in prop.seqs], prop.ranks)

    def emit(self, prop: Proposal, res: AcceptResult, logits: torch.Tensor) -> list[list[int]]:
        """The host sync that ends a fused step's speculative half: each sequence's new tokens."""
        return self._emit(prop.seqs, res, self._per_size(res, prop.ranks), prop.tree.num_nodes, logits)

    # ---- the step's parts
    def _roots(self, seqs) -> torch.Tensor:
        return torch.tensor([s.last_token_id for s in seqs], dtype=torch.int64, device=self.device)

    def _count_behind(self, seqs) -> int:
        """The rows the draft must first run over (earlier plain steps'), counted in the stats. A
        step that first catches up pays a cost that steady speculation does not: its wall time
        says little of a step's."""
        planned = self._plan_behind
        # the scheduler runs plan() and then this step with nothing computed between: when the step
        # takes every sequence plan() scanned (most steps), its count stands (a scan of the batch less)
        behind = planned[1] if planned is not None and planned[0] == seqs else self.rows_behind(seqs)
        self.last_step_caught_up = behind > 0
        if behind:
            self.stats.caught_up_steps += 1
            self.stats.catch_up_rows += behind
        return behind

    def _catch_up_before_window(self, seqs, behind: int) -> None:
        """Before a graphed step: EAGLE's catch-up over the rows before the graph's own window, eager."""
        if not self.eagle:
            return
        g = self.catch_rows
        if behind:
            t0 = time.perf_counter()
            self.states(seqs, stop=[s.num_computed_tokens - g for s in seqs])
            self._caught_up(behind, t0)
        for s in seqs:
            s.spec_state = (s.num_preemptions, s.num_computed_tokens)

    def _eager_states(self, seqs, ctx, tables, behind: int) -> torch.Tensor:
        """The draft states of an eager step (EAGLE: after its catch-up over every row it has not run over)."""
        t0 = time.perf_counter()
        states = self._catch_up(seqs, ctx, tables)
        if behind:
            self._caught_up(behind, t0)
        return states

    def _sizes_on(self) -> torch.Tensor:
        """The menu's sizes, int64 [S] on the device (made again if the menu changed)."""
        key = tuple(self.sizes)
        if self._sizes_t is None or self._sizes_t[0] != key:
            self._sizes_t = (key, torch.tensor(key, dtype=torch.int64, device=self.device))
        return self._sizes_t[1]

    def _menu(self) -> torch.Tensor | None:
        """The sizes whose acceptance a step reports (the adaptive menu's; None: fixed trees)."""
        return self._sizes_on() if self.adaptive else None

    def _per_size(self, res: AcceptResult, ranks: torch.Tensor) -> torch.Tensor | None:
        """The policy's per-size acceptance of an eager step, on the device (None without a policy,
        or where the acceptance kernel wrote it into res.packed)."""
        if self.policy is None or res.packed is not None:
            return None
        return accepted_per_size(res.accepted, ranks, self._sizes_on())

    @staticmethod
    def _pack(res: AcceptResult, per_size: torch.Tensor | None) -> torch.Tensor:
        """A step's results as the host reads them back, one int64 [B, 1 + 2 N (+ S)]: num_accepted,
        tokens, the accepted path (and the accepted draft tokens per menu size). Eager steps and the
        step graphs both: ``_emit`` parses this layout. The acceptance kernel writes it whole
        (res.packed, with the menu's sizes where the decoder is adaptive); else tensor ops."""
        if res.packed is not None:
            return res.packed
        return pack_results(res.num_accepted, res.tokens, res.accepted, per_size)

    def _emit(self, seqs, res: AcceptResult, per_size: torch.Tensor | None, n: int, logits) -> list[list[int]]:
        """An eager step's one host sync and its bookkeeping (``_emit_host``): res and per_size (int64
        [B, S]: ``accepted_per_size`` over the menu, on the device) read back in one copy (a
        read-back per tensor, each a copy and a kernel launch, cost the H200's host ~0.3 ms a step at
        batch 1); logits [B, n, V] for the rows that asked for log-probabilities."""
        h = self._pack(res, per_size).cpu().numpy()  # the sync; then numpy only (each torch call costs the host more)
        return self._emit_host(seqs, h, n, res.tokens.shape[1], logits, res)

    def _emit_host(self, seqs, h: np.ndarray, n: int, width: int, logits=None,
                   res: AcceptResult | None = None) -> list[list[int]]:
        """A step's bookkeeping from its results on the host, h int64 [B, 1 + 2 width (+ S)]
        (``_pack``'s layout, width the trees' nodes: a step graph's read-back, SpecStepGraphs.run):
        each sequence's new tokens (accepted + 1), the policy's per-size acceptance,
        log-probabilities (logits and res: an eager step whose rows asked; a graphed step has
        none), the stats."""
        bsz = len(seqs)
        num_acc = h[:, 0].tolist()
        tokens = h[:, 1:1 + width].tolist()
        out = [tokens[b][:num_acc[b] + 1] for b in range(bsz)]
        if self.policy is not None:
            if h.shape[1] == 1 + 2 * width:  # graphs captured before the policy was asked for
                raise RuntimeError("the adaptive policy needs each step's per-size acceptance; these speculative "
                                   "step graphs were captured without it (make the graphs after setting adaptive)")
            self._observe_sizes(seqs, h[:, 1 + 2 * width:], n)
        if logits is not None and res is not None and any(s.params.logprobs is not None for s in seqs):
            self._record_logprobs(seqs, out, logits.reshape(bsz * n, -1), self._path_rows(res.accepted, n))
        st = self.stats
        st.steps += 1
        st.steps_by_size[n] = st.steps_by_size.get(n, 0) + 1
        st.explored += self.policy is not None and self.policy.last_explored
        st.seq_steps += bsz
        st.drafted += bsz * (n - 1)
        st.accepted += sum(num_acc)
        for k in num_acc:
            if k >= len(st.histogram):
                st.histogram.extend([0] * (k + 1 - len(st.histogram)))
            st.histogram[k] += 1
        return out

    def _caught_up(self, rows: int, t0: float) -> None:
        """A catch-up over `rows` rows began at perf_counter t0: its time (synchronised: the step
        syncs at its end anyway) to the stats and the policy."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ms = (time.perf_counter() - t0) * 1e3
        self.stats.catch_up_ms += ms
        if self.policy is not None:
            self.policy.observe_catch_up(rows, ms)

    def _draft_and_verify(self, roots, states, ctx, tables, params, n, inner: bool = False, temps=None,
                          later: list | None = None):
        """Propose trees of n nodes, verify them in one target forward, accept, move the accepted
        KV into place and store the accepted rows' features. Returns (tree, hidden [B * N, H],
        logits [B, N, V], the AcceptResult, each node's rank int64 [B, N]: the trees of the first m
        ranks are the smaller trees of the menu). inner: inside a SpecStepGraphs capture (the
        verify forward runs in it, not in VerifyGraphs); temps float32 [B] (inner only): the rows
        sample at these temperatures (< GREEDY_EPS: greedy), by rejection sampling over the tree
        with counter-based noise (kernels/sample.py; the counters advance inside the graph),
        params unused. later: the features' store appended there, not run (``_accept``)."""
        dev = self.device
        bsz = roots.shape[0]
        tree, ranks = self._propose(roots, states, ctx, tables, n)
        n = tree.num_nodes
        # verify: every node at once, K/V to slots c + i, positions c + depth
        slots, lens = self._node_slots(ctx, tables, n)
        graphs = None if inner else self.runner.verify_graphs
        hidden = None if graphs is None else graphs.run(tree.tokens, tree.positions(ctx), slots, tables, lens,
                                                         tree.mask)
        if hidden is None:
            meta = AttentionMetadata(
                slot_mapping=slots, block_tables=tables, seq_lens=lens, decode=False,
                cu_seqlens_q=const_arange(bsz + 1, dev, torch.int32, step=n), max_seqlen_q=n,
                mask=tree.mask.reshape(-1), mask_offsets=const_arange(bsz, dev, step=n * n))
            hidden = self.model(tree.tokens.reshape(-1), tree.positions(ctx).reshape(-1), meta)
        aux = self.model.model.aux_hidden  # EAGLE-3: the accepted rows' fused features come from it
        logits = self.model.compute_logits(hidden).view(bsz, n, -1)
        res = self._accept(tree, hidden, aux, logits, ctx, tables, slots, params, ranks, temps, later)
        return tree, hidden, logits, res, ranks

    def _propose(self, roots, states, ctx, tables, n):
        """(tree of n nodes a sequence, each node's rank int64 [B, N])."""
        if self.eagle:
            return self._propose_eagle(roots, states, ctx, tables, n)
        tree = self._propose_medusa(roots, states, n)
        return tree, const_arange(tree.num_nodes, self.device).expand(roots.shape[0], -1)

    def _node_slots(self, ctx: torch.Tensor, tables: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 [B * n]: the cache slots c + i of the tree nodes (K/V written there, then moved),
        int32 [B]: the verify's sequence lengths c + n), in one launch."""
        nodes = step_slots(tables, ctx, 0, n, self.block_size, lens_add=n, backend=self.runner.backend)
        return nodes.slots.view(-1), nodes.lens

    def _path_rows(self, accepted: torch.Tensor, n: int) -> torch.Tensor:
        """int64 [B, N]: the verify forward's row (b * n + node) of each accepted path's nodes
        (accepted [B, N], -1 past the path: the sequence's root row)."""
        return const_arange(accepted.shape[0], self.device, step=n)[:, None] + accepted.clamp_min(0)

    def _accept(self, tree, hidden, aux, logits, ctx, tables, slots, params, ranks, temps=None,
                later: list | None = None) -> AcceptResult:
        """Acceptance over the verified trees (hidden [B * N, H] and EAGLE-3's aux: the target's
        rows of the nodes; logits [B, N, V]; ranks int64 [B, N], ``_propose``'s), the accepted path's
        KV moved to c .. c + k and its features stored at those slots. temps: as _draft_and_verify's.
        later: the store is not run but appended there as a call (a step graph runs it after its
        fence's mark). On the kernels the result comes packed (``AcceptResult.packed``), with the
        menu's per-size acceptance where the decoder is adaptive."""
        bsz, n = tree.tokens.shape
        kv = self.runner.kv_cache
        greedy = temps is None and all(p.temperature < GREEDY_EPS for p in params)
        if temps is not None or (greedy and self.runner.backend == "triton"):
            if temps is None:
                # greedy on the kernels: acceptance, the result, the KV move and the store's rows in
                # one launch (the tensor-op path below is ~60 kernels of a step's graph)
                target = self.sampling.argmax(logits.view(bsz * n, -1), self.runner.vocab_size).view(bsz, n)
                be = "triton"
            else:
                # sampled rows (inside a step graph): a token drawn from the target at every node (the
                # argmax where the row is greedy), matched by the same launch -- rejection sampling
                # over point-mass drafts, lossless (kernels/spec_accept.py); the tensor-op rule with
                # its [B, N, V] probabilities took ~130 kernels of the step's graph, this three
                rows_t = temps[:, None].expand(bsz, n).reshape(-1)
                target = self.sampling.draw(logits.view(bsz * n, -1), rows_t, self.runner.vocab_size).view(bsz, n)
                be = self.runner.backend
            menu = self._menu()
            packed, rows, stored = greedy_accept_move_packed(
                tree.tokens, tree.parents, tree.depths, tree.mask, tree.paths, tree.sizes, target, tables, ctx,
                kv.k, kv.v, kv.k_scale, kv.v_scale, backend=be, first_match=temps is not None,
                ranks=None if menu is None else ranks, menu=menu)
            self._store_rows(hidden, aux, rows.reshape(-1), stored.reshape(-1), later)
            return AcceptResult(packed[:, 1 + n:1 + 2 * n], packed[:, 0], packed[:, 1:1 + n], packed)
        if greedy:
            res = greedy_accept(tree, logits.argmax(dim=-1))
        else:
            res = rejection_accept(tree, target_probs(logits, params), None, generator=self.generator)
        src, dst = accepted_kv_slots(tables, ctx, res.accepted, self.block_size)
        move_kv_slots([kv.k, kv.v, kv.k_scale, kv.v_scale], src, dst)
        # the accepted rows' features at positions c .. c + k (the rest: the dump row)
        rows = self._path_rows(res.accepted, n).reshape(-1)
        self._store_rows(hidden, aux, rows, torch.where(res.accepted.reshape(-1) >= 0, slots, -1), later)
        return res

    def _store_rows(self, hidden, aux, rows: torch.Tensor, slots: torch.Tensor, later: list | None) -> None:
        """The features of the verify's rows `rows` (of hidden and aux) stored at slots (-1: none),
        now, or appended to later as a call."""
        def store() -> None:
            self.store.store(hidden[rows], None if aux is None else aux[rows], slots)
        if later is None:
            store()
        else:
            later.append(store)

    def _observe_sizes(self, seqs, per_size, n) -> None:
        """The policy's per-size acceptance: under each menu size m <= n, the accepted path cut at
        its first node of rank >= m (exact under greedy acceptance). per_size: int64 [B, S] on the
        host, ``accepted_per_size`` over the menu (sorted: the sizes <= n come first)."""
        sizes = [m for m in self.sizes if m <= n]
        self.policy.observe_many([s.seq_id for s in seqs], sizes, per_size[:, :len(sizes)])

    def _propose_medusa(self, roots: torch.Tensor, states: torch.Tensor, n: int):
        tree = self.trees[n]
        logits = self.draft(states)  # [B, heads, V]
        topk = topk_logprobs(logits, tree.top_k, self.runner.backend)[1]
        return tree.batch(roots, topk)

    def _propose_eagle(self, roots, states, ctx, tables, n):
        dev, bs, be = self.device, self.block_size, self.runner.backend
        bsz, h = roots.shape[0], states.shape[-1]
        # a tree of n nodes is at most n - 1 deep and keeps at most n - 1 nodes of a level: no
        # expansion past either (a chain of n - 1 is all the smallest menu sizes can keep)
        depth, k = self.tree_depth(n), self.tree_width(n)
        # EAGLE-2 growth (kernels/tree_grow.py): each level's bookkeeping -- the candidates into the
        # pool, the next frontier, its input features and ancestor mask -- in one launch, the final
        # selection and the tree's structure in one more
        pool = new_pool(bsz, k, depth, dev)
        lp, ids = self.draft.ranked(states, k)
        front = grow(pool, 1, lp.view(bsz, 1, k), ids.view(bsz, 1, k), states.view(bsz, 1, h), roots=roots,
                     last=depth == 1, backend=be)
        size = 1 + k
        if depth > 1:
            # level d runs only its k frontier rows (depth d, at position c + d - 1, scratch rows
            # (d - 1) k .. d k - 1 in slots c + row), their keys the context and the m = d k scratch
            # rows so far under the ancestor mask: the rows of earlier levels are in the draft's
            # cache already (each level rerunning them cost a concatenation and their compute)
            off_lv, cu = _level_offsets(bsz, k, depth - 1, dev)
            # each level's slots and positions as one contiguous [B, k] block ([levels, B, k]), its
            # sequence lengths c + d k ([levels, B]): one launch
            slots_lv, pos_lv, lens_lv = step_slots(tables, ctx, 0, (depth - 1) * k, bs, group=k, backend=be)
        for d in range(1, depth):
            meta = AttentionMetadata(
                slot_mapping=slots_lv[d - 1].view(-1), block_tables=tables, seq_lens=lens_lv[d - 1], decode=False,
                cu_seqlens_q=cu, max_seqlen_q=k, mask=front.mask.view(-1), mask_offsets=off_lv[d - 1],
                mask_cols=d * k)
            out, lp, ids = self.draft.forward_ranked(front.features.view(bsz * k, h), front.tokens.view(-1),
                                                     pos_lv[d - 1].view(-1), meta, k)
            front = grow(pool, size, lp.view(bsz, k, k), ids.view(bsz, k, k), out.view(bsz, k, h), front=front,
                         last=d == depth - 1, backend=be)
            size += k * k
        t = select(pool, n, depth, backend=be)
        tree = TreeBatch(t.tokens, t.parents, const_full((bsz,), n, torch.int64, dev), t.depths, t.mask, t.paths)
        return tree, t.ranks

    def _record_logprobs(self, seqs, out, logits, rows) -> None:
        """Raw log-probabilities of the emitted tokens, from the target's logits at the path's
        nodes (node i of the path scores emitted token i), for sequences that asked."""
        for b, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                continue
            m = len(out[b])
            targets = torch.tensor(out[b], dtype=torch.int64, device=logits.device)
            lp, _rank, tids, tlp = token_logprobs(logits[rows[b, :m]], targets, k)
            lp, tids, tlp = lp.tolist(), tids.tolist(), tlp.tolist()
            for j in range(m):
                entry = {out[b][j]: lp[j]}
                for t, v in zip(tids[j], tlp[j]):
                    entry.setdefault(t, v)
                seq.output_logprobs.append(entry)


class SpecStepGraphs:
    """Speculative steps under CUDA graphs: one graph per (batch bucket b, tree size n, sampled)
    with b * n <= max_tokens, captured once at start, each the whole of a SpecDecoder step: the
    draft states (EAGLE: its catch-up over each sequence's last G = depth + 1 + CATCH_SLACK rows), the proposal,
    the verify forward, acceptance, the KV move and the feature store. Outputs: the
    AcceptResult's tensors and the adaptive policy's per-size acceptance; the caller's one host
    sync reads them.

    Greedy graphs accept greedily. Sampled graphs serve batches whose rows ask for a temperature
    and nothing else (``SamplingParams.temperature_only``; a greedy row among them has temperature 0): the
    per-row temperatures are a static input, the acceptance rejection sampling over the tree in
    its point-mass form: a token drawn from the target at every node (kernels/sample.py, Philox
    counters that advance inside the graph), matched by the greedy launch (``first_match``).

    Inputs: ids int64 [b, G] (the tokens at positions c - G + 1 .. c, the root last; Medusa: G = 1,
    the root), ctx int64 [b], tables int32 [b, width], temps float32 [b]. A step graph reads them
    from host staging buffers laid out for its bucket (int64 [ids b x G | ctx b], int32 tables, float32
    temps; see cuda_graphs.HostStaging: the host writes them with numpy, the graph copies them in),
    and outputs its results packed in one int64 [b, 1 + 2 N + S] (num_accepted, tokens, accepted
    path, and with the adaptive policy the draft tokens each of the S menu sizes would have
    accepted, ``accepted_per_size``) for one read-back. The propose graphs read the same staging. Padding rows (past B)
    run in ``pad_block``, a block of the caches no sequence is given: their tables point only at
    it, so whatever they write lands there. ``eager_stand_in``: as DecodeGraphs' (the plumbing on a
    CPU).

    The accepted rows' features are stored after the results' copy to the host, behind a
    ``GraphFence`` mark, where ``graph_fence_ok`` (the decode graphs' rule): the host's wait ends at
    the mark and the store (fc and the scatter) runs while it reads the results. Else, or pinned off
    (``store_after_mark`` False: tests), the store comes before the results and the host's fence is
    recorded after the replay."""

    store_after_mark: bool | None = None

    def __init__(self, spec: SpecDecoder, max_batch: int, sizes, max_tokens: int, width: int, pad_block: int,
                 eager_stand_in: bool = False) -> None:
        dev = spec.device
        # spec owns these graphs (spec.graphs): a proxy back, not a reference (SpecDecoder.runner's reason)
        self.spec = weakref.proxy(spec)
        self.pad_block, self.width, self.g = pad_block, width, spec.catch_rows
        # the adaptive policy's per-size acceptance, computed in the graph (its read-back: S numbers a row)
        self.sizes_t = spec._sizes_on() if spec.adaptive else None
        self.num_sizes = 0 if self.sizes_t is None else self.sizes_t.shape[0]
        self.keys = sorted({(b, n, k) for n in sizes for b in graph_buckets(max_batch) for k in (False, True)
                            if b * n <= max_tokens})
        # the proposal alone (catch-up window, draft states, trees), for steps whose verify forward
        # also carries plain rows (eager, ragged): keys (b, n)
        self.propose_keys = sorted({(b, n) for b, n, _ in self.keys})
        self._buckets: dict = {}
        big = max((b for b, _, _ in self.keys), default=1)
        self.i64 = HostStaging(big * (self.g + 1), torch.int64, dev)
        self.i32 = HostStaging(big * width, torch.int32, dev)
        self.f32 = HostStaging(big, torch.float32, dev)
        # the store of the accepted rows' features after the results' read-back point: inside each
        # step graph after its fence's mark where the device allows it (as the decode graphs' store)
        pin = self.store_after_mark
        self.after_mark = graph_fence_ok(dev) if pin is None else pin
        self.fence = GraphFence(dev) if self.after_mark else ReplayFence(dev)
        # each step graph's packed results also copied to the host inside the graph (a buffer a key,
        # made at its warm-up run): the step reads them with no torch op
        self.readback: dict | None = {} if captured_download_ok(dev) else None
        self.graphs: dict = {}
        runs = {k: functools.partial(self._run, *k) for k in sorted(self.keys, key=lambda k: (-k[0] * k[1], k[2]))}
        runs |= {("propose", *k): functools.partial(self._run_propose, *k)
                 for k in sorted(self.propose_keys, key=lambda k: -k[0] * k[1])}
        # the warm-up runs' inputs: every row padding
        self.outputs = capture_graphs(self.graphs, runs, dev, eager_stand_in,
                                      prepare=lambda k: self._write(k[1] if k[0] == "propose" else k[0], 0, None,
                                                                    None, None))

    def _inputs(self, b: int):
        """Inside a capture: bucket b's inputs copied in from the staging, (ids, ctx, tables)."""
        g, i64 = self.g, self.i64.upload(b * (self.g + 1))
        return i64[:b * g].view(b, g), i64[b * g:], self.i32.upload(b * self.width).view(b, self.width)

    def _run(self, b: int, n: int, sampled: bool):
        spec = self.spec
        ids, ctx, tables = self._inputs(b)
        temps = self.f32.upload(b) if sampled else None
        states = spec._states_fixed(ids, ctx, tables)
        later: list | None = [] if self.after_mark else None
        _, _, _, res, ranks = spec._draft_and_verify(ids[:, -1], states, ctx, tables, [_GREEDY] * b, n, inner=True,
                                                     temps=temps, later=later)
        # what the host reads, one tensor: [num_accepted | tokens | accepted | accepted per menu size]
        # (the acceptance kernel wrote it, per-size acceptance included: adaptive decoders' graphs)
        per_size = None if self.sizes_t is None or res.packed is not None else \
            accepted_per_size(res.accepted, ranks, self.sizes_t)
        packed = spec._pack(res, per_size)
        if self.readback is not None:
            download_into(self.readback, (b, n, sampled), packed, self.spec.device)
        if later is not None:  # the host's wait ends here; the features' store runs while it reads
            self.fence.mark()
            for store in later:
                store()
        return (packed,)

    def _run_propose(self, b: int, n: int):
        spec = self.spec
        ids, ctx, tables = self._inputs(b)
        tree, ranks = spec._propose(ids[:, -1], spec._states_fixed(ids, ctx, tables), ctx, tables, n)
        if self.after_mark:  # (the fence the next staging write waits on: this graph's end)
            self.fence.mark()
        return tree.tokens, tree.parents, tree.sizes, tree.depths, tree.mask, tree.paths, ranks

    def bucket(self, bsz: int, n: int, sampled: bool = False) -> int | None:
        """The smallest captured batch bucket >= bsz for trees of n nodes (None: no graph)."""
        return self._smallest(self.keys, (bsz, n, sampled))

    def propose_bucket(self, bsz: int, n: int) -> int | None:
        return self._smallest(self.propose_keys, (bsz, n))

    def _smallest(self, keys: list[tuple], key: tuple) -> int | None:
        """The smallest b >= key[0] of the sorted keys (b, *rest) whose rest is key[1:]; memoised,
        the keys being fixed at capture (a scan of them cost ~3 µs, twice a step). The two key
        lists' keys differ in length, so one memo serves both."""
        try:
            return self._buckets[key]
        except KeyError:
            bsz, rest = key[0], key[1:]
            b = self._buckets[key] = next((k[0] for k in keys if k[1:] == rest and k[0] >= bsz), None)
            return b

    def _write(self, b: int, bsz: int, ids, ctx, tables, temps=None) -> None:
        """The host staging of bucket b: bsz rows of ids (numpy int64 [bsz, G]), ctx ([bsz]), tables
        (int32 [bsz, w <= width]) and temps ([bsz] or None), then rows bsz .. b as padding (ids 0,
        ctx G, tables all pad_block, temperature 0)."""
        g, width = self.g, self.width
        q, t = self.i64.np, self.i32.np[:b * width].reshape(b, width)
        if bsz:
            q[:bsz * g] = ids.reshape(-1)
            q[b * g:b * g + bsz] = ctx
            w = tables.shape[1]
            t[:bsz, :w] = tables
            t[:bsz, w:] = self.pad_block
            if temps is not None:
                self.f32.np[:bsz] = temps
        q[bsz * g:b * g] = 0
        q[b * g + bsz:b * (g + 1)] = g
        t[bsz:] = self.pad_block
        self.f32.np[bsz:b] = 0.0

    @inference
    def run(self, ids, ctx, tables, n: int, temps=None) -> np.ndarray:
        """B sequences' step with trees of n nodes, read back: int64 [B, 1 + 2 N + S] on the host
        (numpy; the class docstring's layout: num_accepted, tokens, accepted path, per-size
        acceptance), valid until the next replay. ids int64 [B, G], ctx int64 [B] (c >= 1), tables
        int32 [B, w <= width], temps float32 [B] (None: greedy, the greedy graph), each a numpy array
        or a tensor (a device tensor is read back first: the start-up profile's path). The step's
        host sync: the graph copied its results to the host itself (``HostReadback``), so this waits
        for the replay and slices numpy; without that copy, it reads the device output back. Needs
        a bucket: ``bucket(B, n, temps is not None)`` is not None."""
        if not isinstance(ids, np.ndarray):
            ids, ctx, tables, temps = (t.cpu().numpy() if isinstance(t, torch.Tensor) else t
                                       for t in (ids, ctx, tables, temps))
        bsz = ids.shape[0]
        key = (self.bucket(bsz, n, temps is not None), n, temps is not None)
        self.fence.wait()
        self._write(key[0], bsz, ids, ctx, tables, temps)
        self.graphs[key].replay()
        self.fence.replayed()
        if self.readback is None:
            return self.outputs[key][0][:bsz].cpu().numpy()
        self.fence.wait()
        return self.readback[key].np[:bsz]

    @inference
    def run_propose_seqs(self, seqs, n: int):
        """(TreeBatch, ranks) of the scheduled sequences' proposal, trees of n nodes (the graph's
        outputs: valid until its next replay). Needs ``propose_bucket(B, n)``."""
        bsz = len(seqs)
        b = self.propose_bucket(bsz, n)
        self.fence.wait()
        self._write(b, bsz, *self._host_inputs(seqs))
        self.graphs[("propose", b, n)].replay()
        self.fence.replayed()
        out = [t[:bsz] for t in self.outputs[("propose", b, n)]]
        return TreeBatch(*out[:6]), out[6]

    def _window(self, seqs) -> list[list[int]]:
        """Each sequence's tokens at c - G + 1 .. c (the root last), zeros before its first (rows
        of no position)."""
        g = self.g
        rows = []
        for s in seqs:
            c = s.num_computed_tokens
            rows.append(s.token_ids[c - g + 1: c + 1] if c >= g else [0] * (g - 1 - c) + s.token_ids[:c + 1])
        return rows

    def _host_inputs(self, seqs):
        """(ids, ctx, tables) of scheduled sequences, numpy."""
        ids = np.array(self._window(seqs), dtype=np.int64)
        ctx = np.array([s.num_computed_tokens for s in seqs], dtype=np.int64)
        return ids, ctx, self.spec.runner.block_tables.gather(seqs, max(len(s.block_table) for s in seqs))

    def run_seqs(self, seqs, n: int, temps: list[float] | None = None):
        """``run`` for scheduled sequences; temps: each one's temperature (None: a greedy step)."""
        return self.run(*self._host_inputs(seqs), n, None if temps is None else np.array(temps, dtype=np.float32))
