"""QuantizeConfig: every knob of one `optllm quantize` run, validated on construction.

A recipe file (YAML) holds the same fields, or steps that stand for them (quant/recipe.py);
CLI flags override it. A field left out (None) takes its default; the group size's default is
the scheme's own, filled in on construction, and per-channel is spelled "channel"
(formats.args.CHANNEL), never None.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..formats.args import CHANNEL, GROUP_SIZES
from .algorithm import ALGORITHMS
from .awq import AWQOptions
from .fp8 import FP8Options
from .kv_cache import kv_cache_scheme
from .mixed import DEFAULT_CANDIDATES, override_candidate, parse_candidates
from .recipe import check_overrides, check_types, compile_steps
from .scheme import QuantScheme, available_schemes, parse_scheme
from .sensitivity import METRICS
from .smoothquant import SmoothQuantOptions

CHECKPOINT_DTYPES = ("bfloat16", "float16")
OFFLOAD_MODES = ("auto", "always", "never")
# offload="auto" keeps the calibration activations on the CPU when one copy of them (tokens x
# hidden size x 4 bytes) reaches this: 128 x 512 tokens of an 8B model (hidden 4096) do
OFFLOAD_AUTO_BYTES = 1 << 30
MAX_BITS = 16  # mixed precision: an average above bf16's bits per weight means nothing


@dataclass(frozen=True)
class QuantizeConfig:
    scheme: str = "w4a16-rtn"
    # the weights' group size: a positive multiple of 8, "channel" (one scale per output
    # channel), or None on construction: the scheme's own (128 for the w*a16 schemes)
    group_size: int | str | None = None
    # the weights' grid: None on construction: the scheme's own (asymmetric for w4a16-* / w3a16-*,
    # symmetric for 8-bit and float schemes); measured out of domain (docs/BENCHMARKS.md, issue 12)
    symmetric: bool | None = None
    # GPTQ column order: "static" (act-order with static groups; the default for GPTQ, as in
    # llm-compressor: it measured 18.4 vs 19.3-19.9 ppl on SmolLM2 W4 g64) or None
    actorder: str | None = "auto"
    ignore: tuple[str, ...] = ("lm_head",)
    calib: str = "builtin"
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    batch_size: int = 8
    device: str = "auto"
    dtype: str = "bfloat16"  # of the checkpoint's scales and unquantized tensors
    # GPTQ's options (gptq.GPTQOptions): dampening, gptq_block_size, true_sequential, token_cap,
    # hessian_shrink
    dampening: float = 0.01  # GPTQ, fraction of mean(diag H)
    gptq_block_size: int = 128
    true_sequential: bool = True  # GPTQ: Hessians of later linears see earlier ones quantized
    # GPTQ: weight of a token of massive activations in the Hessian, in typical tokens
    # (HessianAccumulator token_cap; None: unweighted, as the paper). Measured on SmolLM2 W4 g64
    # sym, 16 x 256 docs calibration (benchmarks/quality.py, docs/BENCHMARKS.md): unweighted
    # GPTQ closes 59% of RTN's gap on held-out docs and -2% on code; with 16, 68% and 38%
    # (4: 73% and 46%); with 16 and hessian_shrink 0.3, 84% and 60%
    token_cap: float | None = 16.0
    # GPTQ: H <- (1 - shrink) H + shrink diag(H) (trust the inputs' correlations less)
    hessian_shrink: float = 0.3
    # GPTQ: each group's grid, "minmax" | "mse" | "hmse" (gptq.GPTQOptions.grid). Measured, SmolLM2
    # W4 g64 asym, every window of docs / code / chat: 128 x 512, gap to RTN closed 72 / 74 / 51%
    # (minmax) -> 79 / 76 / 60% (hmse); 16 x 256, 74 / 70 / 50% -> 80 / 77 / 54% (mse: 75 / 70 / 55%)
    gptq_grid: str = "hmse"
    # where the calibration activations (block inputs, float outputs, AWQ's captured inputs)
    # live while one block is on the device: "auto" (the CPU past OFFLOAD_AUTO_BYTES per
    # copy), "always" (the CPU), "never" (the device); a batch at a time goes to the device
    offload: str = "auto"
    # calibration windows held out of every fit (drawn after the num_samples fit windows):
    # each block's output error on them, quantized by the algorithm and by RTN, goes into the
    # report ("auto": max(2, num_samples // 8); 0: none)
    holdout: int | str = "auto"
    fallback_rtn: bool = False  # keep RTN for a block whose held-out error is lower with it
    # the KV cache's quantization, calibrated with the weights (quant/kv_cache.py): None (not
    # quantized), "fp8" (E4M3, one static scale per layer for K and one for V) or "fp8-head"
    # (one per KV head); written as the checkpoint's kv_cache_scheme, which the runtime honours
    kv_cache: str | None = None
    # mixed precision (quant/mixed.py): the average bits per quantized weight to reach, choosing
    # per linear among mixed_candidates (None: every linear takes the scheme's weights); its
    # sensitivity pass runs on about mixed_tokens calibration tokens
    target_bits: float | None = None
    mixed_candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    mixed_tokens: int = 4096
    # how a candidate's cost is measured (quant/sensitivity.py): "fisher" (the change of each block's
    # output weighted by the loss's gradient there: nats per token) or "output" (the change itself)
    mixed_sensitivity: str = "fisher"
    # per-module weights: module pattern (exact name or suffix, or re:regex) -> {num_bits,
    # group_size, symmetric} over the scheme's; the first pattern that matches a linear wins
    overrides: dict = field(default_factory=dict)
    awq: AWQOptions = field(default_factory=AWQOptions)
    # the w8a8-int8 schemes' smoothing and weight quantizer (smoothquant.SmoothQuantOptions)
    smoothquant: SmoothQuantOptions = field(default_factory=SmoothQuantOptions)
    # the fp8 schemes' weight quantizer on the E4M3 grid (fp8.FP8Options: rtn or gptq)
    fp8: FP8Options = field(default_factory=FP8Options)

    def __post_init__(self) -> None:
        self._check_group_size()
        for name in ("num_samples", "seq_len", "batch_size", "gptq_block_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be >= 1")
        try:
            scheme = self.quant_scheme()
            # each algorithm's options, so a bad value is refused whatever the scheme
            for algorithm in ALGORITHMS.values():
                algorithm.options(self)
        except ValueError as e:
            raise UserError(str(e)) from None
        if self.group_size is None:  # the scheme's own, stated, so the report says what was used
            w = scheme.weights
            object.__setattr__(self, "group_size", w.group_size if w.strategy == "group" else
                               CHANNEL if w.strategy == CHANNEL else None)
        if self.seq_len < 8:
            raise UserError(f"seq_len={self.seq_len} must be >= 8")
        if self.dtype not in CHECKPOINT_DTYPES:
            raise UserError(f"dtype={self.dtype!r} is not allowed; allowed: {', '.join(CHECKPOINT_DTYPES)}")
        if not (self.holdout == "auto" or (isinstance(self.holdout, int) and self.holdout >= 0)):
            raise UserError(f"holdout={self.holdout!r} is not allowed; allowed: auto or a number of windows >= 0")
        if self.fallback_rtn and self.holdout == 0:
            raise UserError("fallback_rtn needs held-out windows (holdout > 0)")
        if self.kv_cache == "none":
            object.__setattr__(self, "kv_cache", None)
        try:
            kv_cache_scheme(self.kv_cache)
        except ValueError as e:
            raise UserError(str(e)) from None
        if self.offload not in OFFLOAD_MODES:
            raise UserError(f"offload={self.offload!r} is not allowed; allowed: {', '.join(OFFLOAD_MODES)}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise UserError(f"device={self.device!r} is not allowed; allowed: auto, cpu, cuda, cuda:N")
        self._check_mixed(scheme)

    def _check_mixed(self, scheme: QuantScheme) -> None:
        t = self.target_bits
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= MAX_BITS):
            raise UserError(f"target_bits={t!r} is not allowed; allowed: a number of bits per weight up to "
                            f"{MAX_BITS}, e.g. 4.5")
        if isinstance(self.mixed_candidates, str):
            object.__setattr__(self, "mixed_candidates", tuple(c for c in self.mixed_candidates.split(",") if c))
        object.__setattr__(self, "mixed_candidates", tuple(str(c).strip().lower() for c in self.mixed_candidates))
        if isinstance(self.mixed_tokens, bool) or not isinstance(self.mixed_tokens, int) or self.mixed_tokens < 1:
            raise UserError(f"mixed_tokens={self.mixed_tokens!r} must be a number of tokens >= 1")
        object.__setattr__(self, "overrides", check_overrides(self.overrides))
        if self.mixed_sensitivity not in METRICS:
            raise UserError(f"mixed_sensitivity={self.mixed_sensitivity!r} is not allowed; "
                            f"allowed: {', '.join(METRICS)}")
        if t is None and self.mixed_candidates != DEFAULT_CANDIDATES:
            raise UserError("mixed_candidates choose among schemes for target_bits; give target_bits too")
        if t is None and not self.overrides:
            return
        what = "target_bits (mixed precision)" if t is not None else "overrides"
        if scheme.format != "pack-quantized" or scheme.input_activations is not None:
            raise UserError(f"{what} needs a weight-only integer scheme (w4a16-*, w8a16-*, w3a16-*), "
                            f"not {scheme.name!r}")
        try:
            menu = parse_candidates(self.mixed_candidates, scheme.weights) if t is not None else []
            for pattern, fields in self.overrides.items():
                override_candidate(pattern, fields, scheme.weights)
        except ValueError as e:
            raise UserError(str(e)) from None
        cheapest = min(menu, key=lambda c: c.bits, default=None)
        if cheapest is not None and t < cheapest.bits:  # the exact bound, shapes included, is checked on the model
            raise UserError(f"target_bits={t!r} is below the cheapest candidate ({cheapest.name}: "
                            f"{float(cheapest.bits):g} bits per weight); allowed: {float(cheapest.bits):g} to "
                            f"{MAX_BITS}, or cheaper mixed_candidates")

    def _check_group_size(self) -> None:
        g = self.group_size
        if isinstance(g, str) and g.strip().lower() == CHANNEL:
            object.__setattr__(self, "group_size", CHANNEL)
        elif not (g is None or (isinstance(g, int) and not isinstance(g, bool))):
            raise UserError(f"group_size={g!r} is not allowed; allowed: a positive multiple of 8 (usually "
                            f"{', '.join(map(str, GROUP_SIZES))}) or {CHANNEL!r} (one scale per output channel)")

    def quant_scheme(self) -> QuantScheme:
        """The scheme with this run's group size, symmetry and column order."""
        symmetric = self.symmetric
        if symmetric is None and (self.target_bits is not None or self.overrides):
            # several config groups: transformers + compressed-tensors 0.20 read those only when
            # symmetric, so a mixed or overridden run keeps the symmetric grid unless told otherwise
            symmetric = True
        return parse_scheme(self.scheme, self.group_size, symmetric, self.actorder)

    def static_inputs(self) -> bool:
        """Whether the scheme's input activations take calibrated (static) scales."""
        acts = self.quant_scheme().input_activations
        return acts is not None and not acts.dynamic

    def holdout_windows(self) -> int:
        """Held-out calibration windows: holdout, or for "auto" max(2, num_samples // 8)."""
        return max(2, self.num_samples // 8) if self.holdout == "auto" else int(self.holdout)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ignore"] = list(self.ignore)
        d["mixed_candidates"] = list(self.mixed_candidates)
        if d["group_size"] is None:  # a scheme without groups or channels (per tensor): nothing to say
            del d["group_size"]
        return d

    def to_recipe(self, note: str = "") -> str:
        """This configuration as a recipe (YAML) that from_recipe reads back to an equal one;
        note: comment lines put first."""
        import yaml

        head = "".join(f"# {line}\n" for line in note.splitlines())
        return head + yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    @classmethod
    def from_recipe(cls, path: str | Path, **overrides) -> "QuantizeConfig":
        """Read a YAML recipe (fields, or steps: quant/recipe.py); keyword overrides that are
        not None win over the file."""
        import yaml

        p = Path(path)
        if not p.is_file():
            raise UserError(f"recipe {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise UserError(f"recipe {p} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(data, dict):
            raise UserError(f"recipe {p} must be a mapping of field: value")
        if "steps" in data:
            data = compile_steps(data, f"recipe {p}")
        _check_fields(cls, data, f"recipe {p}: ")  # the file's own values, named as the file's
        for k, v in overrides.items():
            if isinstance(v, dict) and isinstance(data.get(k), dict):  # a nested options mapping: merged
                data[k] = {**data[k], **v}
            elif v is not None:
                data[k] = v
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "QuantizeConfig":
        if "steps" in data:
            data = compile_steps(data)
        _check_fields(cls, data)
        data = dict(data)
        if "group_size" in data and data["group_size"] is None:
            # null meant per-channel once; "not given" is leaving the field out
            raise UserError(f"group_size: null is ambiguous; write {CHANNEL!r} for one scale per output channel, "
                            "or leave the field out for the scheme's own group size")
        if isinstance(data.get("awq"), dict):
            try:
                data["awq"] = AWQOptions(**data["awq"])
            except (TypeError, ValueError) as e:
                raise UserError(f"awq options: {e}") from None
        if isinstance(data.get("smoothquant"), dict):
            try:
                data["smoothquant"] = SmoothQuantOptions(**data["smoothquant"])
            except (TypeError, ValueError) as e:
                raise UserError(f"smoothquant options: {e}") from None
        if isinstance(data.get("fp8"), dict):
            try:
                data["fp8"] = FP8Options(**data["fp8"])
            except (TypeError, ValueError) as e:
                raise UserError(f"fp8 options: {e}") from None
        if "ignore" in data:
            data["ignore"] = tuple(data["ignore"] or ())
        if isinstance(data.get("mixed_candidates"), list):
            data["mixed_candidates"] = tuple(data["mixed_candidates"])
        if "mixed_candidates" in data and data["mixed_candidates"] is None:
            del data["mixed_candidates"]
        if "overrides" in data and data["overrides"] is None:
            data["overrides"] = {}
        return cls(**data)


def _check_fields(cls, data: dict, where: str = "") -> None:
    """One line (starting with WHERE) for an unknown field, or a value of the wrong type, in a
    recipe's or from_dict's mapping, the awq: and smoothquant: mappings' values included."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - known)
    if unknown:
        raise UserError(f"{where}unknown config field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    if "scheme" in data and not isinstance(data["scheme"], str):
        raise UserError(f"{where}scheme={data['scheme']!r} names no scheme; allowed: {', '.join(available_schemes())}")
    check_types(cls, data, where)
    for name, options in (("awq", AWQOptions), ("smoothquant", SmoothQuantOptions), ("fp8", FP8Options)):
        if isinstance(data.get(name), dict):
            check_types(options, data[name], f"{where}{name}.")
