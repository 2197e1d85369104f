"""GPTQ (Frantar et al., 2022): quantize a linear layer's weight column by column, each
rounding error pushed onto the not-yet-quantized columns through the inverse Hessian of
the layer's inputs, so the layer's *output* error stays small rather than the weight error.

H = (2/n) Σ x xᵀ over calibration inputs x [K]. The inverse Hessian is used through the
upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU): row i of U, divided by U[i, i], is the optimal
update of the columns after i once column i is fixed (paper, Section 3, Step 3), and
U[i, i]² is the inverse-Hessian diagonal of the still-free columns that scales the error.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from ..formats.args import QuantArgs
from ..formats.float_quantized import FloatQuantizedWeight, fp8_scale, to_e4m3
from ..formats.qweight import QuantizedWeight
from . import observers
from .algorithm import Algorithm, BlockContext, BlockResult, install, register_algorithm
from .sequential import capture_inputs, run_block

# Each failed Cholesky multiplies the relative dampening by this; after this many tries the
# Hessian is beyond repair (non-finite entries, or not a Hessian at all).
_DAMP_GROWTH = 10.0
_DAMP_TRIES = 8
GRIDS = ("minmax", "mse", "hmse")


def _check_grid(grid: str) -> None:
    if grid not in GRIDS:
        raise ValueError(f"GPTQ grid {grid!r} is not allowed; allowed: {', '.join(GRIDS)}")


@dataclass(frozen=True)
class GPTQOptions:
    """The GPTQ step's options (QuantizeConfig's fields of the same names; block_size is its
    gptq_block_size). The column order (act-order) is the weights' QuantArgs.actorder, since
    the checkpoint records it."""

    dampening: float = 0.01  # added to the Hessian diagonal, a fraction of its mean
    block_size: int = 128  # columns updated lazily together
    true_sequential: bool = True  # Hessians of later linears see earlier ones quantized
    # weight of a token of massive activations in the Hessian, in typical tokens
    # (HessianAccumulator token_cap; None: unweighted, as the paper)
    token_cap: float | None = 16.0
    hessian_shrink: float = 0.3  # H <- (1 - shrink) H + shrink diag(H)
    # each group's grid: "minmax" (its range), "mse" (the range shrunk to minimise Σ|w - ŵ|^2.4,
    # the reference code's option), "hmse" (to minimise Σ H_jj (w_j - ŵ_j)², the output error
    # of the group's columns alone); see observers.mse_qparams. hmse measured better than minmax
    # on every text kind (SmolLM2 W4 g64, docs/BENCHMARKS.md, thirteenth session)
    grid: str = "hmse"

    def __post_init__(self) -> None:
        _check_grid(self.grid)
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.token_cap is not None and not self.token_cap > 0:
            raise ValueError(f"token_cap={self.token_cap} must be > 0 (or null: no cap)")
        if not 0.0 <= self.hessian_shrink < 1.0:
            raise ValueError(f"hessian_shrink={self.hessian_shrink} must be in [0, 1)")
        if not 0.0 < self.dampening < 1.0:
            raise ValueError(f"dampening={self.dampening} must be in (0, 1)")

    @classmethod
    def from_config(cls, config) -> "GPTQOptions":
        return cls(dampening=config.dampening, block_size=config.gptq_block_size,
                   true_sequential=config.true_sequential, token_cap=config.token_cap,
                   hessian_shrink=config.hessian_shrink, grid=config.gptq_grid)


class HessianAccumulator:
    """Running H = (2/n) Σ x xᵀ of one linear layer's inputs, in float32.

    ``add(x)`` takes inputs [..., K] (any leading dims; each row is one sample). The sum is
    kept as a running mean, rescaled on every call, so it never grows with n and cannot
    overflow float32 however many tokens pass through. H lives on the device of the first
    ``x``; later inputs are moved to it.

    token_cap (c): each token's outer product is weighted by min(1, c · m / ‖x_t‖²), m the
    median ‖x‖² of the batch passed to ``add``. Language models put "massive activations"
    (Sun et al., 2024) on a few tokens, the first of every window above all: in SmolLM2's
    layers 11 and 28 `down_proj`, 8 such tokens of 2,048 carry 90-99.9% of Σ‖x‖². Unweighted,
    H is then the Hessian of those few tokens: GPTQ cancels their error by moving every other
    column, and the damping (a fraction of the mean diagonal, now set by those tokens) drowns
    the structure of the ordinary tokens; the fit does not carry to other text. Capped, such a
    token counts as c typical ones; tokens of ordinary size keep weight 1. None: no cap.
    """

    def __init__(self, in_features: int, token_cap: float | None = None) -> None:
        if in_features <= 0:
            raise ValueError(f"in_features={in_features} must be positive")
        if token_cap is not None and not token_cap > 0:
            raise ValueError(f"token_cap={token_cap} must be > 0 (or None)")
        self.in_features = in_features
        self.token_cap = token_cap
        self.num_samples = 0
        self._h: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        """Fold a batch of inputs x [..., K] into H (K = in_features)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"input width {x.shape[-1]} does not match in_features={self.in_features}"
            )
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        if m == 0:
            return
        if self._h is None:
            self._h = torch.zeros(self.in_features, self.in_features, dtype=torch.float32, device=x.device)
        rows = rows.to(device=self._h.device, dtype=torch.float32)
        total = self.num_samples + m
        self._h.mul_(self.num_samples / total)
        # Scaling the rows (not the product) by sqrt(2/n) keeps every partial sum O(|x|²).
        scale = torch.full((m, 1), (2.0 / total) ** 0.5, device=rows.device)
        weight = observers.token_weights(rows, self.token_cap)
        if weight is not None:
            scale = scale * weight.sqrt().unsqueeze(1)
        rows = rows * scale
        self._h.addmm_(rows.T, rows)
        self.num_samples = total

    @property
    def hessian(self) -> torch.Tensor:
        """H [K, K] float32 on the inputs' device. Raises RuntimeError before any sample."""
        if self._h is None:
            raise RuntimeError(
                "no calibration samples reached this layer; its Hessian is undefined "
                "(quantize it with RTN instead, or calibrate with more data)"
            )
        return self._h


