"""Test reference: a transformers model holding a checkpoint's dequantized weights (the values
vLLM's and HF's dequantization give), built from the checkpoint with formats/ alone."""

from __future__ import annotations

from pathlib import Path

import torch

from optllm.errors import UserError
from optllm.formats.compressed_tensors import load_quantized_weights
from optllm.hub.loader import check_architecture, load_tokenizer, parse_dtype


def load_quantized(
    folder: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
):
    """(HF model in eval mode with the dequantized weights, tokenizer, quantized weights by
    module name) of a checkpoint: the values vLLM's / HF's dequantization gives."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    qweights, rest, cfg_dict = load_quantized_weights(folder)
    cfg_dict = {k: v for k, v in cfg_dict.items() if k != "quantization_config"}
    config = AutoConfig.for_model(**cfg_dict)
    check_architecture(config)
    dt = parse_dtype(dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dt)
    state = {k: v.to(dt) if v.is_floating_point() else v for k, v in rest.items()}
    for name, qw in qweights.items():
        state[f"{name}.weight"] = qw.dequantize().to(dt)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not _is_tied(model, m)]
    if missing or unexpected:
        raise UserError(
            f"{folder}: checkpoint does not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    _materialize_buffers(model, config, dt)
    model.eval().to(device)
    return model, load_tokenizer(folder), qweights


def _is_tied(model, name: str) -> bool:
    return name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)


def _set_module(model, name: str, new) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _materialize_buffers(model, config, dtype) -> None:
    """Non-persistent buffers (rotary inv_freq) were created on meta: rebuild their modules on CPU."""
    for mod_name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            if not hasattr(mod, "config"):
                raise UserError(f"cannot rebuild the buffers of {mod_name} ({type(mod).__name__})")
            with torch.device("cpu"):
                _set_module(model, mod_name, type(mod)(config=mod.config))
