"""Recipes: YAML files for `optllm quantize --recipe`.

A recipe is either a mapping of QuantizeConfig's fields (as before), or such a mapping with
`steps:`, a list that composes the run in order::

    scheme: w8a8-int8            # optional: the steps imply it
    num_samples: 256             # any field may stand beside the steps
    steps:
      - smoothquant: {alpha: 0.5}
      - gptq: {dampening: 0.01}

    steps:
      - mixed: {target_bits: 4.5, candidates: [w4g64, w4g32, w8]}
      - awq: {n_grid: 20}
        overrides:               # per-module weights: exact names (or suffixes) or re:patterns
          "re:.*down_proj": {group_size: 32}

Steps that prepare (smoothquant: smoothing folded into the weights; mixed: a scheme per
linear) come first, each at most once; then exactly one step that quantizes (rtn, awq, gptq,
fp8, nvfp4), last. Under ``scheme: fp8`` or ``fp8-dynamic``, a gptq step puts GPTQ on the
E4M3 grid (``fp8: {weights: gptq}``) with its options. compile_steps checks that and turns the
steps into the fields they stand for, with one line per mistake (unknown step, bad order,
unknown field, a field given twice).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import UserError
from .awq import AWQOptions
from .fp8 import FP8Options
from .scheme import SCHEMES
from .smoothquant import SmoothQuantOptions

QUANTIZERS = ("rtn", "awq", "gptq", "fp8", "nvfp4")
PREPARERS = ("smoothquant", "mixed")
# each step's options: option name -> QuantizeConfig field (None: the step's options dataclass)
STEP_OPTIONS: dict[str, dict[str, str | None]] = {
    "rtn": {},
    "awq": {f.name: None for f in dataclasses.fields(AWQOptions)},
    "gptq": {
        "dampening": "dampening",
        "block_size": "gptq_block_size",
        "true_sequential": "true_sequential",
        "token_cap": "token_cap",
        "hessian_shrink": "hessian_shrink",
        "grid": "gptq_grid",
        "actorder": "actorder",
    },
    "fp8": {},
    "nvfp4": {},
    "smoothquant": {f.name: None for f in dataclasses.fields(SmoothQuantOptions) if f.name != "weights"},
    "mixed": {
        "target_bits": "target_bits",
        "candidates": "mixed_candidates",
        "tokens": "mixed_tokens",
        "sensitivity": "mixed_sensitivity",
    },
}
OVERRIDE_FIELDS = ("num_bits", "group_size", "symmetric")
OVERRIDE_TYPES = {"num_bits": "int", "group_size": "int | str", "symmetric": "bool"}  # group_size: or "channel"
_OVERRIDABLE = ("rtn", "awq", "gptq")  # the weight-only integer quantizers
_SMOOTHED = ("rtn", "gptq")  # the weight quantizers of the w8a8-int8 schemes (SmoothQuantOptions.weights)


@dataclasses.dataclass
class _Step:
    index: int
    name: str
    options: dict
    overrides: dict | None


def compile_steps(data: dict, where: str = "recipe") -> dict:
    """DATA (a recipe's mapping, holding `steps`) as flat QuantizeConfig fields; UserError of
    one line naming the step for any mistake."""
    steps = data["steps"]
    if not isinstance(steps, list) or not steps:
        raise UserError(f"{where}: steps must be a non-empty list of steps, e.g. [{{gptq: {{}}}}]")
    parsed = [_parse(i, item, where) for i, item in enumerate(steps)]
    quant = _check_order(parsed, where)
    out = {k: v for k, v in data.items() if k != "steps"}

    def put(field: str, value, step: _Step) -> None:
        if field in data:
            raise UserError(
                f"{where}: {field} is given both at the top level and in steps[{step.index}].{step.name}; give it once"
            )
        out[field] = value

    scheme = _scheme(data.get("scheme"), parsed, quant, where)
    out["scheme"] = scheme
    prep = {s.name: s for s in parsed if s.name in PREPARERS}
    if SCHEMES.get(scheme).algorithm == "smoothquant":
        sq = prep.get("smoothquant")
        options = {"smooth": sq is not None, **(sq.options if sq else {}), "weights": quant.name}
        put("smoothquant", options, sq or quant)
    if SCHEMES.get(scheme).algorithm == "fp8" and quant.name == "gptq":
        put("fp8", {"weights": "gptq"}, quant)
    if quant.name == "awq" and quant.options:
        put("awq", dict(quant.options), quant)
    for s in (prep.get("mixed"), quant if quant.name == "gptq" else None):
        for k, v in (s.options if s else {}).items():
            put(STEP_OPTIONS[s.name][k], v, s)
    if quant.overrides is not None:
        put("overrides", quant.overrides, quant)
    return out


def _parse(i: int, item, where: str) -> _Step:
    at = f"{where}: steps[{i}]"
    allowed = ", ".join(sorted(STEP_OPTIONS))
    if not isinstance(item, dict):
        raise UserError(
            f"{at} must be a mapping of one step name to its options (e.g. gptq: {{}}), not {type(item).__name__}"
        )
    names = [k for k in item if k != "overrides"]
    if len(names) != 1:
        raise UserError(
            f"{at} names {len(names)} steps ({', '.join(map(str, names)) or 'none'}); "
            f"one per list entry; allowed steps: {allowed}"
        )
    name = str(names[0])
    if name not in STEP_OPTIONS:
        raise UserError(f"{at}: unknown step {name!r}; allowed: {allowed}")
    options = item[name] if item[name] is not None else {}
    if not isinstance(options, dict):
        raise UserError(f"{at}.{name} must be a mapping of options, not {type(options).__name__}")
    unknown = sorted(set(map(str, options)) - set(STEP_OPTIONS[name]))
    if unknown:
        known = ", ".join(sorted(STEP_OPTIONS[name])) or "none (the step has no options)"
        raise UserError(f"{at}.{name}: unknown field {unknown[0]!r}; allowed: {known}")
    _check_step_types(name, options, f"{at}.{name}: ")
    overrides = item.get("overrides")
    if "overrides" in item:
        if name not in _OVERRIDABLE:
            raise UserError(
                f"{at}: overrides belong to a weight-only integer step ({', '.join(_OVERRIDABLE)}), not {name}"
            )
        overrides = check_overrides(overrides, f"{at}.overrides")
    return _Step(i, name, dict(options), overrides)


def _check_step_types(name: str, options: dict, where: str) -> None:
    """The step's options of the right types: those standing for QuantizeConfig fields by the
    field's annotation, the others by their options dataclass's (AWQOptions, SmoothQuantOptions)."""
    from .config import QuantizeConfig  # config imports this module

    fields = {f.name: f.type for f in dataclasses.fields(QuantizeConfig)}
    own = {"awq": AWQOptions, "smoothquant": SmoothQuantOptions}.get(name)
    own_types = {f.name: f.type for f in dataclasses.fields(own)} if own else {}
    for option, value in options.items():
        target = STEP_OPTIONS[name][option]
        check_value(f"{where}{option}", value, fields[target] if target else own_types[option])


def check_overrides(overrides, where: str = "overrides") -> dict[str, dict]:
    """Per-module weight overrides: a mapping of module pattern (an exact name or suffix, or
    re:regex) -> {num_bits, group_size, symmetric}; UserError of one line otherwise."""
    if overrides is None:
        return {}
    if not isinstance(overrides, dict):
        raise UserError(f"{where} must be a mapping of module pattern -> {{{', '.join(OVERRIDE_FIELDS)}}}")
    out = {}
    for pattern, fields in overrides.items():
        if not isinstance(pattern, str) or not pattern:
            raise UserError(f"{where}: pattern {pattern!r} must be a module name or re:regex")
        if not isinstance(fields, dict) or not fields:
            raise UserError(f"{where}[{pattern!r}] must be a non-empty mapping of {', '.join(OVERRIDE_FIELDS)}")
        unknown = sorted(set(map(str, fields)) - set(OVERRIDE_FIELDS))
        if unknown:
            raise UserError(
                f"{where}[{pattern!r}]: unknown field {unknown[0]!r}; allowed: {', '.join(OVERRIDE_FIELDS)}"
            )
        for name, annotation in OVERRIDE_TYPES.items():
            if name in fields:
                check_value(f"{where}[{pattern!r}].{name}", fields[name], annotation)
        out[pattern] = dict(fields)
    return out


def _check_order(parsed: list[_Step], where: str) -> _Step:
    """The quantizing step, after checking: exactly one, last; preparers once each, before it,
    and only with quantizers they fit."""
    seen: dict[str, _Step] = {}
    quant = None
    for s in parsed:
        if quant is not None:
            what = (
                "a recipe has one quantizing step"
                if s.name in QUANTIZERS
                else f"{s.name} must come before the quantizing step ({quant.name}), which is last"
            )
            raise UserError(f"{where}: steps[{s.index}]: {s.name} after {quant.name}: {what}")
        if s.name in QUANTIZERS:
            quant = s
        elif s.name in seen:
            raise UserError(f"{where}: steps[{s.index}]: {s.name} is given twice (steps[{seen[s.name].index}])")
        seen[s.name] = s
    if quant is None:
        raise UserError(
            f"{where}: no quantizing step, so no scheme; the last step must be one of {', '.join(QUANTIZERS)}"
        )
    if "mixed" in seen and "target_bits" not in seen["mixed"].options:
        raise UserError(
            f"{where}: steps[{seen['mixed'].index}].mixed: target_bits is missing; "
            "give the average bits per weight to reach, e.g. {target_bits: 4.5}"
        )
    if "smoothquant" in seen and quant.name not in _SMOOTHED:
        raise UserError(
            f"{where}: steps[{seen['smoothquant'].index}]: smoothquant can precede only "
            f"{' or '.join(_SMOOTHED)} (the w8a8-int8 weights), not {quant.name}"
        )
    if "mixed" in seen and quant.name not in _OVERRIDABLE:
        raise UserError(
            f"{where}: steps[{seen['mixed'].index}]: mixed precision needs a weight-only integer "
            f"step ({', '.join(_OVERRIDABLE)}), not {quant.name}"
        )
    if "mixed" in seen and "smoothquant" in seen:
        raise UserError(
            f"{where}: steps[{seen['mixed'].index}]: mixed precision chooses among weight-only integer "
            "schemes; it does not combine with smoothquant (w8a8-int8)"
        )
    return quant


def _scheme(given, parsed: list[_Step], quant: _Step, where: str) -> str:
    """The run's scheme: the recipe's, checked against the steps, or the one they imply
    (smoothquant -> w8a8-int8; rtn/awq/gptq -> w4a16-*; fp8 -> fp8; nvfp4 -> nvfp4). A gptq step
    also quantizes the weights of a w8a8-int8 or fp8 scheme the recipe names."""
    smoothed = any(s.name == "smoothquant" for s in parsed)
    if given is None:
        if smoothed:
            return "w8a8-int8"
        return f"w4a16-{quant.name}" if quant.name in _OVERRIDABLE else quant.name
    algorithm = SCHEMES.get(given).algorithm
    if algorithm == "smoothquant":
        if quant.name not in _SMOOTHED:
            raise UserError(
                f"{where}: steps[{quant.index}]: scheme {given!r} quantizes its weights with "
                f"{' or '.join(_SMOOTHED)} (after an optional smoothquant step), not {quant.name}"
            )
        if quant.overrides is not None:
            raise UserError(
                f"{where}: steps[{quant.index}]: overrides need a weight-only integer scheme "
                f"(w4a16-*, w8a16-*), not {given!r}"
            )
        return given
    if smoothed:
        step = next(s for s in parsed if s.name == "smoothquant")
        raise UserError(f"{where}: steps[{step.index}]: smoothquant needs a w8a8-int8 scheme, not {given!r}")
    if algorithm == "fp8" and quant.name == "gptq":  # GPTQ on the E4M3 grid (fp8: {weights: gptq})
        if quant.overrides is not None:
            raise UserError(
                f"{where}: steps[{quant.index}]: overrides need a weight-only integer scheme "
                f"(w4a16-*, w8a16-*), not {given!r}"
            )
        return given
    if algorithm != quant.name:
        raise UserError(
            f"{where}: steps[{quant.index}]: {quant.name} does not match scheme {given!r}, whose "
            f"algorithm is {algorithm}; change one of them"
        )
    return given


# the annotations of QuantizeConfig's and the options dataclasses' fields this check knows:
# annotation -> (test, what a recipe must give)
_KINDS = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "None": (lambda v: v is None, "null"),
    "tuple[str, ...]": (
        lambda v: v is None or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)),
        "a list of strings",
    ),
    "dict": (lambda v: v is None or isinstance(v, dict), "a mapping"),
    "AWQOptions": (lambda v: isinstance(v, (dict, AWQOptions)), "a mapping of AWQ options"),
    "SmoothQuantOptions": (lambda v: isinstance(v, (dict, SmoothQuantOptions)), "a mapping of SmoothQuant options"),
    "FP8Options": (lambda v: isinstance(v, (dict, FP8Options)), "a mapping of FP8 options"),
}
_YAML_NAMES = {
    bool: "true/false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
    type(None): "null",
}


def check_value(label: str, value, annotation: str) -> None:
    """UserError of one line when VALUE does not have the type ANNOTATION (a dataclass field's,
    e.g. "int | None") names; an annotation of a kind this check does not know passes."""
    allowed = []
    for kind in (k.strip() for k in str(annotation).split("|")):
        test, text = _KINDS.get(kind, (None, None))
        if test is None:
            return
        if test(value):
            return
        allowed.append(text)
    got = _YAML_NAMES.get(type(value), type(value).__name__)
    raise UserError(f"{label}={value!r} has the wrong type ({got}); allowed: {' or '.join(allowed)}")


def check_types(cls, data: dict, where: str = "") -> None:
    """Each of DATA's fields that dataclass CLS has, checked against its annotation (check_value;
    the label is WHERE + the field's name); fields CLS lacks are left to the caller."""
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    for name, value in data.items():
        if name in types:
            check_value(f"{where}{name}", value, types[name])


def check_options(cls, data: dict, where: str) -> None:
    """An options mapping (awq:, smoothquant:) against its dataclass CLS: known fields of the
    right types; UserError of one line otherwise."""
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(map(str, data)) - set(known))
    if unknown:
        raise UserError(f"{where}: unknown field {unknown[0]!r}; allowed: {', '.join(known)}")
    check_types(cls, data, f"{where}.")


def recipe_entry(recipe: str | Path | None, saved_as: str) -> dict:
    """The report's `recipe`: the file given and its text (None: flags only), and the name of
    the checkpoint's own copy of the configuration."""
    text = None
    if recipe is not None:
        try:
            text = Path(recipe).read_text()
        except OSError:
            text = None
    return {"file": None if recipe is None else str(recipe), "text": text, "saved_as": saved_as}


def recipe_note(model, recipe: str | Path | None, saved_as: str) -> str:
    """The comment the checkpoint's copy of its configuration starts with."""
    src = f"recipe {recipe} and flags" if recipe is not None else "flags"
    return (
        f"The configuration this checkpoint was made with (from {src}), as a recipe:\n"
        f"optllm quantize {model} --recipe {saved_as} --out DIR makes it again."
    )
