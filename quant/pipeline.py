"""The quantize pipeline: load -> calibration data -> sequential per-block calibration and
quantization -> compressed-tensors checkpoint + optllm-report.json.

What varies by scheme comes from registries: the scheme (quant/scheme.py) names its weights'
arguments, its algorithm and its format; the algorithm's block step (quant/algorithm.py)
quantizes each block; the format's codec (formats/codec.py) writes the tensors; the
architecture (hub/architectures.py) names the blocks, their linears and the LM head.

Linears may differ in their weights' arguments: per-module overrides, and mixed precision
(quant/mixed.py: a sensitivity pass over the float blocks, then a choice per linear under an
average-bits budget, before the quantizing pass). The algorithm then runs once per set of
linears sharing arguments (block_step), and the checkpoint holds one config group per set.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import UserError
from ..formats.args import QuantArgs
from ..formats.codec import get_codec
from ..formats.compressed_tensors import REPORT_NAME, check_writable, matches, save_quantized  # noqa: F401 (cli reads REPORT_NAME here)
from ..formats.qweight import QuantizedWeight
from ..hub.architectures import architecture_of
from ..hub.loader import load_config, load_model, parse_dtype, resolve_device, resolve_model
from . import mixed as mixed_precision
from .algorithm import BlockContext, BlockResult, get_algorithm, install
from .calib_data import load_calibration, token_hash
from .config import OFFLOAD_AUTO_BYTES, QuantizeConfig
from .kv_cache import KVCalibration, KVObserver, kv_cache_scheme
from .recipe import recipe_entry, recipe_note
from .rtn import rtn_quantize
from .sensitivity import sample_windows
from .sequential import advance_block, block_linears, capture_block_inputs, decoder_layers, on_device, run_block

BASELINE = "rtn"  # the algorithm every other one is compared with on the held-out windows
RECIPE_NAME = "recipe.yaml"  # the checkpoint's copy of the configuration it was made with


@dataclass
class LayerStat:
    name: str
    # sqrt(Σ‖x ΔWᵀ‖² / Σ‖x Wᵀ‖²) = sqrt(tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)): relative RMS output error on the
    # calibration inputs (GPTQ: through its Hessian, whose tokens are weighted by token_cap)
    rel_error: float


@dataclass
class BlockStat:
    index: int
    rel_error: float  # ‖block_q(x) − block(x)‖ / ‖block(x)‖ on the calibration inputs
    seconds: float
    awq_ratios: dict = field(default_factory=dict)
    smoothquant: dict = field(default_factory=dict)  # w8a8-int8: the block's α (and its search), channel spreads
    # on the held-out windows, sqrt(mean over tokens of ‖out_t − ref_t‖² / ‖ref_t‖²) for the
    # algorithm's block and for RTN's (None: no held-out windows, or the algorithm is RTN), and
    # which of the two the checkpoint keeps
    holdout_error: float | None = None
    holdout_rtn_error: float | None = None
    kept: str = ""


@dataclass
class QuantizeReport:
    scheme: str
    config: dict
    model: str
    calibration: dict
    layers: list[LayerStat]
    blocks: list[BlockStat]
    seconds: dict
    peak_memory_bytes: int
    peak_memory_kind: str
    out: str
    # bytes of one copy of the calibration activations, and the device they were kept on
    activations: dict = field(default_factory=dict)
    vllm_note: str | None = None  # why vLLM will not load the checkpoint (None: it loads); save_quantized records it
    kv_cache: dict | None = None  # the FP8 KV cache's calibrated scales per layer (None: the cache is not quantized)
    mixed: dict | None = None  # mixed precision: target, bits reached, each unit's choice (quant/mixed.py report)
    recipe: dict | None = None  # the recipe file given (its path and text) and where the checkpoint keeps the config

    def holdout_summary(self) -> dict:
        """Blocks whose held-out error was higher than RTN's, and those that kept RTN."""
        compared = [b for b in self.blocks if b.holdout_error is not None]
        return {
            "windows": self.calibration.get("holdout_windows", 0),
            "blocks_compared": len(compared),
            "worse_than_rtn": [b.index for b in compared if b.holdout_error > b.holdout_rtn_error],
            "kept_rtn": [b.index for b in compared if b.kept == "rtn"],
        }

    def to_dict(self) -> dict:
        return {
            "scheme": self.scheme,
            "model": self.model,
            "config": self.config,
            "calibration": self.calibration,
            "seconds": self.seconds,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_memory_kind": self.peak_memory_kind,
            "activations": self.activations,
            "holdout": self.holdout_summary(),
            "kv_cache": self.kv_cache,
            "mixed": self.mixed,
            "recipe": self.recipe,
            "layers": [vars(s) for s in self.layers],
            "blocks": [vars(b) for b in self.blocks],
            "out": self.out,
        }


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    # ru_maxrss is KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "process peak RSS"


