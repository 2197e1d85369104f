"""Scheduler: continuous batching with chunked prefill and preemption by recompute (vLLM v1 style).

Each step has a budget of max_num_batched_tokens tokens. Running sequences come first, in
arrival order: a decode gets 1 token, an unfinished prefill its next chunk. When blocks run
out, the most recently arrived running sequence is preempted (its blocks freed, its KV to be
recomputed later) until the allocation fits. Then, if nothing was preempted in this pass,
waiting sequences are admitted strictly first come first served, each with a prefix-cache
lookup and its first chunk. Plain Python: no torch.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import SchedulerConfig
from .sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work: seqs[i] computes the KV of its tokens [num_computed_tokens,
    num_computed_tokens + num_new_tokens[i]) and, when sampling[i], samples one token.

    sampling is fixed when the batch is made (it stays right after `update` moved the
    sequences on). preempted: sequences preempted while this batch was made.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    sampling: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # seqs[i] decodes speculatively: its blocks also cover the speculator's lookahead slots,
    # and update() takes the list of tokens the step emitted for it
    speculate: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step, all sequences together."""
        return sum(self.num_new_tokens)

    @property
    def decode_only(self) -> bool:
        """True when every sequence computes exactly one token and samples (a pure decode step)."""
        return bool(self.seqs) and all(k == 1 for k in self.num_new_tokens) and all(self.sampling)

    def samples(self, i: int) -> bool:
        """Whether seqs[i] samples a token in this step (its KV reaches its last token)."""
        return self.sampling[i]

    @property
    def sample_indices(self) -> list[int]:
        """Indices of the sequences that sample, in batch order."""
        return [i for i, s in enumerate(self.sampling) if s]


class Scheduler:
    """Decides which sequences compute which tokens each step; owns the BlockManager.

    num_blocks: KV blocks of config.block_size tokens. eos_token_ids: tokens that end a
    sequence (unless params.ignore_eos). A sequence ends with LENGTH at max_model_len tokens,
    or at the whole KV cache's num_blocks * block_size tokens when that is smaller.
    """

    def __init__(self, config: SchedulerConfig, num_blocks: int,
                 eos_token_ids: set[int] | frozenset[int] = frozenset(), speculator=None) -> None:
        """speculator: None, or what decides speculation (runtime/spec_runner.py's SpecDecoder):
        ``plan(running)`` before each step returns its lookahead (0: none this step), ``n`` is
        then the step's tree size, and ``speculates(seq)`` says which decoding sequences may
        speculate. Such a decode computes n tokens (the step's budget pays n) and writes up to
        1 + lookahead slots (its blocks cover them)."""
        self.config = config
        self.speculator = speculator
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_seq_len = min(config.max_model_len, num_blocks * config.block_size)
        self.waiting: deque[Sequence] = deque()  # in arrival order, preempted ones at the front
        self.running: list[Sequence] = []  # in arrival order
        self.num_preemptions = 0  # over the scheduler's life
        self._arrival: dict[int, int] = {}  # seq_id -> arrival rank, for every unfinished sequence
        self._next_arrival = 0
        self._held = 0  # steps a place stood empty while arrivals were held for a group (admit_group)

    # ---- metrics
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks held by sequences, in [0, 1]."""
        return self.block_manager.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prefix-cache hit tokens / queried tokens over all admissions so far."""
        return self.block_manager.hit_rate

    # ---- queue
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; ValueError when its prompt can never be served."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"seq={seq!r} is not allowed; allowed: a new waiting sequence without KV")
        if seq.seq_id in self._arrival:
            raise ValueError(f"seq={seq!r} is already scheduled")
        # the first output token is sampled from the last prompt position: a prompt may fill
        # max_model_len (the sequence then ends with LENGTH after that one token)
        n = seq.num_tokens
        if n > self.config.max_model_len:
            raise ValueError(f"prompt of {n} tokens exceeds max_model_len={self.config.max_model_len}")
        bm = self.block_manager
        if bm.blocks_needed(n) > bm.num_blocks:
            raise ValueError(f"prompt of {n} tokens needs {bm.blocks_needed(n)} KV blocks of {bm.block_size} "
                             f"tokens; the cache holds {bm.num_blocks}")
        self._arrival[seq.seq_id] = self._next_arrival
        self._next_arrival += 1
        self.waiting.append(seq)

    # ---- one step
    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences and token counts, allocating their blocks."""
        batch = ScheduledBatch()
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        spec = self.speculator
        lookahead = spec.plan(self.running, not self.waiting) if spec is not None and self.running else 0
        # a speculative decode computes the tree's tokens (the budget's share); its blocks also
        # cover the draft's scratch slots (the lookahead)
        spec_tokens = spec.n if lookahead else 0
        running, allocate, RUNNING = self.running, bm.allocate, SequenceStatus.RUNNING
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            n = min(uncomputed, budget)
            if n == 0:  # nothing to compute until update() gives it a token
                i += 1
                continue
            ahead = lookahead if (lookahead and n == 1 == uncomputed and budget >= spec_tokens
                                  and spec.speculates(seq)) else 0
            while not allocate(seq, n, lookahead=ahead):
                victim = running.pop()  # the most recently arrived
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not RUNNING:
                break
            self._add_to_batch(batch, seq, n, speculate=ahead > 0)
            budget -= spec_tokens if ahead else n
            i += 1
        # admitting right after a preemption would only thrash; while sequences decode, a
        # group of admissions at once (admit_group) instead of a mixed, eager step for each
        cfg = self.config
        if self.waiting and cfg.admit_group > 1 and batch.decode_only:  # a mixed step admits for free
            free = cfg.max_num_seqs - len(self.running)
            if free < min(cfg.admit_group, len(self.waiting)) and self._held < cfg.admit_max_wait:
                self._held += free > 0  # the wait counts steps a place stood empty
                return batch
        self._held = 0
        while (not batch.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            hit = bm.lookup(seq)
            n = min(seq.num_tokens - hit.num_tokens, budget)
            if not bm.allocate(seq, n, hit):
                break  # strictly FCFS: nothing behind it goes first
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._rank)
            self._add_to_batch(batch, seq, n)
            budget -= n
        return batch

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Apply a step's results: advance KV progress, append sampled tokens, check stops.

        sampled[i]: the token seqs[i] sampled, None for those that did not sample; for a
        speculative decode, the list of tokens the step emitted (the accepted draft tokens and
        the target's own: the KV of as many tokens -- the root and the accepted nodes -- is
        then computed). Tokens are appended one at a time under the stop rules, so a stop
        drops what follows it. Sequences finished meanwhile (abort) are skipped. Returns the
        sequences that finished here; their blocks are already freed.
        """
        if len(sampled) != len(batch.seqs):
            raise ValueError(f"sampled has {len(sampled)} entries; allowed: one per scheduled "
                             f"sequence ({len(batch.seqs)})")
        sampling = batch.sampling
        for i, tok in enumerate(sampled):
            if (tok is None) == sampling[i] and not batch.seqs[i].is_finished:
                raise ValueError(f"sampled[{i}]={tok!r} is not allowed; allowed: "
                                 f"{'a token id' if batch.sampling[i] else 'None'} "
                                 f"(seqs[{i}] {'samples' if batch.sampling[i] else 'does not sample'})")
        finished: list[Sequence] = []
        commit = self.block_manager.commit
        finished_status = SequenceStatus.FINISHED
        for seq, k, tok in zip(batch.seqs, batch.num_new_tokens, sampled):
            if seq.status is finished_status:
                continue
            if tok is None:
                seq.num_computed_tokens += k
                commit(seq)
                continue
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            toks, computed = (tok, len(tok)) if isinstance(tok, list) else ((tok,), k)
            stop = None
            if computed > 1 and self._cannot_stop(seq, toks):
                seq.token_ids.extend(toks)  # (a speculative step's tokens, one call for them all)
            else:
                for t in toks:
                    seq.append_token(t)
                    stop = self._stop(seq, t)
                    if stop is not None:
                        break
            # the tokens first, then the KV progress: commit hashes the blocks' token ids
            seq.num_computed_tokens = min(seq.num_computed_tokens + computed, len(seq.token_ids))
            commit(seq)
            if stop is not None:
                seq.finish(*stop)
                self._release(seq)
                finished.append(seq)
        if finished:
            done = {s.seq_id for s in finished}
            self.running = [s for s in self.running if s.seq_id not in done]
        return finished

    # ---- finishing from outside
    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End a sequence from outside (e.g. a stop string): frees its blocks at once.
        A sequence that already finished is left as it is."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish(reason, stop_reason)
        self._release(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every waiting or running sequence of the request with ABORT; returns them."""
        seqs = [s for s in (*self.running, *self.waiting) if s.request_id == request_id]
        for seq in seqs:
            self.finish(seq, FinishReason.ABORT)
        return seqs

    # ---- internals
    def _rank(self, seq: Sequence) -> int:
        return self._arrival[seq.seq_id]

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, n: int, speculate: bool = False) -> None:
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        batch.sampling.append(seq.num_computed_tokens + n == len(seq.token_ids))
        batch.speculate.append(speculate)

    def _preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV and queue it again, before every later arrival."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        rank = self._rank(seq)
        pos = 0
        while pos < len(self.waiting) and self._rank(self.waiting[pos]) < rank:
            pos += 1
        self.waiting.insert(pos, seq)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._arrival.pop(seq.seq_id, None)

    def _cannot_stop(self, seq: Sequence, toks) -> bool:
        """Whether no token of toks, appended in order, can end the sequence (``_stop`` would return
        None for each): none of them is an EOS (unless ignored) or a stop token id, and after the
        last one the sequence is still short of max_tokens and of the longest sequence. A cheaper
        test than ``_stop`` per token, that decides most speculative steps' tokens at once."""
        p = seq.params
        end = len(seq.token_ids) + len(toks)
        return ((p.max_tokens is None or end - seq.num_prompt_tokens < p.max_tokens) and end < self.max_seq_len
                and (p.ignore_eos or self.eos_token_ids.isdisjoint(toks))
                and (not p.stop_token_ids or not any(t in p.stop_token_ids for t in toks)))

    def _stop(self, seq: Sequence, tok: int) -> tuple[FinishReason, int | None] | None:
        """Why the sequence ends after sampling `tok`, or None.

        EOS and stop_token_ids count only once min_tokens outputs came before this one.
        """
        p = seq.params
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output > p.min_tokens:
            if tok in self.eos_token_ids and not p.ignore_eos:
                return FinishReason.STOP, None
            if tok in p.stop_token_ids:
                return FinishReason.STOP, tok
        if p.max_tokens is not None and num_output >= p.max_tokens:
            return FinishReason.LENGTH, None
        if num_tokens >= self.max_seq_len:
            return FinishReason.LENGTH, None
        return None
