"""LLM: the offline Python API over the engine.

    from optllm import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """model: HF folder, built-in alias or optllm checkpoint; keyword arguments are
    EngineConfig's (device, dtype, max_model_len, max_num_seqs, kv_cache_dtype, ...)."""

    def __init__(self, model: str, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion (continuously batched); outputs in prompt order.
        A single prompt may be a string or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp or SamplingParams(), stream=False) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        bar = _bar(len(ids)) if use_tqdm else None
        try:
            # one inference_mode for the loop: the step's entry points then only check it (runtime/inference.py)
            with torch.inference_mode():
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            if bar is not None:
                                bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            for rid in ids:  # an exception mid-way must not leave requests holding blocks
                if rid not in done:
                    self.engine.abort_request(rid)
        return [done[r] for r in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's cumulative output after every step that moved it (the last
        one has finished=True). Closing the iterator early aborts the request."""
        rid = self.engine.add_request(prompt, sampling_params or SamplingParams())
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(rid)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """messages: one conversation ([{"role": ..., "content": ...}, ...]) or a list of them;
        each is rendered with the model's chat template (generation prompt added)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt(c) for c in convs], sampling_params, use_tqdm)

    def chat_prompt(self, conversation: list[dict]) -> list[int]:
        return render_chat(self.tokenizer, conversation)


def render_chat(tokenizer, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation under the tokenizer's chat template; ValueError when the
    model has no template or the template refuses the conversation."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    try:
        ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    except Exception as e:  # jinja's TemplateError (e.g. roles out of order) and the like
        raise ValueError(f"the chat template refused the conversation: {e}") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
