"""Sensitivity of each linear to each candidate scheme (mixed precision, quant/mixed.py).

A pass over the float blocks, before the quantizing one: on a sample of the calibration
windows (QuantizeConfig.mixed_tokens), each block runs once per unit (linears that take one
scheme together) and candidate, with that unit alone quantized by RTN, and the change of the
block's output (the residual stream) delta_t at each token t is scored:

* "fisher" (the default): (N/2) sum_t (g_t . delta_t)^2, g_t the gradient of the float model's
  mean next-token cross-entropy over the N predicted tokens with respect to that output
  (loss_gradients: one forward and backward of the whole model on the sample): the empirical
  Fisher's estimate of the loss increase, in nats per token. A change counts by how much the
  loss can feel it: a block's output feeds every later block, so its own norm says little.
* "output": mean_t ‖delta_t‖^2 / ‖h_t‖^2, h_t the token's hidden state at the last block: errors
  in the residual stream travel on mostly unchanged, and the final norm scales each token.
  Needs no backward pass (nor the whole model on the device at once).

Scores add over units; RTN stands in for the run's algorithm, which lowers every candidate's
error alike. Cost: per block, one forward for the reference and one per (unit, candidate),
on the sample only; the next block's inputs are this block's float outputs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.args import QuantArgs
from . import observers
from .sequential import BlockInputs, _forward, capture_block_inputs, decoder_layers

if TYPE_CHECKING:
    from .mixed import Unit

METRICS = ("fisher", "output")


def sample_windows(num: int, seq_len: int, tokens: int) -> list[int]:
    """Indices of about `tokens` tokens' worth of the num calibration windows, spread evenly."""
    want = max(1, min(num, -(-tokens // seq_len)))
    return sorted({round(i * (num - 1) / max(want - 1, 1)) for i in range(want)})


def measure_sensitivity(
    model: nn.Module,
    arch,
    units: list["Unit"],
    input_ids: torch.Tensor,
    batch_size: int,
    device: torch.device,
    store: torch.device,
    scale_dtype: torch.dtype,
    progress=None,
    metric: str = "fisher",
) -> dict:
    """Fill each unit's sensitivity (module docstring; metric "fisher" or "output") from a pass
    over the float blocks on input_ids [windows, T]; returns the pass's report fields (metric,
    tokens, seconds). The model is left as it was. progress: called with (block index, blocks)
    after each block."""
    if metric not in METRICS:
        raise ValueError(f"sensitivity metric {metric!r} is not allowed; allowed: {', '.join(METRICS)}")
    t0 = time.perf_counter()
    grads = loss_gradients(model, arch, input_ids, batch_size, device) if metric == "fisher" else None
    layers = decoder_layers(model, arch)
    inputs = capture_block_inputs(model, input_ids, batch_size, device, store=store)
    by_block: dict[int, list[Unit]] = {}
    for u in units:
        by_block.setdefault(u.block, []).append(u)
    scores: dict[int, list[torch.Tensor]] = {}  # id(unit) -> per candidate, per token score
    for i, layer in enumerate(layers):
        home = next(layer.parameters()).device
        layer.to(device)
        try:
            ref = _outputs(layer, inputs)
            weight = None if grads is None else grads[i]
            for u in by_block.get(i, []):
                mods = {n: layer.get_submodule(n[len(arch.block_prefix(i)) + 1 :]) for n in u.linears}
                scores[id(u)] = [_change(layer, inputs, ref, mods, c.args, scale_dtype, weight) for c in u.candidates]
            inputs = BlockInputs([r.to(h.device) for r, h in zip(ref, inputs.hidden)], inputs.kwargs)
            if grads is not None:
                grads[i] = None  # type: ignore[call-overload]  # freed block by block
        finally:
            layer.to(home)
        if progress is not None:
            progress(i, len(layers))
    tokens = sum(h.shape[0] * h.shape[1] for h in inputs.hidden)
    if grads is not None:  # (N/2) sum_t (g_t . delta_t)^2, g of the mean loss: nats per token
        predicted = input_ids.shape[0] * (input_ids.shape[1] - 1)
        for u in units:
            u.sensitivity = [float(e.sum() / (2 * predicted)) for e in scores[id(u)]]
    else:
        final = torch.cat([r.float().reshape(-1, r.shape[-1]).pow(2).sum(1).cpu() for r in inputs.hidden])
        final = final.double().clamp_min(1e-30)
        for u in units:
            u.sensitivity = [float((e / final).mean()) for e in scores[id(u)]]
    return {
        "metric": metric,
        "tokens": int(tokens),
        "windows": int(input_ids.shape[0]),
        "seconds": time.perf_counter() - t0,
    }


def loss_gradients(
    model: nn.Module, arch, input_ids: torch.Tensor, batch_size: int, device: torch.device
) -> list[list[torch.Tensor]]:
    """Per block, per batch of input_ids: the gradient of the summed next-token cross-entropy of
    the float model with respect to the block's output hidden states [B, T, H] (CPU, bfloat16).
    The whole model runs on `device` for it (then goes back); its parameters get no gradients."""
    layers = decoder_layers(model, arch)
    home = next(model.parameters()).device
    flags = {p: p.requires_grad for p in model.parameters()}
    seen: dict[int, torch.Tensor] = {}

    def keep(i):
        def hook(_m, _args, out):
            h = out[0] if isinstance(out, tuple) else out
            h.retain_grad()
            seen[i] = h

        return hook

    def start(_m, _args, out):
        return out.requires_grad_(True)

    handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    handles.append(model.get_submodule(arch.embed_tokens).register_forward_hook(start))
    grads: list[list[torch.Tensor]] = [[] for _ in layers]
    try:
        for p in flags:
            p.requires_grad_(False)
        model.to(device)
        with torch.enable_grad():
            for b in range(0, input_ids.shape[0], batch_size):
                ids = input_ids[b : b + batch_size].to(device)
                logits = model(input_ids=ids, use_cache=False).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
                loss.backward()
                for i in range(len(layers)):
                    grads[i].append(seen[i].grad.detach().to("cpu", torch.bfloat16))
                seen.clear()
                del logits, loss
    finally:
        for h in handles:
            h.remove()
        model.to(home)
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return grads


def _outputs(layer: nn.Module, inputs: BlockInputs) -> list[torch.Tensor]:
    device = next(layer.parameters()).device
    with torch.no_grad():
        return [_forward(layer, h, kw, device) for h, kw in zip(inputs.hidden, inputs.kwargs)]


def _change(
    layer: nn.Module,
    inputs: BlockInputs,
    ref: list[torch.Tensor],
    mods: dict[str, nn.Linear],
    args: QuantArgs | None,
    scale_dtype: torch.dtype,
    grads: list[torch.Tensor] | None,
) -> torch.Tensor:
    """Per token (CPU, float64), the change of the block's output delta = block(x) − ref with the
    linears `mods` RTN-quantized to args (None: left as they are: zero): (g . delta)^2 with
    grads (per batch, [B, T, H]), else ‖delta‖^2."""
    if args is None:
        return torch.zeros(sum(h.shape[0] * h.shape[1] for h in inputs.hidden), dtype=torch.float64)
    saved = {n: m.weight.detach().clone() for n, m in mods.items()}
    try:
        with torch.no_grad():
            for n, m in mods.items():
                m.weight.copy_(observers.fake_quantize(saved[n], args, scale_dtype=scale_dtype).to(m.weight.dtype))
        out = _outputs(layer, inputs)
    finally:
        with torch.no_grad():
            for n, m in mods.items():
                m.weight.copy_(saved[n])
    per_batch = []
    for k, (o, r) in enumerate(zip(out, ref)):
        d = o.float() - r.float()
        if grads is None:
            per_batch.append(d.pow(2).sum(-1).reshape(-1))
        else:
            per_batch.append((d * grads[k].to(d.device, torch.float32)).sum(-1).pow(2).reshape(-1))
    return torch.cat([t.double().cpu() for t in per_batch])
