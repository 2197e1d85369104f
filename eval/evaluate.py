"""`optllm eval`: measure checkpoints side by side (perplexity now; speed and tasks later)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..hub.loader import load_model, resolve_model
from ..quant.load import is_quantized_folder, load_quantized
from .perplexity import eval_token_stream, perplexity, text_token_stream


@dataclass
class EvalRow:
    model: str
    kind: str  # "float" or the checkpoint's scheme
    ppl: float
    nll: float
    num_tokens: int
    num_windows: int
    seconds: float


def describe(folder: Path) -> str:
    import json

    rep = folder / "optllm-report.json"
    if rep.is_file():
        return json.loads(rep.read_text()).get("scheme", "quantized")
    return "quantized" if is_quantized_folder(folder) else "float"


def load_any(model: str, dtype: str, device: str, linear: str = "dequant"):
    """Float or quantized model folder / alias -> (model, tokenizer, label)."""
    folder = resolve_model(model)
    if is_quantized_folder(folder):
        m, tok, _ = load_quantized(folder, dtype=dtype, device=device, linear=linear)
    else:
        m, tok, _ = load_model(folder, dtype=dtype, device=device)
    return m, tok, describe(folder)


def evaluate_ppl(
    models: list[str],
    text: str | None = None,
    seq_len: int = 512,
    max_windows: int | None = None,
    batch_size: int = 4,
    dtype: str = "float32",
    device: str = "cpu",
    linear: str = "dequant",
    progress: bool = True,
) -> list[EvalRow]:
    """Perplexity of each model on the same token stream and windows."""
    rows = []
    for name in models:
        t0 = time.perf_counter()
        m, tok, kind = load_any(name, dtype, device, linear)
        ids = text_token_stream(tok, text) if text else eval_token_stream(tok)
        r = perplexity(m, ids, seq_len=seq_len, batch_size=batch_size, max_windows=max_windows, progress=progress)
        rows.append(EvalRow(name, kind, r.ppl, r.nll_mean, r.num_tokens, r.num_windows, time.perf_counter() - t0))
        del m
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows
