"""Build the runtime's model for a folder and fill it from the checkpoint.

MODEL is an HF folder (safetensors), a built-in alias (hub/), or a compressed-tensors
checkpoint ``optllm quantize`` wrote (read through formats/). Tensors are read one
safetensors file at a time; each goes to the layer that owns it, whose weight loader cuts
its tensor-parallel shard and places it (fused QKV / gate-up shards included), so this file
only maps names. Quantized linears arrive as the tensors of the checkpoint's format, which its
codec (formats/codec.py, chosen by the format's name) turns into integer codes, scales and
zero points; each linear's method then repacks or dequantizes them. A checkpoint whose
kv_cache_scheme quantizes the KV cache carries each attention's calibrated K and V scales
(``{block}.self_attn.k_scale``, ``.v_scale``); they go to the runtime's attention layers, whose
FP8 cache then stores with them (formats/kv_cache_scheme.py, runtime/kv_cache.py).

A checkpoint of several config groups (mixed precision: some linears W4 g64, others W8...)
gives each linear the QuantSpec of the group that targets it (CheckpointQuant.group_of, the
precedence compressed-tensors and vLLM apply): the model is built with MixedBuildOptions, and
each module's tensors are read with its own group's codec and arguments. A checkpoint of one
group is read exactly as before.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import UserError
from ..formats.codec import get_codec, quantized_tensor_names
from ..formats.compressed_tensors import REPORT_NAME, CheckpointQuant, is_quantized_folder, read_quantization
from ..formats.kv_cache_scheme import KV_SCALE_NAMES, KVCacheScheme
from ..hub.loader import check_architecture, resolve_model
from .layers.linear_methods import DenseMethod, QuantSpec, linear_method, unserved
from .layers.parallel import SINGLE
from .models.llama import BuildOptions
from .models.registry import model_class

_SKIPPED = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry
_DENSE = {"weight", "bias"}  # the tensors of an unquantized module


@dataclass(frozen=True)
class MixedQuant:
    """The linears of a checkpoint of several config groups: each one's QuantSpec is its group's
    (specs: group name -> QuantSpec)."""

    checkpoint: CheckpointQuant
    specs: dict

    def spec_for(self, hf_name: str) -> QuantSpec | None:
        """The QuantSpec of the linear HF_NAME; None: it stays dense (ignored, or no group targets it)."""
        group = self.checkpoint.group_of(hf_name)
        return None if group is None else self.specs[group.name]

    def formats(self) -> set[str]:
        return {spec.format for spec in self.specs.values()}


@dataclass(frozen=True)
class MixedBuildOptions(BuildOptions):
    """BuildOptions whose linears each take their own config group's QuantSpec."""

    mixed: MixedQuant | None = None

    def linear(self, hf_names: list[str], in_features: int):
        specs = [self.mixed.spec_for(n) for n in hf_names]
        if any(spec != specs[0] for spec in specs[1:]):
            raise UserError(f"{', '.join(hf_names)} are fused into one linear but the checkpoint's config groups "
                            "quantize them differently (vLLM refuses this too); give them one group")
        return linear_method(specs[0], hf_names, in_features, self.backend)


@dataclass(frozen=True)
class ModelSource:
    """A resolved model folder: its HF config (quantization_config removed), the raw
    config.json dict, the quantization it carries (None: dense; with several config groups,
    the first group's) and its KV cache's (None: not quantized; else an FP8 cache with the
    checkpoint's static scales); mixed: every group's, for a checkpoint of several (None: one
    group, or dense)."""

    folder: Path
    config: object
    raw: dict
    quant: QuantSpec | None
    kv_cache: KVCacheScheme | None = None
    mixed: MixedQuant | None = None


