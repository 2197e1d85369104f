"""LLMEngine: the loop. add_request / abort_request / step, nothing else.

A step: the scheduler picks the batch, the model runner runs it and samples, the scheduler
advances the sequences and applies the token-level stop rules, the detokenizer extends the
texts and finds stop strings, and every request that moved gets a RequestOutput
(cumulative). Not thread-safe: the async engine calls it from one thread.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from ..errors import UserError
from ..hub.loader import load_tokenizer
from .config import EngineConfig
from .detokenizer import Detokenizer, DetokenizerState
from .loader import ModelSource, read_source
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import FinishReason, Sequence


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    states: list[DetokenizerState]
    metrics: RequestMetrics
    stream: bool = True  # an output after every step that moves it (else only the final one)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    prefix_cache_hit_rate: float
    speculation: dict | None = None  # SpecStats.as_dict() when a draft is loaded


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.source: ModelSource = read_source(config.model, config.quantized_linear)
        self.tokenizer = load_tokenizer(self.source.folder)
        self.eos_token_ids = eos_token_ids(self.source.folder, self.tokenizer)
        hf = self.source.config
        limit = getattr(hf, "max_position_embeddings", None) or 4096
        if config.max_model_len is not None and config.max_model_len > limit:
            raise UserError(f"--max-model-len {config.max_model_len} exceeds the model's "
                            f"max_position_embeddings={limit}")
        self.max_model_len = config.max_model_len or limit
        self.runner = ModelRunner(config, self.source, self.max_model_len, self.eos_token_ids)
        spec = self.runner.spec
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), self.runner.num_blocks,
                                   self.eos_token_ids, speculator=spec)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.requests: dict[str, _Request] = {}
        self._touched: dict[str, None] = {}  # requests to report after this step, in order
        self._ids = itertools.count()

    # ---- requests
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, stream: bool = True) -> str:
        """Queue a prompt (text, or token ids); returns its request id. ValueError when the
        prompt is empty, too long for max_model_len, or the id is taken. stream: step() reports
        the request after every step that moves it (cumulative); False: only when it finishes
        (cheaper for batch generation)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len={self.max_model_len} allows at most "
                             f"{self.max_model_len}")
        if any(not 0 <= t < self.runner.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.runner.vocab_size})")
        now = time.monotonic() if arrival_time is None else arrival_time
        seqs = [Sequence(request_id, ids, params, index=i, arrival_time=now) for i in range(params.n)]
        for s in seqs:
            self.scheduler.add(s)
        self.requests[request_id] = _Request(request_id, text, ids, params, seqs,
                                             [self.detokenizer.start(len(ids)) for _ in seqs],
                                             RequestMetrics(now, num_prompt_tokens=len(ids)), stream)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (its blocks are freed at once); returns its final output."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        return self._finish_output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        s = self.scheduler
        spec = self.runner.spec
        return EngineStats(s.num_running, s.num_waiting, s.block_manager.num_free_blocks, self.runner.num_blocks,
                           s.prefix_cache_hit_rate, None if spec is None else spec.stats.as_dict())

    # ---- the loop
    def step(self) -> list[RequestOutput]:
        spec = self.runner.spec
        if spec is None:
            return self._step()
        t0 = time.perf_counter()
        out = self._step()
        # the whole step's time (host included) for the adaptive policy, when it was a pure one that
        # reports (pending_cost: set by the runner; most plain steps of a stretch report nothing)
        if spec.pending_cost is not None:
            spec.observe_step((time.perf_counter() - t0) * 1e3)
        return out

    def _step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return self._collect()
        sampled = self.runner.execute(batch)
        self.scheduler.update(batch, sampled)
        now = time.monotonic()
        items = []
        touched = self._touched
        for seq, tok in zip(batch.seqs, sampled):
            if tok is None:
                continue
            if isinstance(tok, list) and seq.params.logprobs is not None:
                del seq.output_logprobs[seq.num_output_tokens:]  # entries of tokens a stop dropped
            req = self.requests[seq.request_id]
            if req.stream or seq.is_finished:
                touched[req.request_id] = None
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                req.metrics.num_cached_tokens = seq.num_cached_tokens
            if req.params.detokenize:
                items.append((seq, req.states[seq.index]))
        if not items:
            return self._collect()
        multi = {seq.seq_id: len(tok) for seq, tok in zip(batch.seqs, sampled) if isinstance(tok, list)}
        for (seq, st), stop in zip(items, self.detokenizer.update(items)):
            if stop is not None and not seq.is_finished:
                if multi.get(seq.seq_id, 1) > 1:
                    self._cut_at_stop(seq, stop)
                self.scheduler.finish(seq, FinishReason.STOP, stop)
                touched[seq.request_id] = None
        return self._collect()

    def _cut_at_stop(self, seq: Sequence, stop: str) -> None:
        """A speculative step appended several tokens and a stop string ended among them: drop
        the tokens after the one that completed it, as a step-by-step decode would have stopped
        there (the text is cut at the stop string either way)."""
        skip = seq.params.skip_special_tokens
        out = seq.output_token_ids
        for j in range(1, len(out)):
            if stop in self.tokenizer.decode(out[:j], skip_special_tokens=skip):
                del seq.token_ids[seq.num_prompt_tokens + j:]
                del seq.output_logprobs[j:]
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                return

    def _collect(self) -> list[RequestOutput]:
        out = []
        for rid in self._touched:
            req = self.requests.get(rid)
            if req is None:
                continue
            if all(s.is_finished for s in req.seqs):
                out.append(self._finish_output(req))
            elif req.stream:
                out.append(self._output(req, finished=False))
        self._touched.clear()
        return out

    def _finish_output(self, req: _Request) -> RequestOutput:
        req.metrics.finished_time = time.monotonic()
        req.metrics.num_preemptions = sum(s.num_preemptions for s in req.seqs)
        self.requests.pop(req.request_id, None)
        return self._output(req, finished=True)

    def _output(self, req: _Request, finished: bool) -> RequestOutput:
        comps = []
        for seq, st in zip(req.seqs, req.states):
            text = Detokenizer.visible_text(seq, st, seq.is_finished) if req.params.detokenize else ""
            comps.append(CompletionOutput(
                index=seq.index, text=text, token_ids=seq.output_token_ids,
                finish_reason=None if seq.finish_reason is None else seq.finish_reason.value,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.output_logprobs) if req.params.logprobs is not None else None))
        plp = req.seqs[0].prompt_logprobs if req.params.prompt_logprobs is not None else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, comps, finished, plp, req.metrics)


def eos_token_ids(folder, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (an int or a list) and the tokenizer."""
    import json

    ids = set()
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            v = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            v = None
        ids.update(v if isinstance(v, list) else [] if v is None else [v])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
