"""Mixed precision: a weight scheme per linear, chosen to minimise the model's total
sensitivity under an average-bits budget (QuantizeConfig.target_bits, `--target-bits 4.5`).

Candidates are weight-only integer grids the runtime serves and vLLM loads (``w4g128``,
``w4g64``, ``w4g32``: 4 bits in groups; ``w8``: 8 bits per output channel; ``bf16``: left
unquantized), with the run's symmetry and column order. A weight's bits are what the
checkpoint stores for it: num_bits + 16 / group (its scale) + num_bits / group (its zero point,
asymmetric), a per-channel scale counting as a group of in_features (eval/report.py's
average_bits leaves that small share out); bf16 is 16.

The unit of choice is a set of linears the runtime and vLLM fuse into one GEMM (q/k/v, gate/up:
the block's sequential groups), which must share a scheme, or a lone linear (o_proj, down_proj).

Sensitivity: quant/sensitivity.py, a pass over the float blocks before the quantizing one,
gives each unit's candidates their cost in the objective.

The choice (solve) is exact: a multiple-choice knapsack over integer costs (bits x weights, in
units of their greatest common divisor), by dynamic programming over the budget left above
the cheapest choice; sum(bits_i * numel_i) <= target_bits * sum(numel_i) always holds (past
MAX_CELLS the costs are rounded up to a coarser grid: the budget still holds, the report says
the choice may then miss the optimum).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch
from torch import nn

from ..formats.args import CHANNEL, QuantArgs
from ..formats.compressed_tensors import matches
from ..hub.architectures import BlockMapping
from .sensitivity import measure_sensitivity
from .sequential import block_linears, decoder_layers

BF16 = "bf16"
DEFAULT_CANDIDATES = ("w4g128", "w4g64", "w4g32", "w8")
_NAME = re.compile(r"^w(\d+)(?:g(\d+))?$")
# the DP's table (units x budget cells, one byte each); past it, costs are rounded up to a coarser grid
MAX_CELLS = 1 << 26


@dataclass(frozen=True)
class Candidate:
    """One scheme a linear may take: its name in the menu and its weights' arguments (None:
    left in the checkpoint's float dtype)."""

    name: str
    args: QuantArgs | None

    @property
    def bits(self) -> Fraction:
        return weight_bits(self.args)


def weight_bits(args: QuantArgs | None, in_features: int | None = None) -> Fraction:
    """Bits per weight, exactly, as eval/report.py's average_bits counts them (None: 16): num_bits,
    + 16 / group for the group's scale, + num_bits / group for its zero point (asymmetric). A
    per-channel scale (and zero point) spans the whole row: counted over in_features when it is
    given (what the checkpoint stores), left out otherwise (as average_bits does)."""
    if args is None:
        return Fraction(16)
    bits = Fraction(args.num_bits)
    span = args.group_size if args.strategy == "group" else in_features if args.strategy == CHANNEL else None
    if span:
        bits += Fraction(16, span) + (0 if args.symmetric else Fraction(args.num_bits, span))
    return bits


def candidate_name(args: QuantArgs | None) -> str:
    """The menu's name of these arguments (w4g64, w8, bf16)."""
    if args is None:
        return BF16
    return f"w{args.num_bits}" + (f"g{args.group_size}" if args.strategy == "group" else "")


