"""compressed-tensors checkpoints: write (atomically) and read back.

Layout of a folder: config.json with `quantization_config` (quant_method compressed-tensors,
config_groups, ignore, format, and kv_cache_scheme for an FP8 KV cache: formats/kv_cache_scheme.py),
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
) -> dict:
    """config.json's quantization_config: one config group of FMT's codec (and the KV cache's
    quantization, None: the cache stays in the model's dtype)."""
    from .. import __version__

    codec = get_codec(fmt)
    codec.check(args, input_activations)
    return {
        "quant_method": "compressed-tensors",
        "format": codec.name,
        "quantization_status": "compressed",
        "config_groups": {"group_0": codec.config_group(targets, args, input_activations)},
        "ignore": ignore,
        "kv_cache_scheme": None if kv_cache is None else kv_cache.to_compressed_tensors(),
        "global_compression_ratio": None,
        "producer": {"name": "optllm", "version": __version__},
    }


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's quantization_config says: its format, the arguments of its
    weights and input activations (None: weight-only), its targets and ignored modules, and
    its KV cache's quantization (None: not quantized)."""

    format: str
    weights: QuantArgs
    input_activations: QuantArgs | None
    targets: list[str]
    ignore: list[str]
    kv_cache: KVCacheScheme | None = None

    @property
    def codec(self) -> FormatCodec:
        return get_codec(self.format)


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
) -> Path:
    """Write the checkpoint into a temp folder beside OUT, then swap it in (folder_swap).

    Quantized linears are written by FMT's codec; `omit` names state-dict tensors not written
    (a tied LM head, whose weight is the embedding's). kv_cache: the KV cache's scheme, whose
    scales kv_scales holds by tensor name ("model.layers.0.self_attn.k_scale", ...), written in
    float32 (a scale rounded down to bf16 would clip the calibrated amax). Folders and files get
    the modes the user's umask gives any other file. The report (if given) is written as
    optllm-report.json with `vllm_loadable` and `vllm_note` added.
    """
    out = Path(out)
    codec = get_codec(fmt)
    codec.check(args, input_activations)
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
        cfg["quantization_config"] = quantization_config(args, ["Linear"], ignore, fmt, input_activations, kv_cache)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for f in SIDE_FILES:
            if (Path(source) / f).is_file():
                # copyfile, not copy2: the copy gets the umask's mode, not the source's
                shutil.copyfile(Path(source) / f, tmp / f)
        if report is not None:
            note = codec.vllm_incompatibility(args, input_activations)
            report = {**report, "vllm_loadable": note is None, "vllm_note": note}
            (tmp / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return out


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
    codec is registered for, or arguments its codec cannot hold."""
    qc = config.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors":
        raise UserError("config.json has no compressed-tensors quantization_config")
    codec = get_codec(qc.get("format"))
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise UserError(f"checkpoint has {len(groups)} config groups; supported: exactly 1")
    group = next(iter(groups.values()))
    try:
        weights = QuantArgs.from_compressed_tensors(group["weights"])
        acts = group.get("input_activations")
        acts = None if acts is None else QuantArgs.from_compressed_tensors(acts)
        codec.check(weights, acts)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"unsupported weight quantization in config.json: {e}") from None
    kv = qc.get("kv_cache_scheme")
    try:
        kv = None if kv is None else KVCacheScheme.from_compressed_tensors(kv)
    except ValueError as e:
        raise UserError(f"unsupported KV cache quantization in config.json: {e}") from None
    return CheckpointQuant(codec.name, weights, acts, list(group.get("targets", [])), list(qc.get("ignore") or []),
                           kv)


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
    codec = quant.codec
    sd = read_state_dict(folder)
    qweights = {}
    for name in quantized_modules(sd, codec):
        parts = {t: sd.pop(f"{name}.{t}") for t in codec.tensor_names if f"{name}.{t}" in sd}
        try:
            qweights[name] = codec.decode(parts, quant.weights)
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
