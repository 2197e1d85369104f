"""AWQ: activation-aware weight quantization (Lin et al., 2023), as a weight transform.

Per group of linears sharing an input (a SmoothMapping), AWQ searches a per-input-channel
scale s = mean|x|^α / mean|ŵ|^(1-α) (ŵ: weights normalised per quantization group), over a
grid of α, choosing the one whose quantized balance layers, run on real inputs, best
reproduce the float output of the inspected module. The identity s = 1 (plain RTN) is always
a candidate, so AWQ never picks a scale worse than RTN on that objective. s is folded into the
preceding norm or linear (÷s) and the balance layers (×s), which leaves the float model
unchanged. Under grouped-query attention v_proj has fewer outputs than o_proj has inputs (each
value head feeds n_rep query heads' slots); the v_proj -> o_proj scale is then one per v_proj
channel, shared by the o_proj inputs it feeds (gqa_channel_index): still an exact refolding,
where AutoAWQ and llm-compressor skip the mapping. A second search then shrinks each group's
quantization range (weight clipping) to minimise the linear's own output error. The quantizer
(RTN) runs afterwards with those clip ratios. Both searches quantize with scales rounded to the
checkpoint's dtype, as stored.

Ignored layers (`--ignore`) are never quantized, in the searches as in the checkpoint: a
mapping whose balance layers are all ignored is skipped (those layers stay bit for bit as they
were); when only some are, the scale is searched with only the quantized ones quantized in the
objective and folded into all of them, since s lives on their shared input: the ignored ones
stay in full precision, their weights scaled by s (an exact change of the float function's
parametrisation). Ignored layers are never clip-searched.

Cost (the scale grid dominates: n_grid + 1 forwards of each inspected module): the grid is
scored on at most `scale_tokens` calibration tokens; when the inspected module is the single
balance linear, its error is a quadratic form in the weight change, scored through the inputs'
Gram matrix for every candidate at once. The clip search scores every ratio of a batch of
output rows at once, through per-group Gram matrices of all the calibration tokens (or of a
`clip_tokens` sample when a group is wider than that sample).
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import nn

from ..formats.args import QuantArgs
from ..hub.architectures import BlockMapping, SmoothMapping
from . import observers
from .algorithm import Algorithm, BlockContext, BlockResult, quantize_in_place, register_algorithm
from .awq_clip import ClipStats, search_clip
from .rtn import rtn_quantize
from .sequential import BlockInputs, _to, capture_inputs, collect_inputs, run_block


@dataclass(frozen=True)
class AWQOptions:
    n_grid: int = 20
    duo_scaling: bool = True  # use the weight term mean|ŵ|^(1-α) as AutoAWQ does; False: paper's s = x^α
    clip: bool = True
    clip_grid: int = 20
    max_shrink: float = 0.5
    clip_tokens: int = 512  # token sample of the clip search when a group is wider than it (per-channel)
    clip_rows: int = 256  # output rows whose clip candidates are scored at once (memory)
    # calibration tokens (whole sequences, spread over the set) the scale grid is scored on
    # (None: all). The grid costs n_grid + 1 forwards of each inspected module on them: on the
    # 2-core CPU, 16 x 256 tokens of SmolLM2 W4 g64 took 7.3 s a block with all 4096 tokens,
    # 4.9 s with 2048 and 3.2 s with 1024, for held-out perplexities 18.43, 18.55 and 18.38
    # (8 windows of 512; RTN 21.95): no loss measurable at that size.
    scale_tokens: int | None = 2048
    # weight of a token of massive activations in both searches' objectives and in mean|x|, in
    # typical tokens (observers.token_weights; None: every token counts fully, as the paper)
    token_cap: float | None = None
    # trust the inputs' correlations less where a search scores through a Gram matrix G (the clip
    # search; the scale grid of a mapping whose inspected module is its one balance linear):
    # G <- (1 - shrink) G + shrink diag(G), as GPTQ's hessian_shrink
    clip_shrink: float = 0.0
    scale_shrink: float = 0.0
    # grouped-query attention: search v_proj -> o_proj with one scale per v_proj channel, shared by
    # the o_proj inputs it feeds (gqa_channel_index); False: skip that mapping, as AutoAWQ and
    # llm-compressor do (off until measured better: docs/BENCHMARKS.md)
    gqa_smooth: bool = False
    # score each scale candidate with the clipped grid the layer will get (each group's range
    # searched as the clip step does, on the candidate's scaled inputs), not the min-max grid:
    # the scale and the clip that follows it chosen together
    joint_clip: bool = False
    # symmetric grids: the clip search also tries ranges wider than the min-max one, up to the
    # ratio (qmax - qmin) / 2 / qmax (4-bit 7.5 / 7, 3-bit 3.5 / 3) at which a group's largest
    # positive weight lands on qmax exactly instead of being clipped to qmax / ((qmax - qmin) / 2)
    # of itself (the min-max symmetric grid's scale absmax / 7.5 cuts +absmax to 0.933 absmax,
    # and AWQ's scales make the salient weight its group's largest). Measured (docs/BENCHMARKS.md,
    # sixteenth session): W4 g64 sym on text kinds the calibration never saw, share of RTN's gap
    # closed at 128 x 512 from 56 / 42 / 50% to 60 / 53 / 62% (docs / code / chat), at CI's
    # 16 x 256 from 52 / 38 / 43% to 61 / 52 / 61%; W3 sym 70 / 73 / 66% to 80 / 82 / 76%
    clip_expand: bool = True

    def __post_init__(self) -> None:
        if self.n_grid < 1 or self.clip_grid < 1:
            raise ValueError("n_grid and clip_grid must be >= 1")
        if not 0.0 <= self.max_shrink < 1.0:
            raise ValueError(f"max_shrink={self.max_shrink} must be in [0, 1)")
        if self.clip_tokens < 1 or self.clip_rows < 1:
            raise ValueError("clip_tokens and clip_rows must be >= 1")
        if self.token_cap is not None and not self.token_cap > 0:
            raise ValueError(f"token_cap={self.token_cap} must be > 0 (or None)")
        for name in ("clip_shrink", "scale_shrink"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if self.scale_tokens is not None and self.scale_tokens < 1:
            raise ValueError(f"scale_tokens={self.scale_tokens} must be >= 1 (or None: all tokens)")


@dataclass
class AWQResult:
    # chosen α per smooth layer; None where the identity (s = 1, plain RTN) won
    ratios: dict[str, float | None] = field(default_factory=dict)
    loss_gain: dict[str, float] = field(default_factory=dict)  # best loss / loss at s = 1 (<= 1)
    skipped: dict[str, str] = field(default_factory=dict)  # smooth layer -> why its mapping was skipped
    clip_ratio: dict[str, torch.Tensor] = field(default_factory=dict)  # [N, groups] per linear


@dataclass
class ScaleSearch:
    """One mapping's search: the chosen scales [K] (float32), α (None: identity), the
    objective (mean squared error of the inspected module's output) at the choice and at s = 1."""

    scales: torch.Tensor
    alpha: float | None
    loss: float
    rtn_loss: float
    # the smooth layer's output scales [K_prev]: `scales` itself, or, where one smooth channel feeds
    # several balance inputs (grouped-query attention's v_proj -> o_proj), the scale they share
    smooth_scales: torch.Tensor | None = None


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


def scale_candidates(
    x_mean: torch.Tensor, w_mean: torch.Tensor, opts: AWQOptions
) -> list[tuple[float | None, torch.Tensor]]:
    """(α, s [K]) pairs: the identity (None, 1) first, then α = i / n_grid for i < n_grid."""
    out: list[tuple[float | None, torch.Tensor]] = [(None, torch.ones_like(x_mean))]
    for i in range(opts.n_grid):
        alpha = i / opts.n_grid
        s = x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4) if opts.duo_scaling else x_mean.pow(alpha)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        out.append((alpha, torch.where(torch.isfinite(s), s, torch.ones_like(s))))
    return out


