"""Sequential calibration: one decoder block on the compute device at a time.

The first block's inputs are captured once (embeddings on the device, the rest of the model
left where it is); each block is then moved to the device, calibrated and quantized, run
again to produce the inputs of the next block (so later blocks see the quantization error
of earlier ones, as GPTQ and AWQ intend), and moved back. Peak device memory is about one
block plus the cached activations of the calibration set.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn


class _Captured(Exception):
    """Raised by the capture hook to stop the forward once block 0's inputs are seen."""


@dataclass
class BlockInputs:
    """Inputs of one decoder block: hidden states per batch (kept on `store`), and the
    keyword arguments the model passed (position embeddings, masks), shared by all batches
    of equal shape."""

    hidden: list[torch.Tensor]
    kwargs: list[dict]

    def num_tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's list of decoder blocks (Llama family: model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers; not a Llama-family causal LM")
    return layers


def _to(obj, device):
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@contextmanager
def on_device(module: nn.Module, device: torch.device):
    """Move a module to the compute device for the duration of the block, then back."""
    home = next(module.parameters()).device
    module.to(device)
    try:
        yield module
    finally:
        module.to(home)


def capture_block_inputs(
    model: nn.Module, input_ids: torch.Tensor, batch_size: int, device: torch.device
) -> BlockInputs:
    """Run the embedding stage on `device` and capture what block 0 receives, per batch."""
    layers = decoder_layers(model)
    inner = model.model
    hidden, kwargs = [], []

    def hook(_module, args, kw):
        hidden.append((args[0] if args else kw.pop("hidden_states")).detach())
        kw = {k: v for k, v in kw.items() if k != "hidden_states"}
        for key in ("past_key_values", "past_key_value", "cache"):  # the name moved across versions
            if key in kw:
                kw[key] = None
        if "use_cache" in kw:
            kw["use_cache"] = False
        kwargs.append(kw)
        raise _Captured

    staged = [m for m in (inner.embed_tokens, getattr(inner, "rotary_emb", None)) if m is not None]
    homes = [next(iter(m.parameters()), next(iter(m.buffers()), None)) for m in staged]
    for m in staged:
        m.to(device)
    handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for i in range(0, input_ids.shape[0], batch_size):
                try:
                    inner(input_ids=input_ids[i : i + batch_size].to(device), use_cache=False)
                except _Captured:
                    pass
    finally:
        handle.remove()
        for m, h in zip(staged, homes):
            if h is not None:
                m.to(h.device)
    if not hidden:
        raise RuntimeError("calibration captured no inputs for the first decoder block")
    return BlockInputs(hidden=hidden, kwargs=kwargs)


def run_block(layer: nn.Module, inputs: BlockInputs, keep: bool = True) -> list[torch.Tensor]:
    """Run a (device-resident) block over every cached batch; returns its outputs per batch.

    keep=False runs it for its hooks' sake only (statistics) and holds no outputs.
    """
    device = next(layer.parameters()).device
    outs = []
    with torch.no_grad():
        for h, kw in zip(inputs.hidden, inputs.kwargs):
            out = layer(h.to(device), **_to(kw, device))
            if keep:
                outs.append((out[0] if isinstance(out, tuple) else out).detach())
    return outs


@contextmanager
def capture_inputs(modules: dict[str, nn.Module], sink):
    """Call sink(name, input_tensor) for each forward of the named modules."""

    def make(name):
        def hook(_m, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            sink(name, x.detach())

        return hook

    handles = [m.register_forward_pre_hook(make(n), with_kwargs=True) for n, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