def parse_candidates(names: tuple[str, ...] | list[str], base: QuantArgs) -> list[Candidate]:
    """The menu NAMES (w{bits}[g{group}] or bf16) as Candidates with base's symmetry and
    column order, except 8-bit ones, always symmetric: vLLM serves 8-bit zero points on Hopper
    only (formats/vllm_compat.py), so an asymmetric run's 8-bit units would make the whole
    checkpoint unloadable elsewhere. ValueError naming the bad entry."""
    allowed = (
        f"w{{bits}}g{{group}} (e.g. {', '.join(DEFAULT_CANDIDATES[:3])}), w{{bits}} (per channel, e.g. w8) or {BF16}"
    )
    if not names:
        raise ValueError(f"mixed_candidates is empty; allowed entries: {allowed}")
    out: list[Candidate] = []
    for raw in names:
        name = str(raw).strip().lower()
        if name == BF16:
            out.append(Candidate(BF16, None))
            continue
        m = _NAME.match(name)
        if not m:
            raise ValueError(f"mixed candidate {raw!r} is not allowed; allowed: {allowed}")
        bits, group = int(m.group(1)), m.group(2)
        try:
            sym = True if bits == 8 else base.symmetric
            if group is None:
                args = dataclasses.replace(base, num_bits=bits, group_size=None, strategy=CHANNEL, symmetric=sym)
            else:
                args = dataclasses.replace(base, num_bits=bits, group_size=int(group), strategy="group", symmetric=sym)
        except ValueError as e:
            raise ValueError(f"mixed candidate {raw!r}: {e}") from None
        out.append(Candidate(name, args))
    seen = [c.name for c in out]
    dup = next((n for n in seen if seen.count(n) > 1), None)
    if dup:
        raise ValueError(f"mixed candidate {dup!r} is listed twice")
    return out


@dataclass
class Unit:
    """Linears that take one scheme together (full names), their weight count, the candidates
    their shapes admit, each candidate's sensitivity (filled by measure_sensitivity) and the
    linears' shapes (out_features, in_features), which make a per-channel scale's bits exact
    (none given: the candidates' own bits, per-channel scales left out)."""

    block: int
    linears: tuple[str, ...]
    numel: int
    candidates: list[Candidate]
    sensitivity: list[float] = field(default_factory=list)
    shapes: tuple[tuple[int, int], ...] = ()

    def cost(self, j: int) -> Fraction:
        """The bits the unit's weights take with candidate j, exactly (scales and zero points included)."""
        args = self.candidates[j].args
        if not self.shapes:
            return weight_bits(args) * self.numel
        return sum((weight_bits(args, k) * (n * k) for n, k in self.shapes), Fraction(0))

    @property
    def label(self) -> str:
        parent = self.linears[0].rpartition(".")[0]
        leaves = [n.rpartition(".")[2] for n in self.linears]
        return (
            f"{parent}.{'+'.join(leaves)}"
            if all(n.startswith(parent + ".") for n in self.linears)
            else "+".join(self.linears)
        )


def block_units(
    prefix: str,
    mapping: BlockMapping,
    linears: dict[str, nn.Linear],
    index: int,
    candidates: list[Candidate],
    fixed: dict[str, Candidate] | None = None,
) -> list[Unit]:
    """The units of one block (its quantized linears, names relative to the block; prefix is
    the block's name and a dot): its sequential groups, then any other linear alone. A unit
    takes the candidates that fit every one of its linears (group size dividing K); fixed
    (full name -> Candidate, from per-module overrides) pins a unit to one. ValueError when
    a unit has none, or its linears are pinned apart."""
    stages = [tuple(n for n in g if n in linears) for g in mapping.sequential]
    rest = [(n,) for n in linears if not any(n in g for g in stages)]
    fixed = fixed or {}
    units = []
    for stage in [g for g in stages if g] + rest:
        names = tuple(prefix + n for n in stage)
        pins = {fixed.get(n) for n in names}
        if len(pins) > 1:
            raise ValueError(
                f"{', '.join(names)} are fused into one linear by vLLM and the runtime but the overrides "
                "give them different schemes; give them the same"
            )
        pin = pins.pop()
        menu = [pin] if pin is not None else candidates
        fits = [c for c in menu if c.args is None or all(_fits(c.args, linears[n].in_features) for n in stage)]
        if not fits:
            ks = ", ".join(map(str, sorted({linears[n].in_features for n in stage})))
            raise ValueError(
                f"{' / '.join(c.name for c in menu)} does not fit {', '.join(names)} (in_features {ks}): "
                "give a scheme whose group size divides it"
            )
        shapes = tuple((linears[n].out_features, linears[n].in_features) for n in stage)
        units.append(Unit(index, names, sum(n * k for n, k in shapes), fits, shapes=shapes))
    return units


