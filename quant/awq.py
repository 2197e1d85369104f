"""AWQ: activation-aware weight quantization (Lin et al., 2023), as a weight transform.

Per group of linears sharing an input (a SmoothMapping), AWQ searches a per-input-channel
scale s = mean|x|^α / mean|ŵ|^(1-α) (ŵ: weights normalised per quantization group), over a
grid of α, choosing the one whose quantized balance layers, run on real inputs, best
reproduce the float output of the inspected module. s is folded into the preceding norm or
linear (÷s) and the balance layers (×s), which leaves the float model unchanged. A second
search then shrinks each group's quantization range (weight clipping) to minimise the
linear's own output error. The quantizer (RTN) runs afterwards with those clip ratios.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..formats.args import QuantArgs
from . import observers
from .mappings import BlockMapping, SmoothMapping
from .sequential import BlockInputs, _to, capture_inputs, run_block


@dataclass(frozen=True)
class AWQOptions:
    n_grid: int = 20
    duo_scaling: bool = True  # use the weight term mean|ŵ|^(1-α) as AutoAWQ does; False: paper's s = x^α
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    clip_tokens: int = 512  # tokens sampled for the clipping search
    clip_rows: int = 64  # output rows processed at once in the clipping search (memory)

    def __post_init__(self) -> None:
        if self.n_grid < 1 or self.clip_grid < 1:
            raise ValueError("n_grid and clip_grid must be >= 1")
        if not 0.0 <= self.max_shrink < 1.0:
            raise ValueError(f"max_shrink={self.max_shrink} must be in [0, 1)")


@dataclass
class AWQResult:
    ratios: dict[str, float] = field(default_factory=dict)  # chosen α per smooth layer
    loss_gain: dict[str, float] = field(default_factory=dict)  # best loss / loss at α=0
    clip_ratio: dict[str, torch.Tensor] = field(default_factory=dict)  # [N, groups] per linear


def _inspect(module: nn.Module, mapping: SmoothMapping, x: torch.Tensor, kw: dict) -> torch.Tensor:
    if mapping.needs_block_kwargs:
        out = module(hidden_states=x, **kw)
        return out[0] if isinstance(out, tuple) else out
    return module(x)


def _group_weight_mean(weights: list[torch.Tensor], args: QuantArgs) -> torch.Tensor:
    """mean over output rows of |w| normalised by its group's max |w|: [K]."""
    w = torch.cat(weights, dim=0).float()
    n, k = w.shape
    g = args.groups(k)
    wg = w.abs().reshape(n, g, k // g)
    wg = wg / (wg.amax(dim=-1, keepdim=True) + 1e-6)
    return wg.reshape(n, k).mean(dim=0)


def search_scales(
    module: nn.Module,
    mapping: SmoothMapping,
    balance: list[nn.Linear],
    xs: list[torch.Tensor],
    kwargs: list[dict],
    args: QuantArgs,
    opts: AWQOptions,
) -> tuple[torch.Tensor, float, float]:
    """Grid-search the scale exponent for one mapping; returns (scales [K], α, loss ratio)."""
    device = balance[0].weight.device
    x_mean = torch.zeros(xs[0].shape[-1], device=device)
    count = 0
    for x in xs:
        x_mean += x.abs().reshape(-1, x.shape[-1]).float().sum(0).to(device)
        count += x.numel() // x.shape[-1]
    x_mean /= count
    w_mean = _group_weight_mean([b.weight for b in balance], args)
    originals = [b.weight.detach().clone() for b in balance]
    kws = [_to(kw, device) for kw in kwargs]
    with torch.no_grad():
        ref = [_inspect(module, mapping, x.to(device), kw) for x, kw in zip(xs, kws)]
        best = (float("inf"), None, 0.0)
        first_loss = None
        for i in range(opts.n_grid):
            alpha = i / opts.n_grid
            if opts.duo_scaling:
                s = x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)
            else:
                s = x_mean.pow(alpha)
            s = s.clamp(min=1e-4)
            s = s / (s.max() * s.min()).sqrt()
            for b, w0 in zip(balance, originals):
                b.weight.copy_((observers.fake_quantize(w0.float() * s, args) / s).to(w0.dtype))
            loss = 0.0
            n = 0
            for x, kw, r in zip(xs, kws, ref):
                out = _inspect(module, mapping, x.to(device), kw)
                loss += (out.float() - r.float()).pow(2).sum().item()
                n += r.numel()
            loss /= n
            if first_loss is None:
                first_loss = loss
            if loss < best[0]:
                best = (loss, s.clone(), alpha)
        for b, w0 in zip(balance, originals):
            b.weight.copy_(w0)
    if best[1] is None:  # every candidate gave NaN: leave the layer as it was
        return torch.ones_like(x_mean), 0.0, 1.0
    return best[1], best[2], best[0] / first_loss if first_loss else 1.0