def check_group_size(config, args) -> None:
    """Fail before loading any weight if the group size does not divide a linear's K."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for k in (config.hidden_size, config.num_attention_heads * head_dim, config.intermediate_size):
        try:
            args.groups(k)
        except ValueError as e:
            raise UserError(str(e)) from None


def _rtn_in_place(linears: dict[str, nn.Linear], args_of, scale_dtype) -> dict[str, QuantizedWeight]:
    """RTN-quantize the linears in place (weights become their dequantized values); args_of(name)
    gives each one's arguments."""
    out = {}
    for name, lin in linears.items():
        out[name] = install(lin, rtn_quantize(lin.weight.detach(), args_of(name), scale_dtype=scale_dtype))
    return out


def block_step(algorithm, options, ctx: BlockContext, args_of) -> BlockResult:
    """The algorithm's step on the block, each linear with args_of(name): one call when they
    share their arguments (always, without overrides or mixed precision), else one call per
    run of consecutive sequential groups that share them. In the block's order, so a run sees
    the earlier ones quantized (GPTQ's true-sequential order holds across runs), except for a
    step that folds scales into the linears before its own (Algorithm.folds_scales: AWQ's
    v_proj -> o_proj, up_proj -> down_proj): the last run first, as those must still be
    unquantized when it runs."""
    linears = ctx.linears
    stages = [[n for n in g if n in linears] for g in ctx.mapping.sequential]
    groups = [g for g in stages if g] + [[n] for n in linears if not any(n in g for g in stages)]
    runs: list[tuple[QuantArgs, list[str]]] = []
    for g in groups:
        a = args_of(g[0])
        if runs and runs[-1][0] == a:
            runs[-1][1].extend(g)
        else:
            runs.append((a, list(g)))
    if len(runs) <= 1:
        args = runs[0][0] if runs else ctx.weights
        return algorithm.step(dataclasses.replace(ctx, weights=args), options)
    merged = BlockResult({}, [])
    for args, names in reversed(runs) if algorithm.folds_scales else runs:
        sub = dataclasses.replace(ctx, linears={n: linears[n] for n in names}, weights=args)
        r = algorithm.step(sub, options)
        merged.qweights.update(r.qweights)
        merged.errors += r.errors
        for k, v in r.stats.items():
            merged.stats[k] = {**merged.stats.get(k, {}), **v} if isinstance(v, dict) else v
    order = list(linears)
    merged.errors.sort(key=lambda e: order.index(e[0]) if e[0] in order else len(order))
    return merged


