"""`optllm eval`: measure checkpoints side by side (perplexity now; speed and tasks later).

Every model runs on the serving runtime (optllm.LLM), so a checkpoint's numbers are those
of the model that `optllm serve` would serve.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..runtime.llm import LLM
from ..runtime.loader import checkpoint_kind
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


def evaluate_ppl(
    models: list[str],
    text: str | None = None,
    seq_len: int = 512,
    max_windows: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    linear: str = "dequant",
    progress: bool = True,
) -> list[EvalRow]:
    """Perplexity of each model on the same token stream and windows.

    linear: "dequant" runs quantized weights dequantized (the values vLLM / HF give),
    "kernel" on the W4A16 kernels (their torch reference on CPU)."""
    rows = []
    for name in models:
        t0 = time.perf_counter()
        llm = LLM(name, device=device, dtype=dtype, quantized_linear=linear, max_model_len=seq_len,
                  max_num_seqs=64, enforce_eager=True)
        if linear == "kernel" and any("dequantized" in m for m in llm.engine.runner.linear_methods()):
            q = llm.engine.source.quant
            raise UserError(f"{name}: --kernels runs 4-bit weights with a group size that is a multiple of 32 "
                            f"(or per channel) on the W4A16 kernels; this checkpoint is int{q.args.num_bits} "
                            f"group {q.args.group_size or 'channel'}: use --dequant")
        tok = llm.tokenizer
        ids = text_token_stream(tok, text) if text else eval_token_stream(tok)
        r = perplexity(llm, ids, seq_len=seq_len, max_windows=max_windows, progress=progress)
        kind = checkpoint_kind(llm.engine.source.folder)
        rows.append(EvalRow(name, kind, r.ppl, r.nll_mean, r.num_tokens, r.num_windows, time.perf_counter() - t0))
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows
