"""lm-eval's model interface over the serving runtime: ``lm_eval.simple_evaluate(model="optllm", ...)``.

    import lm_eval
    from optllm.eval.lm_eval_model import OptllmLM
    from optllm.eval.tasks import task_manager

    lm = OptllmLM("smollm2-135m", dtype="bfloat16")  # or OptllmLM(an_existing_optllm_LLM)
    out = lm_eval.simple_evaluate(lm, tasks=["optllm_mc", "optllm_gen"], task_manager=task_manager())

Importing this module registers the class with lm-eval under the name "optllm", so the
harness's own entry points take ``model="optllm", model_args="pretrained=DIR,dtype=float32"``.

What is scored is what the runtime serves: every log-likelihood is the float32 log-softmax
of the runtime's logits (its prompt log-probs), every generation a runtime request.
Tokenization follows lm-eval's HF model (``HFLM``) so numbers compare with it: a
(context, continuation) pair is encoded whole and split at the context's length; an empty
context is the prefix token (BOS, else EOS); rolling windows are lm-eval's own, of
``max_length`` tokens; generation truncates the context on the left to leave room for
``max_gen_toks`` and cuts the text at the first ``until`` string (EOS included).

Batching: every request of a call goes to the engine in ``LLM.generate`` calls (chunks of
``batch_size``), which batch them continuously; identical token sequences are sent once.
Each request asks for the log-probs of its continuation only (``prompt_logprobs_start``), so
the prefix cache may serve its context: requests are sent in two waves, one request per
distinct context first, then the others, whose shared context (whole KV blocks of it) is
then cached -- a multiple-choice task computes each question's context once, not once per
choice.
"""

from __future__ import annotations

import logging

import lm_eval.models  # noqa: F401  (registers lm-eval's own models first: its registry loads them only when empty)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text

from ..runtime.llm import LLM
from ..runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF default
# generation keywords of lm-eval tasks that are SamplingParams fields of the same meaning
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "min_tokens")
# keywords that only steer HF's generate() and mean nothing (or nothing new) here
_IGNORED_FIELDS = ("do_sample", "until", "max_gen_toks", "num_beams", "use_cache", "pad_token_id")


