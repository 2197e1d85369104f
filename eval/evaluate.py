"""`optllm eval`: measure checkpoints side by side (perplexity now; speed and tasks later).

Every model runs on the serving runtime (optllm.LLM), so a checkpoint's numbers are those
of the model that `optllm serve` would serve. Perplexity is measured per *text kind*: the
held-out split of each built-in kind (hub/corpus.py: docs, code, chat) and any user text.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import UserError
from ..hub.corpus import KINDS, eval_text
from ..runtime.config import EngineConfig
from ..runtime.llm import LLM
from ..runtime.loader import checkpoint_kind
from .perplexity import perplexity, read_text_file, token_stream


@dataclass
class EvalRow:
    """One model's perplexities (and lm-eval task scores and speed, when asked for).

    ppl_by_kind, nll_by_kind (nats per scored token), tokens_by_kind (scored tokens),
    windows_by_kind: one entry per text kind, in the order measured (built-in kinds, then
    user texts). ppl, nll, num_tokens, num_windows: those of the first kind measured (docs,
    by default), what a row meant before there were kinds; seconds: load plus all kinds.
    """

    model: str
    kind: str  # the checkpoint's scheme, or "float" (not a text kind)
    ppl: float
    nll: float
    num_tokens: int
    num_windows: int
    seconds: float
    ppl_by_kind: dict[str, float] = field(default_factory=dict)
    nll_by_kind: dict[str, float] = field(default_factory=dict)
    tokens_by_kind: dict[str, int] = field(default_factory=dict)
    windows_by_kind: dict[str, int] = field(default_factory=dict)
    # lm-eval tasks (eval/harness.py): {task: {metric: value}} and {task: [metric, value]} shown
    tasks: dict[str, dict[str, float]] = field(default_factory=dict)
    task_main: dict[str, list] = field(default_factory=dict)
    # speed (eval/speed.py): one dict per batch size, as measure_speed returns them
    speed: list[dict] = field(default_factory=list)
    # speculation with a draft (eval/speculation.py): one dict per temperature and batch size
    speculation: list[dict] = field(default_factory=list)


def add_results(rows: list[EvalRow], models: Sequence[str], results: Sequence[dict], fields) -> list[EvalRow]:
    """rows (one per model, or [] when no perplexity was measured: then made here, from each
    result's "scheme") with each model's result added: fields(result) -> {EvalRow field:
    value}, and its "seconds" added to the row's."""
    if not rows:
        nan = float("nan")
        rows = [EvalRow(m, r["scheme"], nan, nan, 0, 0, 0.0) for m, r in zip(models, results)]
    for row, r in zip(rows, results):
        for name, value in fields(r).items():
            setattr(row, name, value)
        row.seconds += r["seconds"]
    return rows


def parse_kinds(kinds: str | Sequence[str] | None) -> tuple[str, ...]:
    """Built-in text kinds from a comma-separated string or a sequence (None: all of KINDS);
    UserError naming the allowed kinds on an unknown one."""
    if kinds is None:
        return KINDS
    names = [k.strip() for k in kinds.split(",")] if isinstance(kinds, str) else [str(k).strip() for k in kinds]
    names = list(dict.fromkeys(k for k in names if k))
    bad = [k for k in names if k not in KINDS]
    if bad:
        raise UserError(f"unknown text kind {bad[0]!r}; allowed: {', '.join(KINDS)}")
    return tuple(names)


def read_texts(paths: Sequence[str | Path], taken: Sequence[str] = ()) -> dict[str, str]:
    """{kind name: text} for user text files: a file's kind is named after its stem (its
    full name when the stem is already a kind being measured). UserError (one line) on a
    missing, empty or non-UTF-8 file, or two files of one name."""
    out: dict[str, str] = {}
    for path in paths:
        text = read_text_file(path)
        p = Path(path)
        name = p.stem if p.stem not in (*taken, *out) else p.name
        if name in (*taken, *out):
            raise UserError(f"two texts are named {name!r}; rename one of the --text files")
        out[name] = text
    return out


_EVAL_SEQS = 64  # windows scored at once


def _kv_args(device: str, seq_len: int) -> dict:
    """On a GPU, a KV cache of the blocks the windows need at most, not the engine's default
    share of the GPU's memory: evaluations (the quality sweeps') then run side by side."""
    if not str(device).startswith("cuda"):
        return {}
    return {"num_kv_blocks": EngineConfig.kv_blocks_for(_EVAL_SEQS, seq_len)}


def evaluate_ppl(
    models: list[str],
    kinds: str | Sequence[str] | None = None,
    texts: Mapping[str, str] | None = None,
    seq_len: int = 512,
    max_windows: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    linear: str = "dequant",
    progress: bool = True,
    text: str | Path | None = None,
) -> list[EvalRow]:
    """Perplexity of each model on each text kind, every model on the same token streams
    and windows (seq_len tokens per window, at most max_windows windows per kind).

    kinds: built-in text kinds (see parse_kinds; None = all). texts: more texts to measure,
    {name: text}. text: a user text file measured *instead of* the built-in kinds when
    kinds is None (the argument before kinds existed). linear: "dequant" runs quantized
    weights dequantized (the values vLLM / HF give), "kernel" on the W4A16 kernels (their
    torch reference on CPU)."""
    sources = _sources(kinds, texts, text)
    rows = []
    for name in models:
        t0 = time.perf_counter()
        llm = LLM(name, device=device, dtype=dtype, quantized_linear=linear, max_model_len=seq_len,
                  max_num_seqs=_EVAL_SEQS, enforce_eager=True, **_kv_args(device, seq_len))
        slow = [m for m in llm.engine.runner.linear_methods() if "dequantized" in m]
        if linear == "kernel" and slow:
            q = llm.engine.source.quant
            what = (f"int{q.args.num_bits} group {q.args.group_size or 'channel'}" if llm.engine.source.mixed is None
                    else f"mixed, with {', '.join(slow)}")
            raise UserError(f"{name}: --kernels runs 4-bit weights with a group size that is a multiple of 32 "
                            f"(or per channel) on the W4A16 kernels; this checkpoint is {what}: use --dequant")
        results = {}
        for kind, body in sources.items():
            ids = token_stream(llm.tokenizer, body)
            try:
                results[kind] = perplexity(llm, ids, seq_len=seq_len, max_windows=max_windows, progress=progress)
            except UserError as e:
                raise UserError(f"text {kind!r}: {e}") from None
        first = next(iter(results.values()))
        rows.append(EvalRow(
            name, checkpoint_kind(llm.engine.source.folder), first.ppl, first.nll_mean, first.num_tokens,
            first.num_windows, time.perf_counter() - t0,
            ppl_by_kind={k: r.ppl for k, r in results.items()},
            nll_by_kind={k: r.nll_mean for k, r in results.items()},
            tokens_by_kind={k: r.num_tokens for k, r in results.items()},
            windows_by_kind={k: r.num_windows for k, r in results.items()},
        ))
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _sources(kinds, texts: Mapping[str, str] | None, text) -> dict[str, str]:
    """{kind name: text} to measure, checked before any model loads."""
    built_in = () if kinds is None and text is not None else parse_kinds(kinds)
    out = {k: eval_text(k) for k in built_in}
    extra = dict(texts or {})
    if text is not None:
        extra.update(read_texts([text], taken=(*out, *extra)))
    for name, body in extra.items():
        if name in out:
            raise UserError(f"two texts are named {name!r}")
        if not isinstance(body, str) or not body.strip():
            raise UserError(f"text {name!r} is empty")
        out[name] = body
    if not out:
        raise UserError(f"nothing to measure: no text kinds (allowed: {', '.join(KINDS)}) and no --text")
    return out