def _relative(outs: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """sqrt(mean over tokens of ‖out_t − ref_t‖² / ‖ref_t‖²): each token counts once, so the
    few tokens of massive activations (whose hidden states are 100-1000x the others') do not
    decide it alone, as they would a ratio of sums."""
    total, count = 0.0, 0
    for o, r in zip(outs, ref):
        r = r.float().reshape(-1, r.shape[-1])
        num = (o.float().reshape(r.shape) - r).pow(2).sum(1)
        total += float((num / r.pow(2).sum(1).clamp_min(1e-30)).sum())
        count += r.shape[0]
    return (total / count) ** 0.5 if count else 0.0


def _state(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in layer.state_dict().items()}


def activation_store(config: QuantizeConfig, device: torch.device, activation_bytes: int) -> torch.device:
    """Where the calibration activations live: the compute device, or the CPU when offloading
    (config.offload "always", or "auto" with one copy of them past OFFLOAD_AUTO_BYTES)."""
    if device.type == "cpu" or config.offload == "never":
        return device
    if config.offload == "always" or activation_bytes >= OFFLOAD_AUTO_BYTES:
        return torch.device("cpu")
    return device


class _BlockProgress:
    """A rich bar on a terminal; elsewhere (CI logs, pipes) one plain line per block, flushed."""

    def __init__(self, enabled: bool, label: str, total: int) -> None:
        from rich.console import Console
        from rich.progress import Progress

        self.label, self.total = label, total
        self.lines = enabled and not Console().is_terminal
        self.bar = Progress(disable=not enabled or self.lines, transient=False)
        self.task = self.bar.add_task(f"{label} blocks", total=total)

    def __enter__(self) -> "_BlockProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def advance(self, index: int) -> None:
        """Block INDEX done (a pass without block statistics)."""
        if self.lines:
            print(f"{self.label} block {index + 1}/{self.total}", flush=True)
        self.bar.update(self.task, advance=1, description=f"{self.label} block {index + 1}/{self.total}")

    def done(self, stat: BlockStat) -> None:
        i = stat.index + 1
        if self.lines:
            held = "" if stat.holdout_error is None else (
                f", held-out {stat.holdout_error:.4f} (RTN {stat.holdout_rtn_error:.4f}"
                f"{', kept RTN' if stat.kept == 'rtn' else ''})")
            print(f"{self.label} block {i}/{self.total}: {stat.seconds:.1f} s, "
                  f"block rel. error {stat.rel_error:.4f}{held}", flush=True)
        self.bar.update(self.task, advance=1, description=f"{self.label} block {i}/{self.total}")


def quantize(model: str | Path, out: str | Path, config: QuantizeConfig, overwrite: bool = False,
             progress: bool = True, recipe: str | Path | None = None) -> QuantizeReport:
    """Calibrate and convert MODEL into a compressed-tensors checkpoint at OUT. recipe: the
    recipe file the config came from (its text goes into the report); the checkpoint keeps the
    config itself as a recipe (RECIPE_NAME) either way."""
    t0 = time.perf_counter()
    out = Path(out)
    source = resolve_model(model)
    repaired = check_writable(out, overwrite, source=source)
    if repaired and progress:
        print(repaired, file=sys.stderr, flush=True)
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    scheme = config.quant_scheme()
    algorithm = get_algorithm(scheme.algorithm)
    options = algorithm.options(config)
    codec = get_codec(scheme.format)
    try:
        codec.check(scheme.weights, scheme.input_activations)
    except ValueError as e:
        raise UserError(f"scheme {scheme.name!r} cannot be written as {codec.name}: {e}") from None
    per_module = config.target_bits is not None or bool(config.overrides)
    vllm_note = None
    if not per_module:  # per module: each linear's arguments are checked once they are known
        check_group_size(load_config(source), scheme.weights)
        vllm_note = _vllm_note([scheme.weights], codec, scheme, out, progress)
    hf_model, tokenizer, folder = load_model(model, dtype="float32", device="cpu")
    arch = architecture_of(hf_model.config)
    layers = decoder_layers(hf_model)
    t_load = time.perf_counter()

    n_hold = config.holdout_windows()
    drawn = load_calibration(tokenizer, config.calib, config.num_samples + n_hold, config.seq_len, config.seed,
                             model=hf_model if config.calib == "self" else None)
    calib = dataclasses.replace(drawn, input_ids=drawn.input_ids[: config.num_samples],
                                sha256=token_hash(drawn.input_ids[: config.num_samples]))
    held_ids = drawn.input_ids[config.num_samples :]
    t_calib = time.perf_counter()
    act_bytes = drawn.input_ids.numel() * hf_model.config.hidden_size * 4  # float32 hidden states
    store = activation_store(config, device, act_bytes)
    scale_dtype = parse_dtype(config.dtype)
    assigned: dict[str, QuantArgs | None] = {}  # per-module arguments (None: left in bf16)
    mixed = None
    if per_module:  # before the quantizing pass's activations are captured: one pass's at a time
        assigned, mixed = _plan(hf_model, arch, config, scheme, calib.input_ids, device, store, scale_dtype, progress)
        vllm_note = _vllm_note([a for a in assigned.values() if a is not None], codec, scheme, out, progress)
    t_plan = time.perf_counter()
    inputs = capture_block_inputs(hf_model, calib.input_ids, config.batch_size, device, store=store)
    held = capture_block_inputs(hf_model, held_ids, config.batch_size, device, store=store) if n_hold else None
    compare = held is not None and scheme.algorithm != BASELINE and algorithm.rtn_baseline
    kv_scheme = kv_cache_scheme(config.kv_cache)
    kv_calib = None if kv_scheme is None else KVCalibration(kv_scheme, arch)

    qweights: dict[str, QuantizedWeight] = {}
    layer_stats: list[LayerStat] = []
    block_stats: list[BlockStat] = []
    ignored: list[str] = [arch.lm_head]
    with _BlockProgress(progress, scheme.name, len(layers)) as bar:
        for i, layer in enumerate(layers):
            tb = time.perf_counter()
            with on_device(layer, device):
                prefix = arch.block_prefix(i) + "."
                linears = {}
                for n, m in block_linears(layer, arch.block).items():
                    if matches(prefix + n, config.ignore) or (prefix + n in assigned and assigned[prefix + n] is None):
                        ignored.append(prefix + n)
                    else:
                        linears[n] = m

                def args_of(n: str, prefix: str = prefix) -> QuantArgs:
                    return assigned.get(prefix + n) or scheme.weights

                ref = run_block(layer, inputs)  # the float block's outputs, on the store device
                held_ref = run_block(layer, held) if held is not None else None
                original = _state(layer) if compare else None
                ctx = BlockContext(layer, i, linears, arch.block, inputs, scheme.weights, scale_dtype)
                result = block_step(algorithm, options, ctx, args_of)
                qws, kept = result.qweights, scheme.algorithm
                hold_err = hold_rtn = None
                if compare:
                    hold_err = _relative(run_block(layer, held), held_ref)
                    chosen = _state(layer)
                    layer.load_state_dict(original)
                    rtn_qws = _rtn_in_place(linears, args_of, scale_dtype)
                    hold_rtn = _relative(run_block(layer, held), held_ref)
                    if config.fallback_rtn and hold_rtn < hold_err:
                        qws, kept = rtn_qws, BASELINE
                    else:
                        layer.load_state_dict(chosen)
                    del original, chosen
                qweights.update({prefix + n: qw for n, qw in qws.items()})
                layer_stats += [LayerStat(prefix + n, e) for n, e in result.errors]
                # inputs become the next block's; the KV cache scales are observed on this pass, the
                # block quantized and its inputs from the quantized blocks before it, as served
                observer = None if kv_calib is None else KVObserver()
                block_err = advance_block(layer, inputs, ref, kv_cache=observer)
                if observer is not None:
                    kv_calib.add(i, observer)
                if held is not None:
                    advance_block(layer, held, held_ref)
            block_stats.append(BlockStat(i, block_err, time.perf_counter() - tb, holdout_error=hold_err,
                                         holdout_rtn_error=hold_rtn, kept=kept, **result.stats))
            bar.done(block_stats[-1])
    t_quant = time.perf_counter()
    peak, kind = _peak_memory(device)
    report = QuantizeReport(
        scheme=scheme.name, config=config.to_dict(), model=str(model),
        calibration={"source": calib.source, "sha256": calib.sha256,
                     "num_samples": int(calib.input_ids.shape[0]), "seq_len": int(calib.input_ids.shape[1]),
                     "holdout_windows": int(held_ids.shape[0]), "holdout_sha256": token_hash(held_ids)},
        layers=layer_stats, blocks=block_stats,
        seconds={"load": t_load - t0, "calibration_data": t_calib - t_load, "quantize": t_quant - t_plan,
                 **({"sensitivity": t_plan - t_calib} if mixed is not None else {})},
        peak_memory_bytes=int(peak), peak_memory_kind=kind, out=str(out),
        activations={"bytes_per_copy": int(inputs.nbytes()), "device": str(store)},
        vllm_note=vllm_note, kv_cache=None if kv_calib is None else kv_calib.report(config.kv_cache),
        mixed=mixed, recipe=recipe_entry(recipe, RECIPE_NAME),
    )
    report.seconds["total"] = t_quant - t0  # up to the write, which the report travels with
    tied = bool(getattr(hf_model.config, "tie_word_embeddings", False))
    save_quantized(hf_model, qweights, scheme.weights, out, folder, scale_dtype,
                   ignored, report=report.to_dict(), overwrite=overwrite, fmt=scheme.format,
                   input_activations=scheme.input_activations, omit=[f"{arch.lm_head}.weight"] if tied else [],
                   kv_cache=kv_scheme, kv_scales=None if kv_calib is None else kv_calib.tensors,
                   module_args={n: a for n, a in assigned.items() if a is not None and n in qweights},
                   extra_files={RECIPE_NAME: config.to_recipe(recipe_note(model, recipe, RECIPE_NAME))})
    return report


def _plan(hf_model, arch, config: QuantizeConfig, scheme, calib_ids: torch.Tensor, device, store, scale_dtype,
          progress: bool) -> tuple[dict[str, QuantArgs | None], dict | None]:
    """Each linear's arguments (mixed.plan_linears), the sensitivity pass on about
    config.mixed_tokens tokens of the calibration windows; UserError for what cannot be planned."""
    picked = sample_windows(calib_ids.shape[0], calib_ids.shape[1], config.mixed_tokens)
    n = len(decoder_layers(hf_model))
    with _BlockProgress(progress and config.target_bits is not None, f"{scheme.name} sensitivity", n) as bar:
        try:
            assigned, mixed = mixed_precision.plan_linears(
                hf_model, arch, scheme.weights, config.ignore, config.overrides, config.target_bits,
                config.mixed_candidates, calib_ids[picked], config.batch_size, device, store, scale_dtype,
                progress=lambda i, total: bar.advance(i), metric=config.mixed_sensitivity)
        except ValueError as e:
            raise UserError(str(e)) from None
    if mixed is not None and progress:
        print(mixed_precision.summary(mixed), flush=True)
    return assigned, mixed


def _vllm_note(args: list[QuantArgs], codec, scheme, out: Path, progress: bool) -> str | None:
    """Why vLLM will not load linears of these arguments (None: it loads them all); said at
    once, before the calibration, not only in the report."""
    notes = sorted({codec.vllm_incompatibility(a, scheme.input_activations) for a in args} - {None})
    note = " ".join(notes) or None
    if note and progress:
        print(f"note: {out} will not load in vLLM: {note}", file=sys.stderr, flush=True)
    return note
