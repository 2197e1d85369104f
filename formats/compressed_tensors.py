"""compressed-tensors checkpoints: write (atomically) and read back.

Layout of a folder: config.json with `quantization_config` (quant_method compressed-tensors,
config_groups, ignore, format, and kv_cache_scheme for an FP8 KV cache: formats/kv_cache_scheme.py),
one config group (targets ``Linear``) or several (mixed precision: each targets its modules by
name; a module takes the group compressed-tensors and vLLM would give it: ConfigGroup, group_of),
model*.safetensors where each quantized linear holds the tensors its format's codec gives it
(formats/codec.py; `pack-quantized`: X.weight_packed, X.weight_scale, X.weight_shape,
X.weight_zero_point), each attention module its KV cache scales (X.k_scale, X.v_scale) when
the KV cache is quantized, and every other tensor is stored as is.
Tokenizer and generation config are copied from the source folder. Writing and reading go
through the codec the format names, so this file knows no format's tensors.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import UserError
from .args import QuantArgs
from .codec import FormatCodec, get_codec
from .folder_swap import recover, replacing
from .kv_cache_scheme import KV_SCALE_NAMES, KVCacheScheme
from .qweight import QuantizedWeight

SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json",
)
SHARD_BYTES = 4 * 1024**3
REPORT_NAME = "optllm-report.json"
log = logging.getLogger("optllm.formats")


def quantization_config(
    args: QuantArgs,
    targets: list[str],
    ignore: list[str],
    fmt: str = "pack-quantized",
    input_activations: QuantArgs | None = None,
    kv_cache: KVCacheScheme | None = None,
    groups: list[tuple[list[str], QuantArgs]] | None = None,
) -> dict:
    """config.json's quantization_config: one config group of FMT's codec (and the KV cache's
    quantization, None: the cache stays in the model's dtype). groups: several config groups
    instead (mixed precision), each (its targets, its weights' arguments), all of FMT."""
    from .. import __version__

    codec = get_codec(fmt)
    groups = [(targets, args)] if groups is None else groups
    for _targets, a in groups:
        codec.check(a, input_activations)
    return {
        "quant_method": "compressed-tensors",
        "format": codec.name,
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": codec.config_group(t, a, input_activations)
                          for i, (t, a) in enumerate(groups)},
        "ignore": ignore,
        "kv_cache_scheme": None if kv_cache is None else kv_cache.to_compressed_tensors(),
        "global_compression_ratio": None,
        "producer": {"name": "optllm", "version": __version__},
    }


@dataclass(frozen=True)
class ConfigGroup:
    """One entry of quantization_config.config_groups: the modules it targets (exact names,
    ``re:`` patterns, or the class name ``Linear``), their weights' and input activations'
    arguments and the format of their tensors."""

    name: str
    targets: tuple[str, ...]
    weights: QuantArgs
    input_activations: QuantArgs | None
    format: str

    @property
    def codec(self) -> FormatCodec:
        return get_codec(self.format)


MIXED_FORMAT = "mixed-precision"  # a top-level format that leaves each config group its own
CLASS_TARGETS = ("Linear",)  # the class-name targets a module name cannot show: every linear matches


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's quantization_config says: its format, the arguments of its
    weights and input activations (None: weight-only), its targets and ignored modules, and
    its KV cache's quantization (None: not quantized). With several config groups (mixed
    precision) format, weights, input_activations and targets are the first group's; `groups`
    holds them all and group_of says which one a module takes."""

    format: str
    weights: QuantArgs
    input_activations: QuantArgs | None
    targets: list[str]
    ignore: list[str]
    kv_cache: KVCacheScheme | None = None
    groups: tuple[ConfigGroup, ...] = ()

    @property
    def codec(self) -> FormatCodec:
        return get_codec(self.format)

    @property
    def mixed(self) -> bool:
        return len(self.groups) > 1

    def group_of(self, module: str) -> ConfigGroup | None:
        """The config group of a linear named MODULE (None: ignored, or targeted by no group),
        as compressed-tensors and vLLM choose it: an exact name first, then a ``re:`` pattern,
        then a class name; among targets of one kind, the first in sorted order. A checkpoint
        of one group quantizes every linear it does not ignore (its targets are ``Linear``)."""
        if matches(module, self.ignore):
            return None
        if len(self.groups) == 1:
            return self.groups[0]
        ranked = []
        for g in self.groups:
            for t in g.targets:
                if t.startswith("re:"):
                    hit, kind = re.match(t[3:], module) is not None, 1
                elif t in CLASS_TARGETS:
                    hit, kind = True, 2
                else:
                    hit, kind = t == module, 0
                if hit:
                    ranked.append((kind, t, g.name))
        if not ranked:
            return None
        name = min(ranked)[2]
        return next(g for g in self.groups if g.name == name)


def is_checkpoint_folder(folder: str | Path) -> bool:
    """True for a folder --overwrite may replace: one of ours (optllm-report.json, or a
    compressed-tensors quantization_config) or an HF model folder (config.json with
    *.safetensors or *.bin weights)."""
    folder = Path(folder)
    if (folder / REPORT_NAME).is_file() or is_quantized_folder(folder):
        return True
    if not (folder / "config.json").is_file():
        return False
    return any(p.is_file() for pattern in ("*.safetensors", "*.bin") for p in folder.glob(pattern))


def check_writable(out: Path, overwrite: bool, source: Path | None = None) -> str | None:
    """Fail early (before hours of calibration) if OUT cannot be written.

    OUT may be missing or an empty folder; with `overwrite`, also a checkpoint folder
    (is_checkpoint_folder). Anything else (a file, a link, a mount point, a folder with other
    files, the model being quantized) is refused with a UserError of one line. First repairs
    what an interrupted write of OUT left beside it (folder_swap.recover) and returns that
    one-line note (also logged as a warning), or None.
    """
    out = Path(out)
    note = recover(out)
    if note:
        log.warning(note)
    allowed = "--out must be a new or empty folder, or a checkpoint folder with --overwrite"
    if os.path.lexists(out):
        if out.is_symlink():
            raise UserError(f"{out} is a symbolic link; {allowed} (pass the folder it points to)")
        if not out.is_dir():
            raise UserError(f"{out} is a file, not a folder; {allowed}")
        if os.path.ismount(out):
            raise UserError(f"{out} is a mount point, which cannot be replaced; write to a folder inside it")
        if any(out.iterdir()):
            if not is_checkpoint_folder(out):
                raise UserError(
                    f"{out} holds files and is not a checkpoint (no {REPORT_NAME}, no config.json with "
                    f"*.safetensors or *.bin weights); {allowed}"
                )
            if not overwrite:
                raise UserError(f"{out} already exists; pass --overwrite to replace it")
            if source is not None and Path(source).exists() and os.path.samefile(out, source):
                raise UserError(f"{out} is the model being quantized; choose another --out")
    parent = out.parent if out.parent != Path("") else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=parent, prefix=".optllm-probe-", delete=True)
        probe.close()
    except OSError as e:
        raise UserError(f"cannot write to {parent}: {e.strerror or e}") from None
    return note


def save_quantized(
    model: nn.Module,
    qweights: dict[str, QuantizedWeight],
    args: QuantArgs,
    out: Path,
    source: Path,
    dtype: torch.dtype,
    ignore: list[str],
    report: dict | None = None,
    overwrite: bool = False,
    fmt: str = "pack-quantized",
    input_activations: QuantArgs | None = None,
    omit: Collection[str] = (),
    kv_cache: KVCacheScheme | None = None,
    kv_scales: dict[str, torch.Tensor] | None = None,
    module_args: dict[str, QuantArgs] | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write the checkpoint into a temp folder beside OUT, then swap it in (folder_swap).

    module_args: each quantized linear's weight arguments where they differ from `args`
    (mixed precision; None: all `args`); linears of several arguments are written as one
    config group per arguments, each targeting its modules by name, and a run where every
    linear has `args` as the one group targeting ``Linear``, as before. extra_files: more text
    files of the folder by name (the recipe), written with it.

    Quantized linears are written by FMT's codec; `omit` names state-dict tensors not written
    (a tied LM head, whose weight is the embedding's). kv_cache: the KV cache's scheme, whose
    scales kv_scales holds by tensor name ("model.layers.0.self_attn.k_scale", ...), written in
    float32 (a scale rounded down to bf16 would clip the calibrated amax). Folders and files get
    the modes the user's umask gives any other file. The report (if given) is written as
    optllm-report.json with `vllm_loadable` and `vllm_note` added.
    """
    out = Path(out)
    codec = get_codec(fmt)
    groups = config_groups(qweights, args, module_args)
    for _targets, a in groups or [([], args)]:
        codec.check(a, input_activations)
    kv_scales = dict(kv_scales or {})
    if (kv_cache is None) != (not kv_scales) or any(k.rpartition(".")[2] not in KV_SCALE_NAMES for k in kv_scales):
        raise ValueError(f"kv_scales: {KV_SCALE_NAMES} tensors go with a kv_cache scheme, and only they; got "
                         f"kv_cache={kv_cache}, {len(kv_scales)} tensors")
    check_writable(out, overwrite, source)
    with replacing(out) as tmp:
        tensors: dict[str, torch.Tensor] = {}
        for name, t in model.state_dict().items():
            mod, _, leaf = name.rpartition(".")
            if (mod in qweights and leaf == "weight") or name in omit:
                continue
            tensors[name] = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
        for name, qw in qweights.items():
            for k, v in codec.encode(qw).items():
                tensors[f"{name}.{k}"] = v.detach().cpu().contiguous()
        tensors.update({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in kv_scales.items()})
        _write_shards(tensors, tmp)
        cfg = model.config.to_dict()
        cfg["torch_dtype"] = cfg["dtype"] = str(dtype).replace("torch.", "")
        cfg["quantization_config"] = quantization_config(args, ["Linear"], ignore, fmt, input_activations, kv_cache,
                                                         groups=groups)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        for f in SIDE_FILES:
            if (Path(source) / f).is_file():
                # copyfile, not copy2: the copy gets the umask's mode, not the source's
                shutil.copyfile(Path(source) / f, tmp / f)
        if report is not None:
            notes = {codec.vllm_incompatibility(a, input_activations) for _t, a in groups or [([], args)]} - {None}
            note = " ".join(sorted(notes)) or None
            report = {**report, "vllm_loadable": note is None, "vllm_note": note}
            (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return out


def config_groups(qweights: dict[str, QuantizedWeight], args: QuantArgs,
                  module_args: dict[str, QuantArgs] | None) -> list[tuple[list[str], QuantArgs]] | None:
    """The config groups of a checkpoint whose linears have `module_args` (the others `args`):
    None when every quantized linear has `args` (the one group targeting ``Linear``), else one
    (sorted module names, arguments) per arguments, in the order of their first module."""
    module_args = module_args or {}
    unknown = sorted(set(module_args) - set(qweights))
    if unknown:
        raise ValueError(f"module_args names {unknown[0]}, which is not a quantized linear")
    by_args: dict[QuantArgs, list[str]] = {}
    for name in sorted(qweights):
        by_args.setdefault(module_args.get(name, args), []).append(name)
    if set(by_args) <= {args}:
        return None
    return [(names, a) for a, names in by_args.items()]


def _write_shards(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors folder; corrupt files are one clear error."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} holds no .safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{f} is not a valid safetensors file ({str(e).splitlines()[0]})") from None
    return sd


def is_quantized_folder(folder: str | Path) -> bool:
    """True when FOLDER's config.json names a compressed-tensors quantization_config."""
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return False
    try:
        qc = json.loads(cfg.read_text()).get("quantization_config", {})
        return bool(qc.get("quant_method") == "compressed-tensors")
    except (json.JSONDecodeError, AttributeError):
        return False


def read_quantization(config: dict) -> CheckpointQuant:
    """The quantization a compressed-tensors config.json declares; UserError for a format no
    codec is registered for, or arguments its codec cannot hold. The config groups' format is
    the top level's ``format``, or each group's own when that says "mixed-precision"."""
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        raise UserError("config.json has no compressed-tensors quantization_config")
    raw_groups = qc.get("config_groups") or {}
    if not raw_groups:
        raise UserError("checkpoint has 0 config groups; supported: 1 or more")
    groups = []
    for name, group in raw_groups.items():
        if not isinstance(group, dict):
            raise UserError(f"config group {name!r} in config.json is not a mapping")
        top = qc.get("format")
        codec = get_codec(group.get("format") if top in (None, MIXED_FORMAT) else top)
        try:
            weights = QuantArgs.from_compressed_tensors(group["weights"])
            acts = group.get("input_activations")
            acts = None if acts is None else QuantArgs.from_compressed_tensors(acts)
            codec.check(weights, acts)
        except (KeyError, TypeError, ValueError) as e:
            where = "" if len(raw_groups) == 1 else f" (config group {name!r})"
            raise UserError(f"unsupported weight quantization in config.json{where}: {e}") from None
        targets = group.get("targets", [])
        if isinstance(targets, str):
            targets = [targets]
        groups.append(ConfigGroup(name, tuple(targets), weights, acts, codec.name))
    kv = qc.get("kv_cache_scheme")
    try:
        kv = None if kv is None else KVCacheScheme.from_compressed_tensors(kv)
    except ValueError as e:
        raise UserError(f"unsupported KV cache quantization in config.json: {e}") from None
    first = groups[0]
    return CheckpointQuant(first.format, first.weights, first.input_activations, list(first.targets),
                           list(qc.get("ignore") or []), kv, tuple(groups))


def quantized_modules(sd: dict[str, torch.Tensor], codec: FormatCodec) -> list[str]:
    """Modules of a state dict that hold the codec's tensors (its first tensor marks them)."""
    marker = "." + codec.tensor_names[0]
    return sorted(k[: -len(marker)] for k in sd if k.endswith(marker))


def load_quantized_weights(folder: Path) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor], dict]:
    """(quantized linears by module name, the other tensors, config.json) of a checkpoint."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{folder} has no config.json")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_path} is not valid JSON: {e}") from None
    quant = read_quantization(config)
    sd = read_state_dict(folder)
    qweights = {}
    for codec in {g.format: g.codec for g in quant.groups}.values():
        for name in quantized_modules(sd, codec):
            group = quant.group_of(name)
            if group is None or group.format != codec.name:
                raise UserError(f"{folder}: {name} holds {codec.name} tensors but no {codec.name} config group "
                                "of config.json targets it")
            parts = {t: sd.pop(f"{name}.{t}") for t in codec.tensor_names if f"{name}.{t}" in sd}
            try:
                qweights[name] = codec.decode(parts, group.weights)
            except ValueError as e:
                raise UserError(f"{folder}: {name}: {e}") from None
    return qweights, sd, config


def matches(name: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """compressed-tensors target/ignore matching: exact name, or `re:` regular expression."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False