def read_source(model: str | Path, quantized_linear: str = "kernel") -> ModelSource:
    from transformers import AutoConfig

    folder = resolve_model(model)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {folder / 'config.json'}: {e}") from None
    quant = kv_cache = mixed = None
    if raw.get("quantization_config"):
        q = read_quantization(raw)
        kv_cache = q.kv_cache
        scale_dtype = _dtype_of(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16")
        specs = {}
        for g in q.groups:
            why = unserved(g.weights, g.input_activations)
            if why:
                raise UserError(f"{folder}: {why} ({g.format}{f', config group {g.name}' if q.mixed else ''})")
            specs[g.name] = QuantSpec(g.weights, tuple(q.ignore), scale_dtype, quantized_linear, g.format,
                                      g.input_activations)
        quant = specs[q.groups[0].name]
        mixed = MixedQuant(q, specs) if q.mixed else None
    clean = {k: v for k, v in raw.items() if k != "quantization_config"}
    if "model_type" not in clean:
        raise UserError(f"{folder / 'config.json'} has no model_type")
    try:
        config = AutoConfig.for_model(**clean)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"cannot read the model config in {folder}: {e}") from None
    check_architecture(config)
    return ModelSource(folder, config, raw, quant, kv_cache, mixed)


def checkpoint_kind(folder: Path) -> str:
    """A label for reports: a quantized checkpoint's scheme ("quantized" without a report),
    "float", or, for a model converted from a GGUF (the built-in alias), what its weights
    really are: a dequantized GGUF quantization, e.g. "float (dequantized Q4_1 GGUF)"."""
    folder = Path(folder)
    rep = folder / REPORT_NAME
    if rep.is_file():
        try:
            report = json.loads(rep.read_text())
        except json.JSONDecodeError:
            return "quantized"
        scheme = str(report.get("scheme", "quantized"))
        bits = (report.get("mixed") or {}).get("average_bits")
        return scheme if bits is None else f"{scheme} mixed {bits:.2f} bits"
    if is_quantized_folder(folder):
        return "quantized"
    src = folder / "optllm-source.json"
    if src.is_file():
        try:
            gguf = str(json.loads(src.read_text()).get("gguf", ""))
        except json.JSONDecodeError:
            gguf = ""
        if gguf:
            kind = next((q for q in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")
                         if q.lower() in Path(gguf).name.lower()), "")
            return f"float (dequantized {kind + ' ' if kind else ''}GGUF)"
    return "float"


def build_model(source: ModelSource, opt: BuildOptions):
    cls = model_class(source.config)
    if source.mixed is not None:  # each linear its own config group's QuantSpec
        opt = MixedBuildOptions(**{f.name: getattr(opt, f.name) for f in dataclasses.fields(BuildOptions)},
                                mixed=source.mixed)
    with torch.device(opt.device):  # buffers the layers create without a device land there too
        model = cls(source.config, opt)
    model.quant = source.quant
    model.mixed_quant = source.mixed
    model.kv_cache_scheme = source.kv_cache
    return model


