"""Build a runnable transformers model from a quantized optllm / compressed-tensors folder.

`linear="dequant"` puts the dequantized weights into ordinary nn.Linear modules (exactly
the values vLLM's or HF's dequantization gives); `linear="kernel"` swaps in
runtime.layers.QuantizedLinear, which keeps the packed weights and runs the W4A16 kernels.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ..hub.loader import check_architecture, load_tokenizer, parse_dtype
from .checkpoint import load_quantized_weights

LINEAR_MODES = ("dequant", "kernel")


def is_quantized_folder(folder: str | Path) -> bool:
    import json

    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return bool(json.loads(cfg.read_text()).get("quantization_config", {}).get("quant_method") == "compressed-tensors")
    except (json.JSONDecodeError, AttributeError):
        return False


def load_quantized(
    folder: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    linear: str = "dequant",
):
    """(model in eval mode, tokenizer, quantized weights by module name) of a checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if linear not in LINEAR_MODES:
        raise UserError(f"linear={linear!r} is not allowed; allowed: {', '.join(LINEAR_MODES)}")
    folder = Path(folder)
    qweights, rest, cfg_dict = load_quantized_weights(folder)
    cfg_dict = {k: v for k, v in cfg_dict.items() if k != "quantization_config"}
    config = AutoConfig.for_model(**cfg_dict)
    check_architecture(config)
    dt = parse_dtype(dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dt)
    state = {k: v.to(dt) if v.is_floating_point() else v for k, v in rest.items()}
    if linear == "dequant":
        for name, qw in qweights.items():
            state[f"{name}.weight"] = qw.dequantize().to(dt)
    else:
        from ..runtime.layers.quantized_linear import QuantizedLinear

        for name, qw in qweights.items():
            bias = rest.get(f"{name}.bias")
            new = QuantizedLinear.from_quantized(qw, bias=bias, dtype=dt, device=device)
            _set_module(model, name, new)
            state.pop(f"{name}.bias", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not _is_tied(model, m)]
    if linear == "kernel":
        missing = [m for m in missing if m.rsplit(".", 1)[0] not in qweights]
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