@register_model("optllm")
class OptllmLM(TemplateLM):
    """An lm-eval model backed by ``optllm.LLM``.

    pretrained: a model (HF folder, built-in alias, optllm checkpoint) or an ``optllm.LLM``
    already built (then device, dtype, max_model_len and engine_args must not be given).
    batch_size: requests handed to the engine per ``LLM.generate`` call ("auto" or None: all
    of a call's requests at once; the engine batches them itself, up to its max_num_seqs).
    max_length: tokens of context a scored token may see (None: the engine's max_model_len
    - 1, since the runtime scores prompt positions 1.. of a prompt of at most max_model_len).
    max_gen_toks: default output tokens of generate_until (a task's max_gen_toks wins).
    add_bos_token / prefix_token_id: as HFLM's (None: the tokenizer's default / BOS, else EOS).
    max_batch_size: accepted for lm-eval's CLI, unused (the engine sizes its own batches).
    """

    def __init__(self, pretrained: str | LLM, device: str | None = None, dtype: str | None = None,
                 max_model_len: int | None = None, batch_size: int | str | None = None,
                 max_batch_size: int | None = None, max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, **engine_args) -> None:
        super().__init__()
        if isinstance(pretrained, LLM):
            given = {k: v for k, v in dict(device=device, dtype=dtype, max_model_len=max_model_len,
                                           **engine_args).items() if v is not None}
            if given:
                raise ValueError(f"{', '.join(sorted(given))}: not allowed with an LLM already built "
                                 "(they are the engine's; build the LLM with them)")
            self.llm = pretrained
        else:
            args = {k: v for k, v in dict(device=device, dtype=dtype, max_model_len=max_model_len).items()
                    if v is not None}
            self.llm = LLM(str(pretrained), **args, **engine_args)
        self.tokenizer = self.llm.tokenizer
        self._batch_size = _parse_batch_size(batch_size)
        limit = self.llm.engine.max_model_len - 1
        if max_length is not None and (not isinstance(max_length, int) or not 1 <= max_length <= limit):
            raise ValueError(f"max_length={max_length!r} is not allowed; allowed: an integer in [1, {limit}] "
                             f"(the engine's max_model_len - 1)")
        self._max_length = max_length or limit
        if not isinstance(max_gen_toks, int) or max_gen_toks < 1:
            raise ValueError(f"max_gen_toks={max_gen_toks!r} is not allowed; allowed: an integer >= 1")
        self._max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self._device = self.llm.engine.runner.device

    # ---- what lm-eval asks of a model
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "optllm")).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """HFLM's encoding: the tokenizer's default special tokens unless told (or add_bos_token
        says), none when the text already starts with the prefix token's text."""
        special = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        return self.tokenizer.encode(string, **special)

    # ---- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: (cache key or None, context ids, continuation ids); returns, per request,
        (sum of the continuation's log-probs in nats, whether every continuation token is the
        argmax). Contexts longer than max_length are cut on the left."""
        windows, spans = [], []  # per request: the tokens sent, how many of its last ones are scored
        for _key, ctx, cont in requests:
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
            windows.append(whole)
            spans.append(min(len(cont), len(whole) - 1))
        scores = self._prompt_logprobs([(w, len(w) - n) for w, n in zip(windows, spans) if n > 0], disable_tqdm)
        res = []
        for (key, _ctx, _cont), whole, n in zip(requests, windows, spans):
            total, greedy = 0.0, True
            if n > 0:
                entries = scores[tuple(whole)]
                for p in range(len(whole) - n, len(whole)):
                    entry = entries[p]
                    lp = entry[whole[p]]
                    total += lp
                    greedy = greedy and lp >= max(entry.values())  # the top-1 is in the entry
            answer = (total, greedy)
            res.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return res

    def _prompt_logprobs(self, prompts: list[tuple[list[int], int]], disable_tqdm: bool) -> dict[tuple, list]:
        """Prompt log-probs (with the top-1 token) of each distinct prompt, by its token tuple,
        from the position each asks for on (prompts: (ids, first scored position); a prompt
        asked for twice is scored from the earlier position)."""
        start: dict[tuple, int] = {}
        for ids, first in prompts:
            key = tuple(ids)
            start[key] = min(first, start.get(key, first))
        # wave 1: the first prompt of each context (the tokens before its scored span); wave 2:
        # the rest, whose contexts are in the prefix cache by then
        seen: set[tuple] = set()
        waves: tuple[list, list] = ([], [])
        for key, first in start.items():
            ctx = key[:first]
            waves[ctx in seen].append(key)
            seen.add(ctx)
        out: dict[tuple, list] = {}
        for wave in waves:
            for chunk in _chunks(wave, self._batch_size):
                params = [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False,
                                         prompt_logprobs_start=start[k]) for k in chunk]
                outs = self.llm.generate([list(k) for k in chunk], params, use_tqdm=not disable_tqdm)
                for key, r in zip(chunk, outs):
                    out[key] = r.prompt_logprobs
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text (nats), in lm-eval's disjoint rolling windows of
        max_length tokens, the first conditioned on the prefix token."""
        windows, owner = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _greedy) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += lp
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    # ---- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continuations of each context up to its first ``until`` string (not included) or
        EOS, at most max_gen_toks tokens; greedy unless the request asks to sample."""
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, untils = [], [], []
        for context, gen_kwargs in (r.args for r in requests):
            sp, until = to_sampling_params(gen_kwargs, eos, self.max_gen_toks)
            if sp.max_tokens >= self.max_length:
                raise ValueError(f"max_gen_toks={sp.max_tokens} leaves no room for a context in "
                                 f"max_length={self.max_length}")
            ids = self.tok_encode(context)[-(self.max_length - sp.max_tokens):] if context else []
            prompts.append(ids or [self.prefix_token_id])  # the engine needs one prompt token
            params.append(sp)
            untils.append(until)
        texts = []
        for chunk in _chunks(list(zip(prompts, params)), self._batch_size):
            ps, sps = zip(*chunk)
            texts += [o.outputs[0].text for o in self.llm.generate(list(ps), list(sps), use_tqdm=not disable_tqdm)]
        res = []
        for r, text, until in zip(requests, texts, untils):
            text = postprocess_generated_text(text, until, None)  # the engine cut at the first; any other
            res.append(text)
            self.cache_hook.add_partial("generate_until", r.args, text)
        return res

    def get_model_info(self) -> dict:
        cfg = self.llm.engine.config
        return {"model": cfg.model, "dtype": cfg.dtype, "max_model_len": self.llm.engine.max_model_len}


def to_sampling_params(gen_kwargs: dict, eos: str | None, default_max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
                    ) -> tuple[SamplingParams, list[str]]:
    """(SamplingParams, stop strings) of one lm-eval generation request.

    gen_kwargs: a task's generation_kwargs (until, max_gen_toks or its aliases, do_sample,
    temperature, top_p, top_k, ...). Greedy unless do_sample is true (or a temperature > 0 is
    given without do_sample); do_sample without a temperature samples at 1.0. eos: its text
    is added to the stop strings, as lm-eval's HF model does. Keywords that are neither
    SamplingParams fields nor known HF-only ones are logged and ignored.
    """
    if not isinstance(gen_kwargs, dict):
        raise ValueError(f"generation kwargs must be a dict, got {type(gen_kwargs).__name__}")
    kw = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks)
    until = handle_stop_sequences(kw.get("until"), eos=eos or None)
    do_sample = bool(kw.get("do_sample"))
    fields = {k: kw[k] for k in _SAMPLING_FIELDS if kw.get(k) is not None}
    fields["temperature"] = float(kw.get("temperature", 1.0)) if do_sample else 0.0
    unknown = sorted(set(kw) - set(_SAMPLING_FIELDS) - set(_IGNORED_FIELDS))
    if unknown:
        log.warning("generation kwargs %s are not runtime sampling options; ignored", ", ".join(unknown))
    return SamplingParams(max_tokens=int(kw["max_gen_toks"]), stop=list(until), **fields), until


def _parse_batch_size(batch_size) -> int | None:
    if batch_size is None or (isinstance(batch_size, str) and batch_size.startswith("auto")):
        return None
    try:
        n = int(batch_size)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise ValueError(f"batch_size={batch_size!r} is not allowed; allowed: an integer >= 1, 'auto' or None")
    return n


def _chunks(items: list, size: int | None):
    size = size or max(1, len(items))
    for lo in range(0, len(items), size):
        yield items[lo:lo + size]