@dataclass
class _GPTQResult:
    """What the column loop produced, all in the natural column order.

    ``dq`` [N, K] float32 is the quantized weight exactly as the loop used it to compute
    the errors it propagated; QuantizedWeight.dequantize must reproduce it bit for bit.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    dq: torch.Tensor
    loss: float


def gptq_quantize(
    w: torch.Tensor,
    hessian: torch.Tensor,
    args: QuantArgs,
    block_size: int = 128,
    dampening: float = 0.01,
    scale_dtype: torch.dtype | None = None,
    shrink: float = 0.0,
    grid: str = "minmax",
) -> tuple[QuantizedWeight, float]:
    """GPTQ-quantize a weight w [N, K] (out_features, in_features) given its Hessian [K, K].

    ``hessian`` is (2/n) Σ x xᵀ of the layer's inputs (see HessianAccumulator); only its
    shape relative to its scale matters. ``dampening`` is added to the diagonal as a
    fraction of its mean (grown with a warning if the Cholesky still fails).
    ``shrink`` (λ in [0, 1)) first replaces H by (1 − λ) H + λ diag(H): the correlations
    between inputs, measured on the calibration text only, are trusted less, so less of a
    column's error is moved onto other columns on their account (λ = 0: plain GPTQ; λ → 1:
    RTN with act-order's visiting order).
    ``grid`` sets each group's range: "minmax", or shrunk by a search ("mse", "hmse": see
    GPTQOptions.grid).
    ``block_size`` columns are updated lazily together (the result does not depend on it
    beyond float rounding: a group's grid is set from its columns' weights as updated so far,
    including updates still pending inside the current block). Scales are rounded to
    ``scale_dtype`` (default w.dtype) before any code is chosen, so the codes are optimal for
    the grid the checkpoint stores.

    Returns the QuantizedWeight (codes, scales, zeros in the natural column order) and the
    GPTQ loss ½ Σ (w - ŵ)² / [H_F⁻¹]_qq over all columns, which equals
    ½ tr((W - Ŵ) H_damped (W - Ŵ)ᵀ), i.e. ‖X Wᵀ - X Ŵᵀ‖² / n plus the dampening term.
    """
    res = _gptq(w, hessian, args, block_size, dampening, scale_dtype, shrink, grid)
    cls = FloatQuantizedWeight if args.type == "float" else QuantizedWeight
    return cls(q=res.q, scale=res.scale, zero=res.zero, args=args), res.loss


def _check_inputs(w: torch.Tensor, hessian: torch.Tensor, args: QuantArgs, block_size: int, dampening: float,
                  shrink: float = 0.0, grid: str = "minmax") -> None:
    _check_grid(grid)
    if not 0.0 <= shrink < 1.0:
        raise ValueError(f"shrink={shrink} must be in [0, 1)")
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features]; got shape {tuple(w.shape)}")
    k = w.shape[1]
    args.groups(k)
    if tuple(hessian.shape) != (k, k):
        raise ValueError(
            f"hessian shape {tuple(hessian.shape)} does not match the weight's in_features: expected ({k}, {k})"
        )
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be a positive number of columns")
    if not dampening >= 0:
        raise ValueError(f"dampening={dampening} must be >= 0 (a fraction of the mean Hessian diagonal)")


def _inverse_hessian_factor(h: torch.Tensor, dampening: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + λ·mean(diag H)·I)⁻¹ (so that H⁻¹ = UᵀU).

    A float32 Hessian of many correlated inputs is often numerically singular; rather than
    fail, λ grows tenfold per try (with a warning) until both factorizations succeed.
    """
    if not torch.isfinite(h).all():
        raise ValueError("hessian has non-finite entries (inf/nan in the calibration activations?)")
    mean_diag = torch.diagonal(h).mean()
    damp = dampening
    for _ in range(_DAMP_TRIES):
        hd = h.clone()
        hd.diagonal().add_(damp * mean_diag)
        lower, info = torch.linalg.cholesky_ex(hd)
        if info.item() == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if info.item() == 0 and torch.isfinite(upper).all():
                return upper
        new_damp = damp * _DAMP_GROWTH if damp > 0 else 0.01
        warnings.warn(
            f"GPTQ: Hessian not positive definite with dampening {damp:g}; retrying with {new_damp:g}",
            stacklevel=3,
        )
        damp = new_damp
    raise ValueError(f"GPTQ: Hessian still not positive definite with dampening {damp / _DAMP_GROWTH:g}")