def apply_scales(layer: nn.Module, mapping: SmoothMapping, scales: torch.Tensor) -> None:
    """Fold s: the smooth layer's output is divided by s, the balance layers' inputs times s."""
    prev = layer.get_submodule(mapping.smooth)
    with torch.no_grad():
        s = scales.to(prev.weight.device)
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s.view(-1, 1).to(prev.weight.dtype))
        else:  # RMSNorm / LayerNorm: y = w * norm(x) (+ b)
            prev.weight.div_(s.to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
        for name in mapping.balance:
            lin = layer.get_submodule(name)
            lin.weight.mul_(s.view(1, -1).to(lin.weight.dtype))


def search_clip(w: torch.Tensor, x: torch.Tensor, args: QuantArgs, opts: AWQOptions) -> torch.Tensor:
    """Per-group range shrink ratio [N, groups] minimising the group-wise output error.

    w [N, K], x [T, K] (a token sample). Each group's contribution to the output,
    x_g · w_gᵀ, is compared before and after quantization with the range scaled by
    1 - i/clip_grid, for i up to max_shrink * clip_grid.
    """
    n, k = w.shape
    g = args.groups(k)
    gs = k // g
    xg = x.float().reshape(-1, g, gs)  # [T, g, gs]
    steps = int(opts.max_shrink * opts.clip_grid)
    best_ratio = torch.ones(n, g, device=w.device)
    for r0 in range(0, n, opts.clip_rows):
        wr = w[r0 : r0 + opts.clip_rows].float()  # [n', K]
        wg = wr.reshape(-1, g, gs)
        ref = torch.einsum("tgc,ngc->tng", xg, wg)
        best_err = torch.full((wr.shape[0], g), float("inf"), device=w.device)
        for i in range(steps + 1):
            ratio = 1.0 - i / opts.clip_grid
            q = observers.fake_quantize(wr, args, clip_ratio=ratio).reshape(-1, g, gs)
            err = (torch.einsum("tgc,ngc->tng", xg, q) - ref).pow(2).mean(dim=0)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio[r0 : r0 + opts.clip_rows][better] = ratio
    return best_ratio


def awq_block(
    layer: nn.Module,
    mapping: BlockMapping,
    inputs: BlockInputs,
    args: QuantArgs,
    opts: AWQOptions,
) -> AWQResult:
    """Search and fold AWQ scales for every mapping of a block, then search clip ratios."""
    result = AWQResult()
    firsts = {m.balance[0]: layer.get_submodule(m.balance[0]) for m in mapping.smooth}
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in firsts}
    with capture_inputs(firsts, lambda name, x: captured[name].append(x)):
        run_block(layer, inputs, keep=False)
    todo = []
    for m in mapping.smooth:
        prev = layer.get_submodule(m.smooth)
        balance = [layer.get_submodule(b) for b in m.balance]
        if any(b.in_features != _out_features(prev) for b in balance):
            continue  # e.g. v_proj -> o_proj under grouped-query attention: shapes differ
        module = layer.get_submodule(m.inspect)
        s, alpha, gain = search_scales(
            module, m, balance, captured[m.balance[0]], inputs.kwargs, args, opts
        )
        todo.append((m, s))
        result.ratios[m.smooth] = alpha
        result.loss_gain[m.smooth] = gain
    captured.clear()  # the block's activations: free them before the clip search
    for m, s in todo:
        apply_scales(layer, m, s)
    if opts.clip:
        clip_names = [n for n in mapping.linears if n not in mapping.no_clip]
        mods = {n: layer.get_submodule(n) for n in clip_names}
        samples: dict[str, list[torch.Tensor]] = {n: [] for n in clip_names}
        with capture_inputs(mods, lambda name, x: samples[name].append(x.reshape(-1, x.shape[-1]))):
            run_block(layer, inputs, keep=False)
        for name, mod in mods.items():
            x = torch.cat(samples[name])
            step = max(1, x.shape[0] // opts.clip_tokens)
            result.clip_ratio[name] = search_clip(mod.weight.detach(), x[::step][: opts.clip_tokens], args, opts)
    return result


def _out_features(mod: nn.Module) -> int:
    return mod.out_features if isinstance(mod, nn.Linear) else mod.weight.shape[0]
