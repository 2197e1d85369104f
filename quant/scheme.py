"""Quantization schemes: what a checkpoint's weights (and later activations) become.

A scheme name reads ``w{bits}a16-{algorithm}`` for weight-only integer schemes
(``w4a16-awq``, ``w3a16-gptq``...). The weight arguments are formats.args.QuantArgs,
which serialise straight into a checkpoint's ``config.json``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..formats.args import WEIGHT_ONLY_BITS, QuantArgs

ALGORITHMS = ("rtn", "awq", "gptq")

_WEIGHT_ONLY = re.compile(r"^w(\d+)a16-([a-z]+)$")


@dataclass(frozen=True)
class QuantScheme:
    """A named scheme: the weight arguments plus the algorithm that finds the weights."""

    name: str
    algorithm: str
    weights: QuantArgs
    format: str = "pack-quantized"
    extra: dict = field(default_factory=dict)


def available_schemes() -> list[str]:
    return [f"w{b}a16-{a}" for b in (4, 3, 8) for a in ALGORITHMS]


def parse_scheme(
    name: str,
    group_size: int | None = 128,
    symmetric: bool = True,
    actorder: str | None = None,
) -> QuantScheme:
    """Turn ``w4a16-awq`` (plus the CLI's group size / symmetry) into a QuantScheme."""
    m = _WEIGHT_ONLY.match(name.strip().lower())
    if not m or int(m.group(1)) not in WEIGHT_ONLY_BITS or m.group(2) not in ALGORITHMS:
        raise ValueError(f"unknown scheme {name!r}; allowed: {', '.join(available_schemes())}")
    bits, algo = int(m.group(1)), m.group(2)
    if actorder is not None and algo != "gptq":
        raise ValueError(f"actorder is a GPTQ option; scheme {name!r} uses {algo}")
    args = QuantArgs(num_bits=bits, group_size=group_size, symmetric=symmetric, actorder=actorder)
    return QuantScheme(name=f"w{bits}a16-{algo}", algorithm=algo, weights=args)
