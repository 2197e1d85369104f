"""Sequence: the state of one completion as the scheduler and block manager see it.

A request with n completions holds n sequences. Every step computes, for each scheduled
sequence, the KV of tokens [num_computed_tokens, num_computed_tokens + k): a prompt chunk,
one token of decode (the last sampled token), or, after a preemption, everything again.
A sequence samples a new token only in a step that brings num_computed_tokens to
num_tokens. Imports nothing of torch: the CPU-side runtime is plain Python.
"""

from __future__ import annotations

import enum
import itertools
import time

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


_ids = itertools.count()


class Sequence:
    """Token ids (prompt + output), KV progress and block table of one completion."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 index: int = 0, arrival_time: float | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: a prompt needs at least one token")
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at the first admission
        self.block_table: list[int] = []
        # bumped whenever blocks leave the table (free, truncate): lets the model runner keep
        # an incrementally updated copy of the table, valid while only appends happen
        self.block_table_epoch = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_preemptions = 0
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        # filled by the model runner when asked for: one entry per output / prompt token. The
        # prompt entries nobody wants (position 0, and those before prompt_logprobs_start) are
        # None from the start; the runner appends the others in order, each once, so a prompt
        # recomputed after a preemption does not add them again
        self.output_logprobs: list = []
        self.prompt_logprobs: list = []
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * min(max(params.prompt_logprobs_start, 1), self.num_prompt_tokens)
        # speculative decoding's (runtime/spec_runner.py): whether the parameters allow it (None: not
        # worked out yet), and (num_preemptions, positions the draft has run over). Declared here,
        # never added later or read through __dict__: reading an instance's __dict__ makes CPython
        # 3.11+ keep its attributes in a real dict for good, and every attribute read of that
        # sequence 2-3x slower (the draft engine's whole host step ran ~30% slower on the CPU)
        self.spec_params_ok: bool | None = None
        self.spec_state: tuple[int, int] | None = None

    # ---- token views
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def next_prompt_logprob(self) -> int:
        """The first prompt position whose log-prob is still to be computed (it needs the logits
        at the position before it); num_prompt_tokens when none is, or none was asked for."""
        if self.params.prompt_logprobs is None:
            return self.num_prompt_tokens
        return len(self.prompt_logprobs)

    @property
    def in_prefill(self) -> bool:
        """True while prompt tokens (or, after a preemption, earlier outputs) are still to compute."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)}, {self.status.value})")
