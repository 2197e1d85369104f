"""Quantization schemes: what a checkpoint's weights and input activations become, and which
algorithm finds them, registered by the name `--scheme` takes.

A scheme gives its weights' QuantArgs (bits, number type, symmetry, strategy and group size),
its input activations' (None: weight-only; else static or dynamic, per tensor / token /
group), the algorithm (quant/algorithm.py) whose block step finds the weights, and the format
(formats/codec.py) the checkpoint is written in. The run's config may override the weights'
group size and symmetry and the column order (parse_scheme). A new scheme is one
register_scheme call in the module that needs it.

The weight-only integer schemes read ``w{bits}a16-{algorithm}`` (``w4a16-awq``,
``w3a16-gptq``...): ``pack-quantized``, group 128; 4- and 3-bit ones asymmetric (a zero point per
group), 8-bit ones symmetric, unless the run says otherwise. Asymmetric because it measured better
on every text kind, calibrated or not, for RTN, AWQ and GPTQ alike (SmolLM2-135M W4 / W3 g64,
128 x 512 and 16 x 256 calibration tokens: docs/BENCHMARKS.md, *Calibration that generalises*), and
vLLM serves 4-bit zero points (formats/vllm_compat.py); vLLM serves no 8-bit zero points on
Hopper, so 8 bits stay symmetric.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..formats.args import CHANNEL, QuantArgs
from ..registry import Registry
from .algorithm import ALGORITHMS, get_algorithm


@dataclass(frozen=True)
class QuantScheme:
    """A named scheme: the weight (and input activation) arguments, the algorithm that finds
    the weights and the checkpoint format."""

    name: str
    algorithm: str
    weights: QuantArgs
    input_activations: QuantArgs | None = None  # None: weight-only (activations stay in floating point)
    format: str = "pack-quantized"


SCHEMES: Registry[QuantScheme] = Registry("scheme", builtins=("optllm.quant.fp8", "optllm.quant.smoothquant",
                                                                  "optllm.quant.nvfp4"))


def register_scheme(scheme: QuantScheme, replace: bool = False) -> QuantScheme:
    return SCHEMES.register(scheme.name, scheme, replace=replace)


def available_schemes() -> list[str]:
    return SCHEMES.names()


def parse_scheme(
    name: str,
    group_size: int | str | None = None,
    symmetric: bool | None = None,
    actorder: str | None = None,
) -> QuantScheme:
    """The registered scheme NAME with a run's overrides: group_size (a number, CHANNEL, or
    None: the scheme's own), symmetric (None: the scheme's own), actorder ("static", None or
    "none": natural order, "auto": the algorithm's default). ValueError for an unknown name
    or arguments the algorithm or the QuantArgs refuse."""
    base = SCHEMES.get(name)
    algo = get_algorithm(base.algorithm)
    if actorder == "auto":
        actorder = algo.actorders[0]
    elif actorder == "none":
        actorder = None
    if actorder is not None and not any(a is not None for a in algo.actorders):
        owners = "/".join(a.name.upper() for a in ALGORITHMS.values() if any(o is not None for o in a.actorders))
        raise ValueError(f"actorder is a {owners} option; scheme {base.name!r} uses {algo.name}")
    changes: dict = {"actorder": actorder}
    if symmetric is not None:
        changes["symmetric"] = symmetric
    if group_size == CHANNEL:
        changes.update(group_size=None, strategy=CHANNEL)
    elif group_size is not None:
        changes.update(group_size=group_size, strategy="group")
    return dataclasses.replace(base, weights=dataclasses.replace(base.weights, **changes))


for _bits in (4, 3, 8):
    for _algo in ("rtn", "awq", "gptq"):
        register_scheme(QuantScheme(f"w{_bits}a16-{_algo}", _algo,
                                    QuantArgs(num_bits=_bits, group_size=128, symmetric=_bits == 8)))
