"""OpenAI response bodies and stream chunks from the engine's cumulative RequestOutputs.

A Tracker follows one request's choices (prompt i, completion j -> choice index i * n + j)
and hands out what is new since the last output: text, token ids and log-probs, so the
streaming and the plain paths share one bookkeeping. Token strings in log-probs are each
token decoded alone, as vLLM returns them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..outputs import RequestOutput


@dataclass
class _Choice:
    text: str = ""
    tokens: int = 0
    logprobs: int = 0
    finish_reason: str | None = None
    last_time: float | None = None


@dataclass
class Delta:
    index: int
    text: str
    text_offset: int  # characters of the choice's text before this delta
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class Tracker:
    """Deltas and usage of one request's choices across its prompts."""

    n: int
    metrics: object = None  # ServerMetrics: inter-token latency and token counts as they arrive
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_tokens: int = 0

    def update(self, prompt_index: int, out: RequestOutput) -> list[Delta]:
        now = time.monotonic()
        if prompt_index * self.n not in self.choices:
            self.prompt_tokens += len(out.prompt_token_ids)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        deltas = []
        for c in out.outputs:
            idx = prompt_index * self.n + c.index
            st = self.choices.setdefault(idx, _Choice())
            new_tokens = c.token_ids[st.tokens:]
            text = c.text[len(st.text):]
            if not new_tokens and not text and c.finish_reason == st.finish_reason:
                continue
            lps = None if c.logprobs is None else c.logprobs[st.logprobs:]
            if self.metrics is not None and new_tokens:
                self.metrics.generation_tokens.inc(len(new_tokens))
                if st.last_time is not None:
                    for _ in new_tokens:
                        self.metrics.itl.observe((now - st.last_time) / len(new_tokens))
                st.last_time = now
            st.text, st.tokens, st.finish_reason = c.text, len(c.token_ids), c.finish_reason
            st.logprobs = st.logprobs if c.logprobs is None else len(c.logprobs)
            deltas.append(Delta(idx, text, len(c.text) - len(text), new_tokens, lps, c.finish_reason))
        if out.finished and self.metrics is not None and out.metrics and out.metrics.first_token_time:
            self.metrics.ttft.observe(out.metrics.first_token_time - out.metrics.arrival_time)
        return deltas

    def usage(self) -> dict:
        completion = sum(c.tokens for c in self.choices.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


def completion_logprobs(tokenizer, token_ids: list[int], lps: list[dict[int, float]] | None,
                        offset: int) -> dict | None:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, lps):
        s = tokenizer.decode([tid])
        tokens.append(s)
        token_lps.append(entry.get(tid))
        tops.append({tokenizer.decode([t]): v for t, v in entry.items() if t != tid or len(entry) == 1})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], lps: list[dict[int, float]] | None, top: int) -> dict | None:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    if lps is None:
        return None

    def item(t: int, v: float) -> dict:
        s = tokenizer.decode([t])
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, entry in zip(token_ids, lps):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, v) for t, v in ranked]})
    return {"content": content}


def completion_chunk(rid: str, created: int, model: str, choices: list[dict], usage: dict | None = None,
                     chat: bool = False) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body