def _fits(args: QuantArgs, in_features: int) -> bool:
    try:
        args.groups(in_features)
    except ValueError:
        return False
    return True


# --------------------------------------------------------------------------- the choice


@dataclass
class Choice:
    """The solution: per unit the index of its chosen candidate; the weighted bits reached
    (exact) and allowed; whether the costs were exact or rounded up to fit MAX_CELLS."""

    picks: list[int]
    average_bits: Fraction
    target_bits: Fraction
    total_sensitivity: float
    exact: bool


def solve(
    costs: list[list[int]], sens: list[list[float]], budget: int, max_cells: int = MAX_CELLS
) -> tuple[list[int], bool]:
    """Minimise sum(sens[u][pick[u]]) subject to sum(costs[u][pick[u]]) <= budget, one pick
    per unit (costs: non-negative integers). Returns (picks, exact): exact is False when the
    costs were rounded up to a coarser grid to fit max_cells (the budget still holds; the
    optimum may be missed). Ties go to the cheaper candidate, then the earlier one.
    ValueError when even the cheapest picks exceed the budget."""
    if any(not 0 < len(c) <= 127 for c in costs):
        raise ValueError("every unit needs between 1 and 127 candidates")
    base = [min(c) for c in costs]
    room = budget - sum(base)
    if room < 0:
        raise ValueError(f"the budget is {budget} but the cheapest choice costs {sum(base)}")
    extra = [[c - b for c in cs] for cs, b in zip(costs, base)]
    step, exact = 1, True
    if len(costs) * (room + 1) > max_cells:
        step = math.ceil(len(costs) * (room + 1) / max_cells)
        exact = False
    cap = room // step
    ext = [[-(-e // step) for e in es] for es in extra]  # rounded up: a rounded plan never costs more
    # best[c]: the least sensitivity of the units so far with rounded extra cost <= c
    best = np.zeros(cap + 1)
    picks_at = np.zeros((len(costs), cap + 1), dtype=np.int8)
    for u, (es, ss) in enumerate(zip(ext, sens)):
        order = sorted(range(len(es)), key=lambda j: (es[j], j))
        new = np.full(cap + 1, np.inf)
        arg = np.zeros(cap + 1, dtype=np.int8)
        for j in order:
            e = es[j]
            if e > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[e:] = best[: cap + 1 - e] + ss[j]
            better = cand < new
            new[better], arg[better] = cand[better], j
        best, picks_at[u] = new, arg
    picks = [0] * len(costs)
    c = cap
    for u in range(len(costs) - 1, -1, -1):
        j = int(picks_at[u, c])
        picks[u] = j
        c -= ext[u][j]
    return picks, exact


def _target(target_bits: float | Fraction) -> Fraction:
    """The target as an exact fraction (a float as its shortest decimal: 4.6 is 23/5, not 4.5999...)."""
    return Fraction(repr(target_bits)) if isinstance(target_bits, float) else Fraction(target_bits)


def check_budget(units: list[Unit], target_bits: float | Fraction) -> None:
    """ValueError when even each unit's cheapest candidate averages more than target_bits."""
    total = sum(u.numel for u in units)
    low = sum((min(u.cost(j) for j in range(len(u.candidates))) for u in units), Fraction(0)) / max(total, 1)
    if units and low > _target(target_bits):
        raise ValueError(
            f"target_bits {float(_target(target_bits)):g} is below the cheapest choice the candidates "
            f"allow on this model ({float(low):.4f} bits per weight on average); allowed: "
            f"{math.ceil(float(low) * 1e4) / 1e4:g} to 16"
        )


def choose(units: list[Unit], target_bits: float | Fraction, max_cells: int = MAX_CELLS) -> Choice:
    """The candidates of least total sensitivity whose weights average at most target_bits
    (sum over units of Unit.cost <= target_bits * their weights, exactly). ValueError when the
    target is below the cheapest choice, or a sensitivity is not a finite number."""
    target = _target(target_bits)
    check_budget(units, target)
    for u in units:
        if len(u.sensitivity) != len(u.candidates) or not all(math.isfinite(x) for x in u.sensitivity):
            raise ValueError(f"{u.label}: sensitivities {u.sensitivity} are not one finite number per candidate")
    raw = [[u.cost(j) for j in range(len(u.candidates))] for u in units]
    total = sum(u.numel for u in units)
    budget = target * total
    denom = math.lcm(*(x.denominator for row in raw for x in row), budget.denominator)
    ints = [[int(x * denom) for x in row] for row in raw]
    g = math.gcd(*(x for row in ints for x in row)) or 1
    ints = [[x // g for x in row] for row in ints]
    cap = math.floor(budget * denom / g)
    picks, exact = solve(ints, [u.sensitivity for u in units], cap, max_cells)
    achieved = sum(row[j] for row, j in zip(raw, picks)) / total
    if achieved > target:  # solve keeps the budget by construction; this guards the arithmetic above
        raise AssertionError(f"mixed precision chose {float(achieved)} bits over the target {float(target)}")
    return Choice(picks, achieved, target, sum(u.sensitivity[j] for u, j in zip(units, picks)), exact)


# --------------------------------------------------------------------------- the plan


def plan_linears(
    model: nn.Module,
    arch,
    base: QuantArgs,
    ignore,
    overrides: dict,
    target_bits: float | None,
    candidate_names,
    sample_ids: torch.Tensor,
    batch_size: int,
    device: torch.device,
    store: torch.device,
    scale_dtype: torch.dtype,
    progress=None,
    metric: str = "fisher",
) -> tuple[dict[str, QuantArgs | None], dict | None]:
    """Each quantized linear's weight arguments (full name -> QuantArgs; None: left in bf16)
    and the mixed-precision report (None without target_bits). Overrides pin linears; with
    target_bits the others choose among the candidates (sensitivity pass on sample_ids, then
    choose); without, they take base. ValueError for what cannot be planned."""
    menu = (
        parse_candidates(candidate_names, base) if target_bits is not None else [Candidate(candidate_name(base), base)]
    )
    units: list[Unit] = []
    for i, layer in enumerate(decoder_layers(model, arch)):
        prefix = arch.block_prefix(i) + "."
        lins = {n: m for n, m in block_linears(layer, arch.block).items() if not matches(prefix + n, ignore)}
        fixed = pinned([prefix + n for n in lins], overrides, base)
        units += block_units(prefix, arch.block, lins, i, menu, fixed)
    if target_bits is None:
        return {n: u.candidates[0].args for u in units for n in u.linears}, None
    if not units:
        raise ValueError("target_bits: every linear is ignored; there is nothing to choose a scheme for")
    check_budget(units, target_bits)  # before the sensitivity pass, which is the slow part
    measured = measure_sensitivity(
        model, arch, units, sample_ids, batch_size, device, store, scale_dtype, progress, metric
    )
    choice = choose(units, target_bits)
    assigned = {n: u.candidates[j].args for u, j in zip(units, choice.picks) for n in u.linears}
    return assigned, report(units, choice, menu, measured)


def summary(mixed: dict) -> str:
    """One line: the bits reached against the target, and the share of weights per candidate."""
    parts = [
        f"{name} {c['units']} units ({100 * c['weight_share']:.0f}% of weights)"
        for name, c in sorted(mixed["counts"].items(), key=lambda kv: -kv[1]["weight_share"])
    ]
    return (
        f"mixed precision: {mixed['average_bits']:.4f} bits per weight on average (target "
        f"{mixed['target_bits']:g}{'' if mixed['optimal'] else ', costs rounded: near-optimal'}): " + ", ".join(parts)
    )


# --------------------------------------------------------------------------- the report


def report(units: list[Unit], choice: Choice, candidates: list[Candidate], measured: dict) -> dict:
    """optllm-report.json's `mixed` entry: the target, the bits reached, and per unit its
    linears, weights, choice, bits (exact: a per-channel scale counts over in_features) and
    every candidate's sensitivity. `candidates` holds each one's bits per weight without the
    per-channel scales (they depend on the shape)."""
    return {
        "target_bits": float(choice.target_bits),
        "average_bits": float(choice.average_bits),
        "average_bits_exact": f"{choice.average_bits.numerator}/{choice.average_bits.denominator}",
        "optimal": choice.exact,
        "total_sensitivity": choice.total_sensitivity,
        "candidates": {c.name: float(c.bits) for c in candidates},
        "sensitivity_pass": measured,
        "units": [
            {
                "unit": u.label,
                "block": u.block,
                "linears": list(u.linears),
                "numel": u.numel,
                "choice": u.candidates[j].name,
                "bits": float(u.cost(j) / u.numel),
                "sensitivity": u.sensitivity[j] if u.sensitivity else None,
                "sensitivities": {c.name: s for c, s in zip(u.candidates, u.sensitivity)},
            }
            for u, j in zip(units, choice.picks)
        ],
        "counts": _counts(units, choice),
    }


def _counts(units: list[Unit], choice: Choice) -> dict:
    """Per candidate, the units and the share of the weights that took it."""
    total = sum(u.numel for u in units)
    out: dict[str, dict] = {}
    for u, j in zip(units, choice.picks):
        e = out.setdefault(u.candidates[j].name, {"units": 0, "weight_share": 0.0})
        e["units"] += 1
        e["weight_share"] += u.numel / total
    return out


def frozen_overrides(mixed: dict) -> tuple[dict[str, dict], list[str]]:
    """A mixed report's choice as per-module overrides (exact names -> num_bits, group_size)
    and the linears it left in bf16 (to ignore): a config that quantizes to the same layout
    without measuring again (e.g. the RTN checkpoint `quantize` compares with)."""
    overrides, keep = {}, []
    for u in mixed["units"]:
        m = _NAME.match(u["choice"])
        if m is None:
            keep += u["linears"]
            continue
        spec = {"num_bits": int(m.group(1)), "group_size": int(m.group(2)) if m.group(2) else CHANNEL}
        if spec["num_bits"] == 8:  # as parse_candidates: 8-bit candidates are symmetric in any run
            spec["symmetric"] = True
        overrides.update({n: dict(spec) for n in u["linears"]})
    return overrides, keep


def override_candidate(name: str, fields: dict, base: QuantArgs) -> Candidate:
    """The candidate one per-module override gives (fields: num_bits, group_size, symmetric
    over base); ValueError naming the pattern when the arguments are refused."""
    changes: dict = {}
    if "num_bits" in fields:
        changes["num_bits"] = fields["num_bits"]
    if "symmetric" in fields:
        changes["symmetric"] = fields["symmetric"]
    if "group_size" in fields:
        g = fields["group_size"]
        if isinstance(g, str) and g.strip().lower() == CHANNEL:
            changes.update(group_size=None, strategy=CHANNEL)
        else:
            changes.update(group_size=g, strategy="group")
    try:
        args = dataclasses.replace(base, **changes)
    except (TypeError, ValueError) as e:
        raise ValueError(f"override {name!r}: {e}") from None
    return Candidate(candidate_name(args), args)


def pinned(linear_names: list[str], overrides: dict[str, dict], base: QuantArgs) -> dict[str, Candidate]:
    """Full linear name -> the candidate of the first override pattern that matches it
    (compressed-tensors matching: exact name or suffix, or re:pattern)."""
    made = {p: override_candidate(p, f, base) for p, f in overrides.items()}
    out = {}
    for n in linear_names:
        p = next((p for p in overrides if matches(n, [p])), None)
        if p is not None:
            out[n] = made[p]
    return out
