"""Perplexity of a causal LM on one long token stream, in fixed windows.

Windows (T tokens, seq_len s, stride r <= s): window w covers tokens [w*r, w*r + s), for
every w with w*r + s <= T (a tail shorter than that is not used). Window 0 scores its
tokens 1..s-1; every later window scores only its last min(r, s-1) tokens, so each one
has at least s - r tokens of context. With r = s (the default) the windows do not overlap
and the first token of each window is not scored; with r < s every token from 1 to the
end of the last window is scored exactly once (the standard sliding-window method).

The stream, windows and scored positions depend only on (tokens, seq_len, stride,
max_windows): every checkpoint compared with the same tokenizer sees the same tokens.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..hub.corpus import eval_text

_LOSS_CHUNK_ELEMENTS = 1 << 25  # rows * vocab per float32 log-softmax chunk: 128 MiB


@dataclass(frozen=True)
class PerplexityResult:
    """ppl = exp(nll_mean); nll_mean in nats per scored token."""

    ppl: float
    nll_mean: float
    num_tokens: int  # scored tokens
    num_windows: int
    seq_len: int
    stride: int


def perplexity(
    model,
    input_ids: torch.Tensor,
    seq_len: int = 512,
    stride: int | None = None,
    batch_size: int = 4,
    max_windows: int | None = None,
    progress: bool = False,
) -> PerplexityResult:
    """Perplexity of ``model`` on ``input_ids`` (LongTensor [T], one stream).

    model: an ``optllm.LLM`` (the serving runtime: what is measured is what is served;
    every window is one request whose prompt log-probs -- float32 log-softmax of the
    runtime's logits -- are scored, the engine batching them), or any HF-style causal LM,
    ``model(input_ids=[B, s]).logits`` -> [B, s, V], run ``batch_size`` windows at a time
    under ``torch.inference_mode`` with the loss in float32 in row chunks. Sums are
    accumulated in float64. stride: see the module docstring (None = s). max_windows: use
    only the first windows. progress: show a tqdm bar.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
        raise UserError("input_ids must be a 1-D LongTensor (one token stream)")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise UserError(f"seq_len must be an integer >= 2; got {seq_len!r}")
    stride = seq_len if stride is None else stride
    if not isinstance(stride, int) or not 1 <= stride <= seq_len:
        raise UserError(f"stride must be an integer in [1, seq_len={seq_len}]; got {stride!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be an integer >= 1; got {batch_size!r}")
    if max_windows is not None and (not isinstance(max_windows, int) or max_windows < 1):
        raise UserError(f"max_windows must be None or an integer >= 1; got {max_windows!r}")
    total = input_ids.numel()
    if total < seq_len:
        raise UserError(f"the token stream has {total} tokens, fewer than seq_len={seq_len}")

    starts = window_starts(total, seq_len, stride, max_windows)
    if hasattr(model, "engine"):
        nll, count = _runtime_nll(model, input_ids, starts, seq_len, stride, progress)
        return PerplexityResult(math.exp(nll / count), nll / count, count, len(starts), seq_len, stride)
    device = _model_device(model)
    ids = input_ids.to(torch.int64)
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)  # one host sync, at the end
    count = 0
    extra = _forward_kwargs(model)
    bar = _progress_bar(len(starts), progress)
    with torch.inference_mode():
        for b in range(0, len(starts), batch_size):
            chunk = starts[b : b + batch_size]
            batch = torch.stack([ids[s : s + seq_len] for s in chunk]).to(device)
            logits = model(input_ids=batch, **extra).logits
            for row, start in enumerate(chunk):
                first = scored_from(start, seq_len, stride)
                # logits at position p predict token p + 1
                nll_sum = nll_sum + _nll_sum(logits[row, first - 1 : seq_len - 1], batch[row, first:seq_len])
                count += seq_len - first
            del logits
            if bar is not None:
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    nll_mean = float(nll_sum) / count
    return PerplexityResult(
        ppl=math.exp(nll_mean),
        nll_mean=nll_mean,
        num_tokens=count,
        num_windows=len(starts),
        seq_len=seq_len,
        stride=stride,
    )


def _runtime_nll(llm, input_ids, starts, seq_len, stride, progress) -> tuple[float, int]:
    """(sum of -log p over the scored tokens, their count) with the runtime's prompt log-probs."""
    from ..runtime.sampling_params import SamplingParams

    ids = input_ids.tolist()
    windows = [ids[s:s + seq_len] for s in starts]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate(windows, params, use_tqdm=progress)
    nll, count = 0.0, 0
    for start, window, out in zip(starts, windows, outs):
        lps = out.prompt_logprobs
        for p in range(scored_from(start, seq_len, stride), seq_len):
            nll -= lps[p][window[p]]
            count += 1
    return nll, count


def window_starts(total: int, seq_len: int, stride: int, max_windows: int | None = None) -> list[int]:
    """Start offsets of the full windows of a stream of ``total`` tokens."""
    starts = list(range(0, total - seq_len + 1, stride))
    return starts if max_windows is None else starts[:max_windows]


def scored_from(start: int, seq_len: int, stride: int) -> int:
    """First scored position inside the window starting at ``start`` (scores [first, seq_len))."""
    return 1 if start == 0 else max(1, seq_len - stride)


def eval_token_stream(tokenizer, kind: str = "docs") -> torch.Tensor:
    """The held-out split of one built-in text kind (hub/corpus.eval_text(kind)) as LongTensor [T].

    Tokenized as one text with no special tokens added (no BOS, no EOS): documents are
    separated by the blank lines of the text, so the stream is the same whatever the
    tokenizer's special-token settings. (Special-token markers written in the text itself,
    like the chat kind's template markers, are read as the tokens they are.)
    """
    return token_stream(tokenizer, eval_text(kind))


def read_text_file(path: str | Path) -> str:
    """A user's text file (``--text FILE``), read as UTF-8; UserError (one line) when it is
    missing, not UTF-8 or empty."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"--text file {str(path)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--text file {str(path)!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if not text.strip():
        raise UserError(f"--text file {str(path)!r} is empty")
    return text


def text_token_stream(tokenizer, path: str | Path) -> torch.Tensor:
    """A user's UTF-8 text file (``--text FILE``) as LongTensor [T], no special tokens added."""
    return token_stream(tokenizer, read_text_file(path))


def token_stream(tokenizer, text: str) -> torch.Tensor:
    """``text`` as one LongTensor [T] of token ids, no special tokens added."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over rows of -log softmax(logits)[target] (float64 scalar); logits [n, V], targets [n]."""
    rows = max(1, _LOSS_CHUNK_ELEMENTS // logits.shape[-1])
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for i in range(0, logits.shape[0], rows):
        x = logits[i : i + rows].float()
        t = targets[i : i + rows]
        nll = torch.logsumexp(x, dim=-1) - x.gather(-1, t[:, None]).squeeze(-1)
        total += nll.sum(dtype=torch.float64)
    return total


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def _forward_kwargs(model) -> dict:
    """use_cache=False where the forward takes it: a KV cache is wasted memory here."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="perplexity", unit="window")