def load_weights(model, folder: Path) -> None:
    """Fill every parameter of ``model`` from the safetensors files in ``folder``, then let
    each layer process its weights (repack / dequantize). UserError on a missing, extra or
    mis-shaped tensor."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} holds no .safetensors files")
    modules = dict(model.named_modules())
    pending: dict[str, dict[str, torch.Tensor]] = {}  # quantized modules whose parts straddle files
    quant = _quant_of(model)
    mixed = getattr(model, "mixed_quant", None)
    # a dense model's config: any format's tensor but a dense one is a quantized module without a config
    formats = set() if quant is None else {quant.format} if mixed is None else mixed.formats()
    parts_of = set().union(*(get_codec(f).tensor_names for f in formats)) if formats else \
        quantized_tensor_names() - _DENSE
    kv_scheme = getattr(model, "kv_cache_scheme", None)
    kv_layers = _kv_scale_owners(model) if kv_scheme is not None else {}
    kv_loaded: set[str] = set()
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    if name.endswith(_SKIPPED):
                        continue
                    module, _, leaf = name.rpartition(".")
                    if leaf in KV_SCALE_NAMES and module in kv_layers:
                        _load_kv_scale(kv_layers[module], name, leaf, sf.get_tensor(name), kv_scheme)
                        kv_loaded.add(name)
                        continue
                    # a format's tensor named as a dense one (float-quantized's .weight) is a part
                    # only of a linear the model quantizes
                    if leaf in parts_of and (leaf not in _DENSE or _quantized_linear(modules, model, module)):
                        parts = pending.setdefault(module, {})
                        parts[leaf] = sf.get_tensor(name)
                        spec = quant if mixed is None else mixed.spec_for(module)
                        if _complete(parts, spec):
                            _load_quantized(modules, model, module, pending.pop(module), spec, mixed is not None)
                        continue
                    _load_one(modules, model, module, leaf, sf.get_tensor(name))
        except (SafetensorError, OSError) as e:
            raise UserError(f"{f} is not a valid safetensors file ({str(e).splitlines()[0]})") from None
    if pending:
        raise UserError(f"{folder}: incomplete quantized weights for {sorted(pending)[:3]}")
    missing = sorted(f"{m}.{n}" for m in kv_layers for n in KV_SCALE_NAMES if f"{m}.{n}" not in kv_loaded)
    if missing:
        raise UserError(f"{folder}: config.json's kv_cache_scheme needs every attention's K and V scales; "
                        f"{len(missing)} missing, e.g. {', '.join(missing[:3])}")
    finish_loading(model, folder)


def finish_loading(model, what) -> None:
    missing = []
    for name, mod in model.named_modules():
        if hasattr(mod, "expected_loads"):
            missing += [f"{name}.{p}" + ("" if s is None else f"[{s}]") for p, s in mod.expected_loads() - mod.loaded]
    if missing:
        raise UserError(f"{what}: checkpoint lacks {len(missing)} tensors, e.g. {', '.join(sorted(missing)[:3])}")
    for mod in model.modules():
        if hasattr(mod, "process_weights_after_loading"):
            mod.process_weights_after_loading()


def init_random_weights(model, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks (no checkpoint): floats ~ N(0, std), norms ~ 1, int4
    codes uniform in [-8, 7] with scales that give the weights the same spread."""
    gens: dict = {}
    for mod in model.modules():
        if not hasattr(mod, "expected_loads"):
            continue
        for pname in sorted({p for p, _ in mod.expected_loads() - mod.loaded}):
            p = getattr(mod, pname)
            g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            if p.dtype == torch.int8:
                p.data.copy_(torch.randint(-8, 8, p.shape, generator=g, device=p.device, dtype=torch.int8))
            elif pname == "scales":
                p.data.fill_(std / 4.6)  # the std of uniform codes in [-8, 7] is 4.6
            else:
                vals = torch.randn(p.shape, generator=g, device=p.device)
                p.data.copy_(1.0 + 0.1 * vals if type(mod).__name__ == "RMSNorm" else std * vals)
            mod.loaded.update((pname, s) for s in getattr(mod, "shard_ids", [None]))
    finish_loading(model, "random weights")


def _quant_of(model) -> QuantSpec | None:
    return getattr(model, "quant", None)


def _complete(parts: dict, quant: QuantSpec | None) -> bool:
    if quant is None:
        return True  # refused by _load_quantized at once
    codec = get_codec(quant.format)
    return codec.required(quant.args) | codec.activation_tensors(quant.input_activations) <= parts.keys()


def _kv_scale_owners(model) -> dict:
    """HF attention module name ("model.layers.3.self_attn") -> (the runtime Attention layer
    that holds its KV cache scales, the model's KV heads, the first of them this rank holds)."""
    attn = model.arch.qkv[0].rpartition(".")[0]
    total = model.config.num_key_value_heads
    owners = {}
    for i, layer in enumerate(model.attention_layers()):
        name = f"{model.arch.block_prefix(i)}.{attn}"
        rank = getattr(getattr(model.get_submodule(name), "qkv_proj", None), "ctx", SINGLE).rank
        owners[name] = (layer, total, rank * layer.num_kv_heads)
    return owners


def _load_kv_scale(owner, name: str, leaf: str, tensor: torch.Tensor, scheme: KVCacheScheme) -> None:
    layer, total, first = owner
    try:
        scale = scheme.per_head(tensor, total)[first:first + layer.num_kv_heads]
        layer.set_static_kv_scale(leaf, scale.contiguous())
    except ValueError as e:
        raise UserError(f"{name}: {e}") from None


def _quantized_linear(modules: dict, model, module: str) -> bool:
    target, _ = _target(modules, model, module)
    method = getattr(target, "method", None)
    return method is not None and not isinstance(method, DenseMethod)


