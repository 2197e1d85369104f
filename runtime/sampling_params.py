"""SamplingParams: how one request is decoded (the fields and defaults of vLLM's and OpenAI's).

Validated on construction: a bad field raises ValueError naming it and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_EPS = 1e-5  # temperature below this is greedy (argmax)


@dataclass
class SamplingParams:
    """Decoding options of one request.

    temperature: 0 = greedy (argmax); otherwise logits / temperature before sampling.
    top_k: keep the k most likely tokens (0 or -1: off). top_p: keep the smallest set whose
    probability reaches p (1.0: off). min_p: drop tokens with probability below
    min_p * the top probability (0: off). Order (as vLLM): penalties, temperature, min_p,
    top_k, top_p, then sampling.
    repetition_penalty (HF/CTRL): logits of tokens seen in prompt or output are divided by
    it when positive, multiplied when negative (1.0: off). presence_penalty /
    frequency_penalty (OpenAI): subtracted once per seen output token / per occurrence.
    seed: per-request seed; the same seed gives the same tokens whatever the batch, and
    after a preemption (the noise of output token i depends on (seed, i) only; each of the
    n completions has its own stream, the first that of n = 1).
    max_tokens: output tokens at most (None: up to the model's context). min_tokens: EOS
    and stop token ids are suppressed until this many are out.
    stop: strings that end the output (not included unless include_stop_str_in_output);
    stop_token_ids: extra token ids that end it (included in token_ids, not in text).
    ignore_eos: keep going past EOS.
    logprobs: return, per output token, its log-probability and those of the top
    `logprobs` tokens (0: only the sampled one's); prompt_logprobs likewise per prompt
    token (from the second on). Log-probabilities are those of the model's raw
    distribution (before penalties, temperature and truncation).
    prompt_logprobs_start: the first prompt position whose log-prob is wanted (e.g. where
    the continuation an eval scores begins); prompt_logprobs keeps one entry per prompt
    token, None before this position (as for position 0), so indices still match the
    prompt. Lets the prefix cache serve the KV of the prompt blocks before it, so requests
    that share a long context compute it once (0: every position, no prefix-cache use; a
    value past the prompt: all None). Ignored without prompt_logprobs.
    n: completions per request.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s] or None
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(_num(self.temperature) and self.temperature >= 0, "temperature", self.temperature, "a number >= 0")
        _check(_num(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "an integer >= 0, or -1 (off)")
        _check(_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        _check(_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               self.repetition_penalty, "a number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_num(v) and -2 <= v <= 2, name, v, "a number in [-2, 2]")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "an integer or None")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an integer >= 1 or None")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        _check(all(isinstance(s, str) for s in self.stop or []), "stop", self.stop, "a string or a list of strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "a list of token ids >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and 0 <= v <= 20), name, v, "None or an integer in 0..20")
        v = self.prompt_logprobs_start
        _check(isinstance(v, int) and not isinstance(v, bool) and v >= 0, "prompt_logprobs_start", v,
               "an integer >= 0 (a prompt position)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def temperature_only(self, vocab_size: int) -> bool:
        """Whether a temperature alone gives the distribution these params ask for (no top_p,
        top_k, min_p or penalties): the rows the graphs' own sampling serves (a sampled
        speculative step graph's, and the decode and extend graphs' with no seed or logprobs)."""
        return (self.top_p >= 1.0 and (self.top_k <= 0 or self.top_k >= vocab_size) and self.min_p <= 0.0
                and not self.uses_penalties)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN


def _check(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: {allowed}")