def _gptq(
    w: torch.Tensor,
    hessian: torch.Tensor,
    args: QuantArgs,
    block_size: int = 128,
    dampening: float = 0.01,
    scale_dtype: torch.dtype | None = None,
    shrink: float = 0.0,
    grid: str = "minmax",
) -> _GPTQResult:
    """The algorithm itself (paper, Algorithm 1, with grouping and static act-order)."""
    _check_inputs(w, hessian, args, block_size, dampening, shrink, grid)
    n, k = w.shape
    sdt = scale_dtype or w.dtype
    fp8 = args.type == "float"
    num_groups = args.groups(k)
    gsize = k // num_groups
    dynamic_groups = args.group_size is not None and args.actorder != "static"

    W = w.detach().to(torch.float32).clone()
    H = hessian.detach().to(device=w.device, dtype=torch.float32).clone()
    if shrink:
        diag = torch.diagonal(H).clone()
        H.mul_(1.0 - shrink)
        H.diagonal().add_(shrink * diag)

    # An input that is always zero leaves its weights free: pin them to 0 (exactly
    # representable, and the range of the other columns is not widened by them) and give H
    # a unit diagonal there so it stays invertible. Its row/column of H is zero otherwise,
    # so no error ever flows into or out of it.
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    hdiag = torch.diagonal(H).clone()  # natural column order

    def qparams(cols: torch.Tensor, cargs: QuantArgs, first: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        # the grid of weights cols [N, width], natural columns first.. (width: whole groups of cargs)
        if grid == "minmax":
            return observers.minmax_qparams(cols, cargs)
        c = hdiag[first : first + cols.shape[1]] if grid == "hmse" else None
        return observers.mse_qparams(cols, cargs, col_weight=c, norm=2.4 if grid == "mse" else 2.0,
                                     scale_dtype=sdt)

    # Per-group grid [N, groups]; float32 copies of the stored (rounded) scale for the maths.
    scale = torch.empty(n, num_groups, dtype=sdt, device=W.device)
    zero = None if args.symmetric else torch.empty(n, num_groups, dtype=torch.int8, device=W.device)
    if fp8:
        # E4M3: absmax / 448 per row (or tensor), from the original weight, as fp8_quantize_weight
        amax = W.abs().amax(dim=1, keepdim=True) if args.strategy == "channel" else W.abs().amax().expand(n, 1)
        scale.copy_(fp8_scale(amax, sdt))
    elif not dynamic_groups:
        # Per-channel, or static act-order: the grid comes from the original weight's natural
        # groups, so the codes need no g_idx whatever order the columns are visited in.
        s, z = qparams(W, args, 0)
        scale.copy_(s)
        if zero is not None:
            zero.copy_(z)
    scale32 = scale.float()
    zero32 = None if zero is None else zero.float()

    if args.actorder == "static":
        # Columns with large activations first, while many columns are still free to absorb
        # their error (paper, Section 4 "act-order").
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        W = W[:, perm]
        H = H[perm][:, perm]
        col_group = (perm // gsize).tolist()
    else:
        perm = None
        col_group = [j // gsize for j in range(k)]

    U = _inverse_hessian_factor(H, dampening)
    del H

    Q = torch.empty(n, k, dtype=torch.float32, device=W.device)
    DQ = torch.empty_like(Q)
    col_loss = torch.empty(k, dtype=torch.float32, device=W.device)
    per_group_args = QuantArgs(num_bits=args.num_bits, group_size=None, symmetric=args.symmetric)

    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        W1 = W[:, b0:b1].clone()
        U1 = U[b0:b1, b0:b1]
        err = torch.zeros(n, b1 - b0, dtype=torch.float32, device=W.device)
        for i in range(b1 - b0):
            j = b0 + i
            g = col_group[j]
            if dynamic_groups and j % gsize == 0:
                # The group's grid follows the weights as GPTQ has already moved them: columns
                # inside this block are current in W1; columns past it still owe this
                # block's pending update err @ U[block, cols] (zero for unvisited columns).
                g_end = j + gsize
                cur = W1[:, i : min(g_end, b1) - b0]
                if g_end > b1:
                    cur = torch.cat([cur, W[:, b1:g_end] - err @ U[b0:b1, b1:g_end]], dim=1)
                s, z = qparams(cur, per_group_args, j)
                scale[:, g] = s[:, 0].to(sdt)
                scale32[:, g] = scale[:, g].float()
                if zero is not None:
                    zero[:, g] = z[:, 0]
                    zero32[:, g] = zero[:, g].float()
            col = W1[:, i]
            s32 = scale32[:, g]
            if fp8:  # the nearest E4M3 value (saturated); E4M3 values are exact in float32
                q = to_e4m3(col / s32).float()
            else:
                q = torch.round(col / s32)
                if zero32 is not None:
                    q = q + zero32[:, g]
                q = torch.clamp(q, args.qmin, args.qmax)
            qz = q if zero32 is None else q - zero32[:, g]
            # (q - z)·s is exact in float32 for these small integers (and for E4M3 values, 4
            # significant bits, times a 16-bit scale); one rounding to the scale dtype then gives
            # the very value dequantize() computes in that dtype.
            dq = (qz * s32).to(sdt).float()
            Q[:, j] = q
            DQ[:, j] = dq
            e = (col - dq) / U1[i, i]
            col_loss[j] = e.square().sum()
            if i + 1 < b1 - b0:
                W1[:, i + 1 :].addr_(e, U1[i, i + 1 :], alpha=-1.0)
            err[:, i] = e
        if b1 < k:
            # The lazy batch update: the whole block's errors reach the later columns at once.
            W[:, b1:].addmm_(err, U[b0:b1, b1:], alpha=-1.0)

    if perm is not None:
        inv = torch.argsort(perm)
        Q = Q[:, inv]
        DQ = DQ[:, inv]
    loss = 0.5 * col_loss.double().sum().item()
    codes = to_e4m3(Q) if fp8 else Q.to(torch.int8)
    if fp8 and args.strategy == "tensor":
        scale = scale[:1, 0]  # one scale, stored [1]
    return _GPTQResult(q=codes, scale=scale, zero=zero, dq=DQ, loss=loss)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor, hessian: torch.Tensor) -> float:
    """sqrt(tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)): the relative output error over the inputs behind H."""
    w = w.float()
    d = w - w_hat.float()
    num = ((d @ hessian) * d).sum()
    den = ((w @ hessian) * w).sum()
    return float((num / den.clamp_min(1e-30)).sqrt())


def gptq_step(ctx: BlockContext, opts: GPTQOptions) -> BlockResult:
    """GPTQ on every linear of the block. With true_sequential, the block's sequential groups
    (a linear in none goes last) are done in order, each group's Hessians collected with the
    earlier groups already quantized; otherwise one pass over the float block collects them all."""
    linears = ctx.linears
    if opts.true_sequential and ctx.mapping.sequential:
        placed = [[n for n in g if n in linears] for g in ctx.mapping.sequential]
        rest = [n for n in linears if not any(n in g for g in placed)]
        groups = [g for g in placed + [rest] if g]
    else:
        groups = [list(linears)]
    result = BlockResult({}, [])
    for group in groups:
        mods = {n: linears[n] for n in group}
        acc = {n: HessianAccumulator(lin.in_features, token_cap=opts.token_cap) for n, lin in mods.items()}
        with capture_inputs(mods, lambda n, x: acc[n].add(x)):
            run_block(ctx.layer, ctx.inputs, keep=False)
        for name, lin in mods.items():
            w = lin.weight.detach()
            h = acc.pop(name).hessian
            qw, _loss = gptq_quantize(w, h, ctx.weights, block_size=opts.block_size, dampening=opts.dampening,
                                      scale_dtype=ctx.scale_dtype, shrink=opts.hessian_shrink, grid=opts.grid)
            result.errors.append((name, relative_error(w, qw.dequantize(torch.float32).to(w.device), h)))
            del h
            result.qweights[name] = install(lin, qw)
    return result


def gptq_per_channel_step(ctx: BlockContext, opts: GPTQOptions) -> BlockResult:
    """gptq_step for weights of one scale per output channel (or per tensor), the W8A8 schemes'
    (int8, FP8): the columns are visited by decreasing Hessian diagonal (act-order), which with
    a single group per row changes only the order, not the grid, so the checkpoint needs no
    g_idx and records no actorder: its weights' arguments stay ctx.weights."""
    if ctx.weights.strategy not in ("channel", "tensor"):
        raise ValueError(f"gptq_per_channel_step takes per-channel or per-tensor weights, not {ctx.weights.strategy!r}")
    result = gptq_step(dataclasses.replace(ctx, weights=dataclasses.replace(ctx.weights, actorder="static")), opts)
    for qw in result.qweights.values():
        qw.args = ctx.weights
    return result


register_algorithm(Algorithm("gptq", gptq_step, options=GPTQOptions.from_config, actorders=("static", None)))