def _target(modules: dict, model, module: str):
    """(our module, shard id) of an HF module name; None for the tied LM head."""
    parent, _, last = module.rpartition(".")
    if last in model.packed_modules:
        ours, shard = model.packed_modules[last]
        module, last = f"{parent}.{ours}", None
        return modules.get(module), shard
    return modules.get(module), None


def _load_one(modules, model, module: str, leaf: str, tensor: torch.Tensor) -> None:
    if module == model.arch.lm_head and getattr(model.config, "tie_word_embeddings", False):
        return  # tied: the embedding's weight serves
    target, shard = _target(modules, model, module)
    if target is None or not hasattr(target, "weight_loader"):
        raise UserError(f"checkpoint tensor {module}.{leaf} has no place in the model")
    try:
        target.weight_loader(leaf, tensor, shard)
    except ValueError as e:
        raise UserError(f"{module}.{leaf}: {e}") from None


def _load_quantized(modules, model, module: str, parts: dict, quant: QuantSpec | None, mixed: bool = False) -> None:
    if quant is None:
        raise UserError(f"{module} is quantized but " + ("no config group of config.json targets it (or ignores it)"
                                                         if mixed else "config.json has no quantization_config"))
    try:
        qw = get_codec(quant.format).decode(parts, quant.args)
    except ValueError as e:
        raise UserError(f"{module}: {e}") from None
    n = qw.shape[0]
    _load_one(modules, model, module, "qweight", qw.q)
    # one scale for the whole module (strategy "tensor"): each of its rows gets it, so the
    # shards of a fused linear keep their own
    _load_one(modules, model, module, "scales", qw.scale.reshape(1, 1).expand(n, 1)
              if quant.args.strategy == "tensor" else qw.scale)
    if qw.zero is not None:
        _load_one(modules, model, module, "zeros", qw.zero)
    # one value per module: a static input scale; NVFP4's weight and input global scales.
    # Each row gets its module's, so the shards of a fused linear keep their own
    for per_tensor in ("input_scale", "global_scale", "input_global_scale"):
        value = getattr(qw, per_tensor, None)
        if value is not None:
            _load_one(modules, model, module, per_tensor, value.reshape(1).expand(n))


def _dtype_of(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    return table.get(str(name).replace("torch.", ""), torch.bfloat16)


# --------------------------------------------------------------------------- transformers model


def transformers_model(folder: str | Path, dtype: torch.dtype = torch.float32, loaded: tuple | None = None):
    """A transformers causal LM of FOLDER on the CPU, in eval mode: a plain HF folder as
    transformers loads it; a quantized checkpoint (``optllm quantize``) with every quantized
    linear's weight dequantized through formats/ (the values vLLM's and HF's dequantization
    give), so no compressed-tensors package is needed. Weight-only schemes (W4A16) then compute
    what the kernels do; schemes that also quantize activations keep their weights' error only.
    Used where a checkpoint's hidden states are read by plain torch code (train-draft's target).
    loaded: the quantized folder's load_quantized_weights(folder), when the caller has it already."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..formats.compressed_tensors import load_quantized_weights

    folder = Path(folder)
    if not is_quantized_folder(folder):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    qweights, rest, cfg_dict = loaded if loaded is not None else load_quantized_weights(folder)
    cfg_dict = {k: v for k, v in cfg_dict.items() if k != "quantization_config"}
    config = AutoConfig.for_model(**cfg_dict)
    check_architecture(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in rest.items()
             if not k.endswith(_KV_SCALE_SUFFIXES)}
    for name, qw in qweights.items():
        state[f"{name}.weight"] = qw.dequantize().to(dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(f"{folder}: checkpoint does not match the model: missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}")
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    _rebuild_meta_buffers(model)
    return model.eval()


_KV_SCALE_SUFFIXES = tuple(f".{n}" for n in KV_SCALE_NAMES)


def _rebuild_meta_buffers(model) -> None:
    """Non-persistent buffers (rotary inv_freq) were made on the meta device: rebuild their
    modules on the CPU from their config."""
    for mod_name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            if not hasattr(mod, "config"):
                raise UserError(f"cannot rebuild the buffers of {mod_name} ({type(mod).__name__})")
            parent, _, child = mod_name.rpartition(".")
            with torch.device("cpu"):
                setattr(model.get_submodule(parent) if parent else model, child, type(mod)(config=mod.config))
