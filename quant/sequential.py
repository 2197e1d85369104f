"""Sequential calibration: one decoder block on the compute device at a time.

The first block's inputs are captured once (embeddings on the device, the rest of the model
left where it is); each block is then moved to the device, calibrated and quantized, run
again to produce the inputs of the next block (so later blocks see the quantization error
of earlier ones, as GPTQ and AWQ intend), and moved back.

The block's inputs and its float outputs (the reference the block error is measured against)
live on a *store* device: the compute device, or the CPU when offloading (QuantizeConfig.offload),
in which case one batch at a time travels to the device. The next block's inputs replace this
block's batch by batch (advance_block), so inputs, reference and new outputs are never all held
at once: two copies of the calibration activations, on the store device, at most.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..hub.architectures import Architecture, BlockMapping, architecture_of

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # the cache argument's names, newest first


class _Captured(Exception):
    """Raised by a capture hook to stop the forward once the wanted input is seen."""


@dataclass
class BlockInputs:
    """Inputs of one decoder block: hidden states per batch [B, T, H], kept on the store
    device (where they were captured), and the keyword arguments the model passed (position
    embeddings, masks) per batch."""

    hidden: list[torch.Tensor]
    kwargs: list[dict]

    def num_tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)

    def nbytes(self) -> int:
        """Bytes of one copy of the hidden states (the unit the memory figures count in)."""
        return sum(h.numel() * h.element_size() for h in self.hidden)


def decoder_layers(model: nn.Module, arch: Architecture | None = None) -> nn.ModuleList:
    """The model's list of decoder blocks (its architecture's `layers`: model.layers for the
    Llama family); arch defaults to the registered architecture of model.config."""
    arch = arch or architecture_of(model.config)
    try:
        layers = model.get_submodule(arch.layers)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no {arch.layers}; not a {arch.name}")
    return layers


def block_linears(layer: nn.Module, mapping: BlockMapping) -> dict[str, nn.Linear]:
    """The block's linears by name (mapping.linears, relative to the block)."""
    out = {}
    for name in mapping.linears:
        mod = layer.get_submodule(name)
        if not isinstance(mod, nn.Linear):
            raise ValueError(f"{name} is a {type(mod).__name__}, expected nn.Linear")
        out[name] = mod
    return out


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
    model: nn.Module, input_ids: torch.Tensor, batch_size: int, device: torch.device,
    store: torch.device | None = None,
) -> BlockInputs:
    """Run the embedding stage on `device` and capture what block 0 receives, per batch.

    The hidden states are kept on `store` (default: `device`)."""
    store = device if store is None else store
    arch = architecture_of(model.config)
    layers = decoder_layers(model, arch)
    inner = model.get_submodule(arch.model)
    hidden, kwargs = [], []

    def hook(_module, args, kw):
        hidden.append((args[0] if args else kw.pop("hidden_states")).detach().to(store))
        kw = {k: v for k, v in kw.items() if k != "hidden_states"}
        for key in _CACHE_KWARGS:  # the name moved across versions
            if key in kw:
                kw[key] = None
        if "use_cache" in kw:
            kw["use_cache"] = False
        kwargs.append(kw)
        raise _Captured

    staged = [model.get_submodule(arch.embed_tokens)] + _optional(model, arch.rotary_emb)
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


def _optional(model: nn.Module, name: str) -> list[nn.Module]:
    try:
        return [model.get_submodule(name)]
    except AttributeError:
        return []


def _cache_kwarg(layer: nn.Module, kw: dict) -> str:
    """The name under which the block takes its KV cache (renamed across transformers versions)."""
    for key in _CACHE_KWARGS:
        if key in kw:
            return key
    params = inspect.signature(layer.forward).parameters
    for key in _CACHE_KWARGS:
        if key in params:
            return key
    raise ValueError(f"{type(layer).__name__}.forward takes no KV cache ({' / '.join(_CACHE_KWARGS)})")


def _forward(layer: nn.Module, h: torch.Tensor, kw: dict, device: torch.device, cache=None) -> torch.Tensor:
    kw = _to(kw, device)
    if cache is not None:
        kw[_cache_kwarg(layer, kw)] = cache
    out = layer(h.to(device), **kw)
    return (out[0] if isinstance(out, tuple) else out).detach()


def run_block(layer: nn.Module, inputs: BlockInputs, keep: bool = True) -> list[torch.Tensor]:
    """Run a (device-resident) block over every cached batch; returns its outputs per batch,
    each on the device its input is stored on.

    keep=False runs it for its hooks' sake only (statistics) and holds no outputs.
    """
    device = next(layer.parameters()).device
    outs = []
    with torch.no_grad():
        for h, kw in zip(inputs.hidden, inputs.kwargs):
            out = _forward(layer, h, kw, device)
            if keep:
                outs.append(out.to(h.device))
    return outs


def advance_block(layer: nn.Module, inputs: BlockInputs, ref: list[torch.Tensor], kv_cache=None) -> float:
    """Replace each batch of `inputs` by the block's output on it (the next block's inputs),
    consuming `ref` (the float block's outputs) batch by batch on the way; returns the block's
    relative output error ‖out − ref‖ / ‖ref‖ over all batches.

    kv_cache: an object passed to the block as its KV cache (transformers' Cache interface:
    the attention calls its update(keys, values, ...) and uses what it returns), e.g. the
    KV cache calibration's observer. One batch at a time is both input and output, so no
    third copy of the activations exists.
    """
    device = next(layer.parameters()).device
    num = den = 0.0
    with torch.no_grad():
        for i, (h, kw) in enumerate(zip(inputs.hidden, inputs.kwargs)):
            out = _forward(layer, h, kw, device, kv_cache)
            r = ref[i].to(device).float()
            num += float((out.float() - r).pow(2).sum())
            den += float(r.pow(2).sum())
            inputs.hidden[i] = out.to(h.device)
            ref[i] = None  # type: ignore[call-overload]  # freed as soon as it is used
    return (num / den) ** 0.5 if den > 0 else 0.0


def collect_inputs(
    layer: nn.Module, inputs: BlockInputs, module: nn.Module, batches: list[int] | None = None
) -> list[torch.Tensor]:
    """The input of `module` (a submodule of the block) on each cached batch, kept on each
    batch's store device; the forward stops as soon as `module` is reached.

    batches: which batches (indices into inputs.hidden; default all).
    """
    device = next(layer.parameters()).device
    seen: list[torch.Tensor] = []

    def hook(_m, args, kwargs):
        seen.append(args[0] if args else next(iter(kwargs.values())))
        raise _Captured

    out = []
    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for i in range(len(inputs.hidden)) if batches is None else batches:
                h = inputs.hidden[i]
                try:
                    layer(h.to(device), **_to(inputs.kwargs[i], device))
                except _Captured:
                    pass
                if len(seen) != 1:
                    raise RuntimeError(f"{type(module).__name__} did not run once in the block's forward")
                out.append(seen.pop().detach().to(h.device))
    finally:
        handle.remove()
    return out


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
