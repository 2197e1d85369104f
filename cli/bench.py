"""`optllm bench ...`: benchmarks. Argument handling only; the work is in eval/loadtest.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from ..errors import UserError

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: load-test a serving endpoint.")


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


@bench_app.command("serve")
def serve(
    url: str = typer.Argument(..., help="the server, e.g. http://127.0.0.1:8000 (ours or any OpenAI-compatible one)"),
    endpoint: str = typer.Option("completions", help="completions | chat"),
    model: Optional[str] = typer.Option(None, help="model id to send (default: the first of GET /v1/models)"),
    api_key: Optional[str] = typer.Option(None, envvar="OPENAI_API_KEY",
                                          help="sent as 'Authorization: Bearer KEY' (or $OPENAI_API_KEY)"),
    dataset: Optional[Path] = typer.Option(None, help="prompts: .jsonl/.json rows with \"prompt\", or ShareGPT-style "
                                           "conversations (default: synthetic)"),
    input_len: int = typer.Option(128, help="synthetic prompt length: token ids if the server takes them, else words"),
    output_len: int = typer.Option(128, help="max_tokens of each request"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="exact output lengths (a vLLM extension)"),
    temperature: float = typer.Option(0.0),
    num_prompts: Optional[int] = typer.Option(None, help="requests to issue at most (default: 100 unless --duration)"),
    duration: Optional[float] = typer.Option(None, help="seconds after which no new request is issued"),
    request_rate: float = typer.Option(math.inf, help="mean requests per second, Poisson arrivals; inf = all at once"),
    max_concurrency: Optional[int] = typer.Option(None, help="requests in flight at most (default: no limit)"),
    seed: int = typer.Option(0, help="seed of the arrival schedule and the prompts"),
    timeout: float = typer.Option(300.0, help="seconds in-flight requests get once issuing stops; "
                                  "then they count as failed"),
    slo_ttft_ms: Optional[float] = typer.Option(None, help="goodput target: time to first token (ms)"),
    slo_itl_ms: Optional[float] = typer.Option(None, help="goodput target: mean inter-token latency (TPOT, ms)"),
    out: Optional[Path] = typer.Option(None, help="folder for report.json (every request) and report.md"),
) -> None:
    """Load-test URL with streamed requests; print throughput, TTFT/ITL/TPOT/E2E percentiles and goodput."""
    from rich.console import Console

    from ..eval.loadtest import LoadTestConfig, run_loadtest

    def show(p) -> None:
        status.update(f"{p.elapsed_s:6.1f} s · issued {p.issued} · ok {p.ok} · failed {p.failed} · "
                      f"in flight {p.in_flight} · {p.output_tokens / max(p.elapsed_s, 1e-9):.1f} output tok/s")

    try:
        cfg = LoadTestConfig(
            url=url, endpoint=endpoint, model=model, api_key=api_key or None, dataset=dataset, input_len=input_len,
            output_len=output_len, num_prompts=num_prompts, duration=duration, request_rate=request_rate,
            max_concurrency=max_concurrency, seed=seed, timeout=timeout, slo_ttft_ms=slo_ttft_ms,
            slo_itl_ms=slo_itl_ms, temperature=temperature, ignore_eos=ignore_eos)
        with Console(stderr=True).status("starting", spinner="dots") as status:
            report = run_loadtest(cfg, progress=show)
        typer.echo(report.markdown())
        if out is not None:
            report.write(out)
            typer.echo(f"report written to {out}")
    except (UserError, ValueError) as e:
        _fail(str(e))
    if report.summary["ok"] == 0:
        _fail(f"none of the {report.summary['issued']} requests succeeded", code=1)