def _quantize_scaled(
    w: torch.Tensor, s: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype | None
) -> torch.Tensor:
    """Q(w·s)/s in float32: the weight a balance layer acts as once s is folded and it is quantized."""
    return observers.fake_quantize(w.float() * s, args, scale_dtype=scale_dtype) / s


def search_scales(
    module: nn.Module,
    mapping: SmoothMapping,
    balance: dict[str, nn.Linear],
    quantized: Collection[str],
    xs: list[torch.Tensor],
    kwargs: list[dict],
    args: QuantArgs,
    opts: AWQOptions,
    scale_dtype: torch.dtype | None = None,
    index: torch.Tensor | None = None,
) -> ScaleSearch:
    """Grid-search the scale of one mapping.

    balance: the mapping's balance linears by name; only those in `quantized` are quantized
    in the objective (the others are ignored layers: full precision). xs: the balance layers'
    input per batch [B, T, K] (any device); kwargs: the block's keyword arguments per batch.
    The objective is the mean squared error of `module`'s output against the float module's.
    index [K] (or None: the identity): the smooth layer's output channel feeding each balance
    input channel (gqa_channel_index); the scale is then searched per smooth channel, from the
    statistics of the balance channels it feeds (averaged), and spread to them.
    """
    device = next(iter(balance.values())).weight.device
    k = xs[0].shape[-1]
    x_mean = torch.zeros(k, device=device)
    count, weight_sum = 0, 0.0
    for x in xs:
        rows = x.to(device).reshape(-1, k).float()
        wt = observers.token_weights(rows, opts.token_cap)
        x_mean += rows.abs().sum(0) if wt is None else wt @ rows.abs()
        count += rows.shape[0]
        weight_sum += rows.shape[0] if wt is None else float(wt.sum())
    x_mean /= weight_sum
    w_mean = _group_weight_mean([b.weight for b in balance.values()], args)
    if index is None:
        cands = scale_candidates(x_mean, w_mean, opts)
        shared = cands
    else:
        index = index.to(device)
        n = int(index.max()) + 1
        shared = scale_candidates(channel_reduce(x_mean, index, n, "mean"), channel_reduce(w_mean, index, n, "mean"),
                                  opts)
        cands = [(a, t[index]) for a, t in shared]
    qlayers = {n: b for n, b in balance.items() if n in quantized}
    only = next(iter(balance.values()))
    quant = _clipped_quantizer(xs, args, opts, scale_dtype, device) if opts.clip and opts.joint_clip else None
    # the Gram form costs N·K² a candidate against T·N·K: worth it with more tokens than inputs
    gram = len(balance) == 1 and list(qlayers) == list(balance) and module is only and count >= k
    with torch.no_grad():
        if gram:
            losses = _linear_losses(only.weight, xs, cands, args, scale_dtype, opts.token_cap, opts.scale_shrink,
                                    quant=quant)
        else:
            losses = _module_losses(module, mapping, qlayers, xs, kwargs, cands, args, scale_dtype, opts.token_cap,
                                    quant=quant)
    best = min(range(len(cands)), key=lambda i: (losses[i], i))  # NaN never wins; ties keep the earlier
    if not losses[best] < float("inf"):
        best = 0  # every candidate gave NaN/inf: leave the layers as they are
    alpha, s = cands[best]
    return ScaleSearch(s, alpha, losses[best], losses[0], smooth_scales=shared[best][1])


