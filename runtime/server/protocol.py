"""The OpenAI request bodies the server accepts, and their translation to SamplingParams.

Field names, defaults and meanings are OpenAI's (completions: max_tokens 16; chat: no limit
but the context), plus vLLM's usual extensions (top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, ignore_eos, skip_special_tokens, include_stop_str_in_output). Unknown fields
are ignored, as vLLM and OpenAI do. Features we do not serve (suffix, echo, logit_bias,
tools, best_of > n) are refused with a 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import SamplingParams


class APIError(Exception):
    """An error a client caused: becomes {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # vLLM extensions
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        kw: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, logprobs=logprobs, stop=self.stop, seed=self.seed,
            min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output)
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            v = getattr(self, name)
            kw[name] = default if v is None else v
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            msg = str(e)
            raise APIError(400, msg, msg.split("=", 1)[0] if "=" in msg.split(" ", 1)[0] else None) from None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_params(self) -> SamplingParams:
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.echo:
            raise APIError(400, "echo is not supported", "echo")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        return self.sampling_params(self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Optional[Union[str, list[dict]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"content part of type {part.get('type')!r} is not supported; allowed: text",
                               "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def to_params(self) -> SamplingParams:
        if self.tools and self.tool_choice != "none":
            raise APIError(400, "tools are not supported", "tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(limit, (self.top_logprobs or 0) if self.logprobs else None)


Kind = Literal["completion", "chat"]
