"""Test reference: a transformers model holding a checkpoint's dequantized weights (the values
vLLM's and HF's dequantization give), built from the checkpoint with formats/ alone
(runtime/loader.py's transformers_model)."""

from __future__ import annotations

from pathlib import Path

import torch

from optllm.formats.compressed_tensors import load_quantized_weights
from optllm.hub.loader import load_tokenizer, parse_dtype
from optllm.runtime.loader import transformers_model


def load_quantized(
    folder: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
):
    """(HF model in eval mode with the dequantized weights, tokenizer, quantized weights by
    module name) of a checkpoint: the values vLLM's / HF's dequantization gives."""
    folder = Path(folder)
    loaded = load_quantized_weights(folder)  # read once: the model's weights and the codes returned
    model = transformers_model(folder, parse_dtype(dtype), loaded).to(device)
    return model, load_tokenizer(folder), loaded[0]