def channel_reduce(v: torch.Tensor, index: torch.Tensor, n: int, how: str) -> torch.Tensor:
    """[n]: per smooth channel c, v over the balance channels i with index[i] == c reduced by
    `how` ("mean", "amax": torch's scatter_reduce); index from gqa_channel_index."""
    return torch.zeros(n, device=v.device, dtype=v.dtype).scatter_reduce_(0, index, v, how, include_self=False)


def gqa_channel_index(layer: nn.Module, mapping: SmoothMapping, balance_in: int,
                      smooth_out: int) -> torch.Tensor | None:
    """The smooth layer's output channel feeding each balance input channel [balance_in], or None
    where they cannot be matched. Equal widths: the identity (an arange). Grouped-query attention
    (v_proj -> o_proj): o_proj's input is the heads' outputs side by side, head h's channel j a
    mix of rows of value head h // n_rep's channel j; so scaling v_proj's output channel (g, j)
    by 1/t scales o_proj's input channels (h, j) of every head h of group g by 1/t, exactly: one
    scale per v channel, shared by the o_proj columns it feeds."""
    if balance_in == smooth_out:
        return torch.arange(balance_in)
    parent = layer.get_submodule(mapping.smooth.rpartition(".")[0]) if "." in mapping.smooth else None
    head_dim = getattr(parent, "head_dim", None)
    n_rep = getattr(parent, "num_key_value_groups", None)
    if not (mapping.smooth.endswith("v_proj") and head_dim and n_rep and n_rep > 1):
        return None
    if smooth_out % head_dim or balance_in != smooth_out * n_rep:
        return None
    c = torch.arange(balance_in)
    head, j = c // head_dim, c % head_dim
    return (head // n_rep) * head_dim + j


def _clipped_quantizer(xs: list[torch.Tensor], args: QuantArgs, opts: AWQOptions, scale_dtype, device):
    """(w [N, K], s [K]) -> Q_c(w·s)/s float32: the weight a balance linear acts as once s is folded
    and it is quantized with the clip search's ranges, searched (search_clip) against the
    per-group Gram matrices of the inputs it will see, x / s -- those of xs scaled by 1/s, exact
    (the Gram of x / s is S⁻¹ G S⁻¹), so the inputs are read once per mapping."""
    k = xs[0].shape[-1]
    base = ClipStats(k, args, opts.clip_tokens, 1, gram=True, token_cap=opts.token_cap)
    for x in xs:
        base.add(x.to(device))
    groups, gsize = base.groups, base.gsize

    def quantize(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        inv = (1.0 / s.float()).view(groups, gsize)
        stats = ClipStats(k, args, opts.clip_tokens, 1, gram=True, shrink=opts.clip_shrink)
        stats.gram = base.gram * inv[:, :, None] * inv[:, None, :]
        stats.tokens = base.tokens
        ws = w.float() * s
        ratio = search_clip(ws, stats, args, opts, scale_dtype)
        return observers.fake_quantize(ws, args, clip_ratio=ratio, scale_dtype=scale_dtype) / s

    return quantize


def _module_losses(module, mapping, qlayers, xs, kwargs, cands, args, scale_dtype, cap=None,
                   quant=None) -> list[float]:
    """Run the inspected module once per candidate with its quantized balance layers swapped in;
    each token's squared error weighted by observers.token_weights of its input (cap)."""
    device = next(iter(qlayers.values())).weight.device
    quant = quant or functools.partial(_quantize_scaled, args=args, scale_dtype=scale_dtype)
    k = xs[0].shape[-1]
    wts = [observers.token_weights(x.to(device).reshape(-1, k), cap) for x in xs]
    originals = {n: b.weight.detach().clone() for n, b in qlayers.items()}
    kws = [_to(kw, device) for kw in kwargs]
    # the float outputs are kept where the inputs are (the CPU, when offloading)
    ref = [_inspect(module, mapping, x.to(device), kw).float().to(x.device) for x, kw in zip(xs, kws)]
    numel = sum(r.numel() if w is None else float(w.sum()) * r.shape[-1] for r, w in zip(ref, wts))
    losses = []
    try:
        for _alpha, s in cands:
            for n, b in qlayers.items():
                b.weight.copy_(quant(originals[n], s).to(b.weight.dtype))
            loss = 0.0
            for x, kw, r, w in zip(xs, kws, ref, wts):
                out = _inspect(module, mapping, x.to(device), kw).float()
                sq = (out - r.to(device)).pow(2)
                loss += (sq.sum() if w is None else w @ sq.reshape(w.shape[0], -1).sum(1)).item()
            losses.append(_finite(loss / numel))
    finally:
        for n, b in qlayers.items():
            b.weight.copy_(originals[n])
    return losses


def _linear_losses(weight, xs, cands, args, scale_dtype, cap=None, shrink: float = 0.0,
                   chunk: int = 4, quant=None) -> list[float]:
    """The inspected module is the balance linear itself: its output error on inputs X is
    ‖X Δᵀ‖² with Δ = Q(W·s)/s − W, i.e. tr(Δ G Δᵀ) for the Gram matrix G = XᵀX, so each
    candidate costs N·K² instead of T·N·K (and no output is held)."""
    quant = quant or functools.partial(_quantize_scaled, args=args, scale_dtype=scale_dtype)
    w = weight.detach().float()
    n, k = w.shape
    device = w.device
    gram = torch.zeros(k, k, device=device)
    tokens = 0.0
    for x in xs:
        rows = x.to(device).reshape(-1, k).float()
        wt = observers.token_weights(rows, cap)
        gram.addmm_(rows.T if wt is None else (rows * wt[:, None]).T, rows)
        tokens += rows.shape[0] if wt is None else float(wt.sum())
    if shrink:
        gram = observers.shrink_gram(gram, shrink)
    losses = []
    for c0 in range(0, len(cands), chunk):
        part = cands[c0 : c0 + chunk]
        d = torch.cat([quant(w, s) - w for _a, s in part])  # [c·N, K]
        per_row = ((d @ gram) * d).sum(dim=1).reshape(len(part), n).sum(dim=1)
        losses += [_finite(float(v) / (tokens * n)) for v in per_row]
    return losses


def _finite(v: float) -> float:
    return v if v == v and v != float("inf") else float("inf")


def apply_scales(layer: nn.Module, mapping: SmoothMapping, scales: torch.Tensor,
                 smooth_scales: torch.Tensor | None = None) -> None:
    """Fold s: the smooth layer's output is divided by s (smooth_scales, where one of its channels
    feeds several balance inputs: gqa_channel_index), the balance layers' inputs times s."""
    prev = layer.get_submodule(mapping.smooth)
    with torch.no_grad():
        s = (scales if smooth_scales is None else smooth_scales).to(prev.weight.device)
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s.view(-1, 1).to(prev.weight.dtype))
        else:  # RMSNorm / LayerNorm: y = w * norm(x) (+ b)
            prev.weight.div_(s.to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
        s = scales.to(prev.weight.device)
        for name in mapping.balance:
            lin = layer.get_submodule(name)
            lin.weight.mul_(s.view(1, -1).to(lin.weight.dtype))


def awq_block(
    layer: nn.Module,
    mapping: BlockMapping,
    inputs: BlockInputs,
    args: QuantArgs,
    opts: AWQOptions,
    quantized: Collection[str] | None = None,
    scale_dtype: torch.dtype | None = None,
) -> AWQResult:
    """Search and fold AWQ scales for every mapping of a block, then search clip ratios.

    quantized: the block's linears that will be quantized (default: all of mapping.linears);
    the others are ignored layers (see the module docstring). scale_dtype: the checkpoint's
    scale dtype both searches quantize with (None: float32).
    """
    result = AWQResult()
    quantized = set(mapping.linears if quantized is None else quantized)
    picked = _scale_sample(inputs, opts.scale_tokens)
    sample = BlockInputs(  # the sequences the scale grid is scored on (all, by default)
        hidden=[_rows(inputs.hidden[i], rows, inputs.hidden[i].shape[0]) for i, rows in picked],
        kwargs=[_rows(inputs.kwargs[i], rows, inputs.hidden[i].shape[0]) for i, rows in picked],
    )
    todo = []
    for m in mapping.smooth:
        prev = layer.get_submodule(m.smooth)
        balance = {b: layer.get_submodule(b) for b in m.balance}
        if not quantized.intersection(balance):
            result.skipped[m.smooth] = "every balance layer is ignored"
            continue
        smooth_out = out_features(prev)
        widths = {b.in_features for b in balance.values()}
        index = gqa_channel_index(layer, m, widths.pop(), smooth_out) if len(widths) == 1 else None
        if index is None:
            result.skipped[m.smooth] = "the smooth layer's outputs do not map onto the balance layers' inputs"
            continue
        identity = index.numel() == smooth_out
        if not identity and not opts.gqa_smooth:
            result.skipped[m.smooth] = "grouped-query attention (gqa_smooth is off)"
            continue
        # this mapping's inputs only, from the float block (the scales are folded at the end)
        xs = collect_inputs(layer, sample, balance[m.balance[0]])
        found = search_scales(layer.get_submodule(m.inspect), m, balance, quantized, xs, sample.kwargs, args,
                              opts, scale_dtype, index=None if identity else index)
        del xs
        if found.alpha is not None:
            todo.append((m, found.scales, None if identity else found.smooth_scales))
        result.ratios[m.smooth] = found.alpha
        result.loss_gain[m.smooth] = found.loss / found.rtn_loss if found.rtn_loss > 0 else 1.0
    for m, s, prev_s in todo:
        apply_scales(layer, m, s, prev_s)
    if opts.clip:
        names = [n for n in mapping.linears if n in quantized and n not in mapping.no_clip]
        mods = {n: layer.get_submodule(n) for n in names}
        total = inputs.num_tokens()
        stats = {n: ClipStats(mod.in_features, args, opts.clip_tokens, total, token_cap=opts.token_cap,
                              shrink=opts.clip_shrink)
                 for n, mod in mods.items()}
        with capture_inputs(mods, lambda name, x: stats[name].add(x)):
            run_block(layer, inputs, keep=False)
        for name, mod in mods.items():
            result.clip_ratio[name] = search_clip(mod.weight.detach(), stats[name], args, opts, scale_dtype)
    return result


def _scale_sample(inputs: BlockInputs, budget: int | None) -> list[tuple[int, list[int] | None]]:
    """The calibration sequences the scale grid is scored on, as (batch index, rows of that
    batch or None for all of them): every one, or about `budget` tokens' worth of sequences
    spread evenly over the set (at least one)."""
    shapes = [(h.shape[0], h.shape[1]) for h in inputs.hidden]
    total = sum(b * t for b, t in shapes)
    if budget is None or total <= budget:
        return [(i, None) for i in range(len(shapes))]
    seqs = [(i, r) for i, (b, _t) in enumerate(shapes) for r in range(b)]
    want = max(1, min(len(seqs), budget // max(t for _b, t in shapes)))
    picked = sorted({seqs[round(j * (len(seqs) - 1) / max(want - 1, 1))] for j in range(want)})
    out: dict[int, list[int]] = {}
    for i, r in picked:
        out.setdefault(i, []).append(r)
    return [(i, rows if len(rows) < shapes[i][0] else None) for i, rows in out.items()]


def _rows(obj, rows: list[int] | None, batch: int):
    """obj (a tensor, or kwargs holding tensors) restricted to some sequences of a batch of
    `batch`: tensors whose first dimension is the batch are indexed, broadcast ones (first
    dimension 1: rotary tables, position ids) are kept."""
    if rows is None:
        return obj
    if torch.is_tensor(obj):
        return obj[rows] if obj.dim() > 0 and obj.shape[0] == batch and batch > 1 else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rows(o, rows, batch) for o in obj)
    if isinstance(obj, dict):
        return {k: _rows(v, rows, batch) for k, v in obj.items()}
    return obj


def out_features(mod: nn.Module) -> int:
    return mod.out_features if isinstance(mod, nn.Linear) else mod.weight.shape[0]


def awq_step(ctx: BlockContext, opts: AWQOptions) -> BlockResult:
    """Search and fold the block's scales and clip ratios (awq_block), then quantize every
    linear to its clipped min-max grid."""
    found = awq_block(ctx.layer, ctx.mapping, ctx.inputs, ctx.weights, opts, quantized=ctx.linears,
                      scale_dtype=ctx.scale_dtype)
    result = quantize_in_place(ctx, lambda name, w: rtn_quantize(
        w, ctx.weights, clip_ratio=found.clip_ratio.get(name), scale_dtype=ctx.scale_dtype))
    result.stats["awq_ratios"] = dict(found.ratios)
    return result


register_algorithm(Algorithm("awq", awq_step, options=lambda config: config.awq, folds_scales=True))
