"""BlockManager: KV cache blocks with reference counts and a prefix cache by chained block hashes.

The KV cache is `num_blocks` blocks of `block_size` token slots, ids 0..num_blocks-1. A
sequence's `block_table` maps its token j to block `block_table[j // block_size]`.

Prefix cache: the hash of a sequence's full block i is `block_hash(hash of block i-1, its
token ids)` (block 0 chains from ROOT_HASH), so equal hashes mean equal prefixes up to
hash collisions, which are ruled out by comparing the stored token ids on every hit. A
full block whose KV has been computed is registered (`commit`); when its last user frees
it, it stays findable in the free pool until it is evicted, least recently freed first, and
only when a fresh block is needed and no never-cached free block is left.

Plain Python: no torch. One call sequence per step and sequence:
`lookup` (first admission only) -> `can_allocate` / `allocate` -> the step runs ->
`commit`; `free` on finish, abort or preemption; `truncate` after rejected draft tokens.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .sequence import Sequence

ROOT_HASH = 0x6F70746C6C6D  # parent hash of every sequence's block 0


def block_hash(parent: int, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block: chains its parent block's hash with its token ids."""
    return hash((parent, token_ids))


@dataclass(frozen=True)
class PrefixHit:
    """What `lookup` found: the cached blocks that start a sequence and the tokens they hold.

    num_queried: tokens the lookup looked at (0 when it was skipped), for the hit-rate metric.
    """

    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    num_queried: int = 0


@dataclass
class _SeqHashes:
    """Per-sequence chain of full-block hashes, extended as tokens arrive (never recomputed)."""

    hashes: list[int] = field(default_factory=list)
    num_committed: int = 0  # blocks of the block table already registered (or found taken)


class BlockManager:
    """Reference-counted KV blocks of `block_size` tokens each, with an optional prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} is not allowed; allowed: an integer >= 1")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} is not allowed; allowed: an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks  # set iff registered in _by_hash
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest freed first
        self._seqs: dict[int, _SeqHashes] = {}
        self.num_queried_tokens = 0  # tokens looked up at admissions
        self.num_hit_tokens = 0  # of those, tokens found in the cache

    # ---- counts and metrics
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (never-cached plus evictable cached ones)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or free."""
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        """Share of blocks held by sequences, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit tokens / queried tokens over all admissions so far (0.0 before any)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` token slots."""
        return -(-num_tokens // self.block_size)

    # ---- prefix cache
    def lookup(self, seq: Sequence) -> PrefixHit:
        """Longest run of cached full blocks that starts `seq`; changes nothing.

        Never counts the block holding the sequence's last token (its logits must be
        computed), so at most (num_tokens - 1) // block_size blocks. Skipped (empty hit) when
        caching is off, the sequence already holds blocks or KV, or it asks for prompt
        log-probs that no hit can leave room for (see below).
        """
        if not self.enable_prefix_caching or seq.block_table or seq.num_computed_tokens:
            return PrefixHit()
        bs = self.block_size
        max_hits = (seq.num_tokens - 1) // bs
        if seq.params.prompt_logprobs is not None:
            # The log-prob of prompt token t is read off the logits at position t - 1, and
            # only positions this request computes have logits. With p = seq.next_prompt_logprob
            # (the first prompt token not scored yet: max(prompt_logprobs_start, 1) at the first
            # admission, the prompt length once all are scored), a hit of h tokens is allowed
            # iff h <= p - 1, i.e. at most (p - 1) // block_size full blocks, when p < the
            # prompt length; with every prompt token scored (or none wanted) only the rule
            # above holds. So prompt_logprobs_start 0 or 1 allows no hit, and a recompute after
            # a preemption may reuse the prompt once its log-probs are out.
            if seq.next_prompt_logprob < seq.num_prompt_tokens:
                max_hits = min(max_hits, (seq.next_prompt_logprob - 1) // bs)
            if max_hits == 0:
                return PrefixHit()  # skipped, and left out of the hit-rate statistics
        hashes = self._chain(seq, max_hits)
        blocks: list[int] = []
        for i in range(max_hits):
            b = self._by_hash.get(hashes[i])
            if b is None or self._tokens[b] != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            blocks.append(b)
        return PrefixHit(tuple(blocks), len(blocks) * bs, seq.num_tokens)

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's full blocks whose KV is computed (after a step ran).

        The first block registered under a hash keeps it; an equal block computed again
        elsewhere stays unregistered and returns to the never-cached pool when freed.
        """
        if not self.enable_prefix_caching:
            return
        state = self._seqs.get(seq.seq_id)
        if state is None or seq.num_computed_tokens < (state.num_committed + 1) * self.block_size:
            return  # (no block past the committed ones is full of computed tokens)
        num_full = min(seq.num_computed_tokens, len(seq.token_ids), len(seq.block_table) * self.block_size)
        num_full //= self.block_size
        if num_full <= state.num_committed:
            return
        hashes = self._chain(seq, num_full)
        bs = self.block_size
        for i in range(state.num_committed, num_full):
            b = seq.block_table[i]
            if self._hash[b] is None and hashes[i] not in self._by_hash:
                self._by_hash[hashes[i]] = b
                self._hash[b] = hashes[i]
                self._tokens[b] = tuple(seq.token_ids[i * bs:(i + 1) * bs])
        state.num_committed = num_full

    # ---- allocation
    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None,
                     lookahead: int = 0) -> bool:
        """True when `allocate` with the same arguments would succeed."""
        return self._num_to_take(seq, num_new_tokens, hit, lookahead) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None,
                 lookahead: int = 0) -> bool:
        """Give `seq` blocks for its slots up to num_computed_tokens + num_new_tokens + lookahead.

        hit: the `lookup` result at a first admission (from this same scheduling pass); its
        blocks become the sequence's first blocks and num_computed_tokens / num_cached_tokens
        are set to the tokens they hold, so num_new_tokens counts tokens after the hit.
        Returns False and changes nothing when the free blocks (reviving a freed cached block
        counts as taking one) do not suffice.
        """
        if hit is None and type(num_new_tokens) is int and type(lookahead) is int \
                and num_new_tokens >= 0 and lookahead >= 0 and seq.seq_id in self._seqs:
            # a running sequence whose blocks already cover the slots (most decode steps): nothing
            # to take, and no check past the one that the tokens exist
            end = seq.num_computed_tokens + num_new_tokens
            if end <= len(seq.token_ids) and -(-(end + lookahead) // self.block_size) <= len(seq.block_table):
                return True
        if self._num_to_take(seq, num_new_tokens, hit, lookahead) > self.num_free_blocks:
            return False
        state = self._seqs.setdefault(seq.seq_id, _SeqHashes())
        if hit is not None and hit.num_queried:
            for b in hit.blocks:
                if self._ref[b] == 0:
                    del self._free_cached[b]
                self._ref[b] += 1
            seq.block_table.extend(hit.blocks)
            seq.num_computed_tokens = seq.num_cached_tokens = hit.num_tokens
            state.num_committed = len(hit.blocks)
            self.num_queried_tokens += hit.num_queried
            self.num_hit_tokens += hit.num_tokens
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens + lookahead)
        for _ in range(need - len(seq.block_table)):
            seq.block_table.append(self._take_fresh())
        return True

    def free(self, seq: Sequence) -> None:
        """Release all the sequence's blocks (finish, abort, preemption); leaves its counters.

        Blocks are released last first, so a sequence's tail is evicted before its prefix.
        """
        for b in reversed(seq.block_table):
            self._release(b)
        seq.block_table.clear()
        seq.block_table_epoch += 1
        self._seqs.pop(seq.seq_id, None)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink the sequence's KV to its first `num_tokens` tokens (rejected draft tokens).

        Call it before cutting seq.token_ids to num_tokens and setting num_computed_tokens =
        min(num_computed_tokens, num_tokens). Blocks past the last needed one are released
        (registered ones stay findable: their KV still matches their hash); a registered
        block that becomes partial is unregistered, since new tokens will overwrite its slots.
        Raises ValueError when that partial block is shared with other sequences.
        """
        if not isinstance(num_tokens, int) or not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"num_tokens={num_tokens!r} is not allowed; allowed: an integer in "
                             f"0..{seq.num_tokens} (the sequence's tokens)")
        keep = self.blocks_needed(num_tokens)
        partial = num_tokens // self.block_size if num_tokens % self.block_size else None
        if partial is not None and partial < len(seq.block_table) and self._ref[seq.block_table[partial]] > 1:
            raise ValueError(f"num_tokens={num_tokens} cuts into block {seq.block_table[partial]}, "
                             f"which {self._ref[seq.block_table[partial]]} sequences share; allowed: a "
                             "length that leaves shared blocks whole")
        if len(seq.block_table) > keep:
            seq.block_table_epoch += 1
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        if partial is not None and partial < len(seq.block_table):
            self._unregister(seq.block_table[partial])
        state = self._seqs.get(seq.seq_id)
        if state is not None:
            num_full = num_tokens // self.block_size
            del state.hashes[num_full:]
            state.num_committed = min(state.num_committed, num_full)

    # ---- internals
    def _num_to_take(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None, lookahead: int) -> int:
        """Free blocks an allocation would take: fresh ones plus freed cached ones it revives."""
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens!r} is not allowed; allowed: an integer >= 0")
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"lookahead={lookahead!r} is not allowed; allowed: an integer >= 0")
        computed, have, revived = seq.num_computed_tokens, len(seq.block_table), 0
        if hit is not None and hit.num_queried:
            if seq.block_table or seq.num_computed_tokens:
                raise ValueError(f"hit is not allowed for {seq!r}; allowed: only at a first admission "
                                 "(no blocks, no computed tokens)")
            computed, have = hit.num_tokens, len(hit.blocks)
            revived = sum(1 for b in hit.blocks if self._ref[b] == 0)
        if computed + num_new_tokens > seq.num_tokens:
            raise ValueError(f"num_new_tokens={num_new_tokens} is not allowed for {seq!r}; allowed: "
                             f"at most {seq.num_tokens - computed} (uncomputed tokens; use lookahead "
                             "for extra slots)")
        return max(0, self.blocks_needed(computed + num_new_tokens + lookahead) - have) + revived

    def _chain(self, seq: Sequence, num_full: int) -> list[int]:
        """The sequence's full-block hashes, extended to at least `num_full` blocks."""
        state = self._seqs.setdefault(seq.seq_id, _SeqHashes())
        hashes, bs = state.hashes, self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i else ROOT_HASH
            hashes.append(block_hash(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return hashes

    def _take_fresh(self) -> int:
        if self._free_uncached:
            b = self._free_uncached.popleft()
        else:  # evict the least recently freed cached block
            b, _ = self._free_cached.popitem(last=False)
            self._unregister(b)
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            if self._hash[b] is not None:
                self._free_cached[b] = None
            else:
                self._free_uncached.append(b)

    def _unregister(self, b: int) -> None:
        h = self._hash[b]
        if h is not None:
            del self._by_hash[h]
            self._hash[b] = self._tokens[b] = None
