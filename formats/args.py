"""Quantization arguments of one tensor, as a checkpoint stores them.

``QuantArgs`` mirrors compressed-tensors' ``QuantizationArgs`` so it serialises straight into a
checkpoint's ``config.json`` and reads back from it: the number type and bits, the grid's
symmetry, and the strategy that says which elements share a scale (compressed-tensors'
spelling: "tensor", "channel" (per output row), "group" (``group_size`` columns of a row),
"token" (per row of an activation), "tensor_group" (NVFP4: ``group_size`` columns of a row under
one per-tensor global scale)), static (calibrated) or dynamic (taken at run time; "local":
NVFP4's activations, whose group scales are taken at run time under a calibrated global scale).
"""

from __future__ import annotations

from dataclasses import dataclass

CHANNEL = "channel"  # a group size that means one scale per output channel (config, recipes, CLI)
WEIGHT_ONLY_BITS = (2, 3, 4, 8)
FLOAT_BITS = (4, 8)  # E2M1 (NVFP4), E4M3 (FP8)
GROUP_SIZES = (32, 64, 128)
TYPES = ("int", "float")
STRATEGIES = ("tensor", "channel", "group", "token", "tensor_group")
GROUPED = ("group", "tensor_group")  # the strategies that take a group size
LOCAL = "local"  # dynamic group scales under a static global scale (compressed-tensors' DynamicType.LOCAL)
DYNAMICS = (False, True, LOCAL)


@dataclass(frozen=True)
class QuantArgs:
    """How one tensor is quantized.

    ``strategy`` defaults from ``group_size``: "group" with one, "channel" without, so
    ``group_size`` None means one scale per output channel (the group spans all of K), as
    compressed-tensors writes it (strategy "channel", group_size null). Strategies other
    than "group" and "tensor_group" take no group size. ``dynamic`` "local" (only with
    "tensor_group") is dynamic group scales under a static global scale.
    ``actorder`` "static": GPTQ visits columns by decreasing Hessian diagonal but the groups
    keep their natural column ranges, so no g_idx is needed (compressed-tensors "weight").
    """

    num_bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True
    actorder: str | None = None
    type: str = "int"
    strategy: str | None = None  # None: "group" when group_size is given, else "channel"
    dynamic: bool | str = False  # False, True or LOCAL

    def __post_init__(self) -> None:
        if self.strategy is None:
            object.__setattr__(self, "strategy", "group" if self.group_size is not None else CHANNEL)
        if self.type not in TYPES:
            raise ValueError(f"type={self.type!r} is not supported; allowed: {', '.join(TYPES)}")
        if self.type == "int" and self.num_bits not in WEIGHT_ONLY_BITS:
            raise ValueError(f"num_bits={self.num_bits} is not supported; allowed: {WEIGHT_ONLY_BITS}")
        if self.type == "float" and (self.num_bits not in FLOAT_BITS or not self.symmetric):
            raise ValueError(f"float num_bits={self.num_bits} (symmetric={self.symmetric}) is not supported; "
                             f"allowed: symmetric {' or '.join(map(str, FLOAT_BITS))} bits")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not supported; allowed: {', '.join(STRATEGIES)}")
        if self.strategy in GROUPED:
            if self.group_size is None or isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                    or self.group_size <= 0 or self.group_size % 8:
                raise ValueError(
                    f"group_size={self.group_size} is not supported; allowed: a positive multiple of 8 "
                    f"(usually {', '.join(map(str, GROUP_SIZES))}) or None for per-channel"
                )
        elif self.group_size is not None:
            raise ValueError(f"group_size={self.group_size} needs strategy 'group', not {self.strategy!r}")
        if self.dynamic not in DYNAMICS:
            raise ValueError(f"dynamic={self.dynamic!r} is not supported; allowed: False, True, {LOCAL!r}")
        if self.dynamic == LOCAL and self.strategy != "tensor_group":
            raise ValueError(f"dynamic={LOCAL!r} needs strategy 'tensor_group', not {self.strategy!r}")
        if self.actorder not in (None, "static"):
            raise ValueError(f"actorder={self.actorder!r} is not supported; allowed: None, 'static'")

    @property
    def qmin(self) -> int:
        self._integer_grid()
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        self._integer_grid()
        return (1 << (self.num_bits - 1)) - 1

    def _integer_grid(self) -> None:
        if self.type != "int":
            raise ValueError(f"{self.type} {self.num_bits}-bit values have no integer grid [qmin, qmax]")

    def groups(self, in_features: int) -> int:
        """Number of groups along K; raises ValueError if the group size does not divide K."""
        if self.strategy not in GROUPED:
            return 1
        if in_features % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} does not divide in_features={in_features}; "
                f"choose a group size that divides it (e.g. {_divisors_hint(in_features)})"
            )
        return in_features // self.group_size

    def to_compressed_tensors(self) -> dict:
        """This tensor's entry of a compressed-tensors config group (``weights``, ``input_activations``)."""
        return {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "strategy": self.strategy,
            "group_size": self.group_size,
            "dynamic": self.dynamic,
            "actorder": "weight" if self.actorder == "static" else None,
            "observer": None if self.dynamic else "minmax",
            "observer_kwargs": {},
            "block_structure": None,
        }

    @classmethod
    def from_compressed_tensors(cls, d: dict) -> "QuantArgs":
        """Inverse of to_compressed_tensors; ValueError for what these arguments cannot express
        (a format may refuse more: formats/codec.py)."""
        kind = d.get("type", "int")
        if kind not in TYPES:
            raise ValueError(f"type {kind!r} is not supported; allowed: {', '.join(TYPES)}")
        strategy = d.get("strategy", "group")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not supported; allowed: {', '.join(STRATEGIES)}")
        # compressed-tensors' ActivationOrdering: "static" is an alias of "weight", "dynamic" of "group"
        actorder = {"static": "weight", "dynamic": "group"}.get(d.get("actorder"), d.get("actorder"))
        if actorder not in (None, "weight"):
            raise ValueError(f"actorder {d.get('actorder')!r} is not supported; allowed: None, 'weight' ('static'); "
                             "'group' ('dynamic') needs g_idx")
        dynamic = d.get("dynamic", False)
        if isinstance(dynamic, str) and dynamic.lower() == LOCAL:
            dynamic = LOCAL
        elif dynamic not in (True, False):
            raise ValueError(f"dynamic {dynamic!r} is not supported; allowed: true, false, {LOCAL!r}")
        return cls(
            num_bits=int(d["num_bits"]),
            group_size=d.get("group_size") if strategy in GROUPED else None,
            symmetric=bool(d.get("symmetric", True)),
            actorder="static" if actorder == "weight" else None,
            type=kind,
            strategy=strategy,
            dynamic=dynamic if dynamic == LOCAL else bool(dynamic),
        )


def _divisors_hint(k: int) -> str:
    ok = [g for g in GROUP_SIZES if k % g == 0]
    return ", ".join(map(str, ok)) if ok else "a divisor of it that is a multiple of 8"
