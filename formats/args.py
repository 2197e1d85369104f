"""Quantization arguments of one tensor, as a checkpoint stores them.

``QuantArgs`` mirrors compressed-tensors' ``QuantizationArgs`` (integer, round-to-nearest
grid) so it serialises straight into a checkpoint's ``config.json`` and reads back from it.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_ONLY_BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor is quantized (integer, round-to-nearest grid).

    ``group_size`` None means one scale per output channel (the group spans all of K).
    ``actorder`` "static": GPTQ visits columns by decreasing Hessian diagonal but the groups
    keep their natural column ranges, so no g_idx is needed (compressed-tensors "weight").
    """

    num_bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True
    actorder: str | None = None

    def __post_init__(self) -> None:
        if self.num_bits not in WEIGHT_ONLY_BITS:
            raise ValueError(f"num_bits={self.num_bits} is not supported; allowed: {WEIGHT_ONLY_BITS}")
        if self.group_size is not None and (self.group_size <= 0 or self.group_size % 8):
            raise ValueError(
                f"group_size={self.group_size} is not supported; allowed: a positive multiple of 8 "
                f"(usually {', '.join(map(str, GROUP_SIZES))}) or None for per-channel"
            )
        if self.actorder not in (None, "static"):
            raise ValueError(f"actorder={self.actorder!r} is not supported; allowed: None, 'static'")

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def groups(self, in_features: int) -> int:
        """Number of groups along K; raises ValueError if the group size does not divide K."""
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} does not divide in_features={in_features}; "
                f"choose a group size that divides it (e.g. {_divisors_hint(in_features)})"
            )
        return in_features // self.group_size

    def to_compressed_tensors(self) -> dict:
        """The ``weights`` entry of a compressed-tensors config group."""
        return {
            "num_bits": self.num_bits,
            "type": "int",
            "symmetric": self.symmetric,
            "strategy": "channel" if self.group_size is None else "group",
            "group_size": self.group_size,
            "dynamic": False,
            "actorder": "weight" if self.actorder == "static" else None,
            "observer": "minmax",
            "observer_kwargs": {},
            "block_structure": None,
        }

    @classmethod
    def from_compressed_tensors(cls, d: dict) -> "QuantArgs":
        if d.get("type", "int") != "int":
            raise ValueError(f"weight type {d.get('type')!r} is not supported here; allowed: 'int'")
        strategy = d.get("strategy", "group")
        if strategy not in ("group", "channel"):
            raise ValueError(f"weight strategy {strategy!r} is not supported; allowed: 'group', 'channel'")
        # compressed-tensors' ActivationOrdering: "static" is an alias of "weight", "dynamic" of "group"
        actorder = {"static": "weight", "dynamic": "group"}.get(d.get("actorder"), d.get("actorder"))
        if actorder not in (None, "weight"):
            raise ValueError(f"actorder {d.get('actorder')!r} is not supported; allowed: None, 'weight' ('static'); "
                             "'group' ('dynamic') needs g_idx")
        return cls(
            num_bits=int(d["num_bits"]),
            group_size=d.get("group_size") if strategy == "group" else None,
            symmetric=bool(d.get("symmetric", True)),
            actorder="static" if actorder == "weight" else None,
        )


def _divisors_hint(k: int) -> str:
    ok = [g for g in GROUP_SIZES if k % g == 0]
    return ", ".join(map(str, ok)) if ok else "a divisor of it that is a multiple of 8"
