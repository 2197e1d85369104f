"""The numbers of a finished load test (eval/loadtest.py): throughput, latency percentiles
(linear interpolation, numpy's default, as benchmark_serving reports), goodput, and the
Markdown / JSON report."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from .provenance import provenance, provenance_md

if TYPE_CHECKING:
    from .loadtest import LoadTestConfig, RequestRecord, Target


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between closest ranks
    (numpy's default, which benchmark_serving reports); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    rank = q / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _stats_ms(values_s: list[float]) -> dict:
    ms = [1000 * v for v in values_s]
    return {"mean": sum(ms) / len(ms) if ms else None, **{f"p{q}": percentile(ms, q) for q in (50, 90, 99)}}


def summarize(cfg: LoadTestConfig, target: Target, records: list[RequestRecord], duration_s: float,
              client: str = "") -> Report:
    """The numbers of a finished load test. duration_s: from the start to the last request's end;
    client: the HTTP client that measured them (name and version)."""
    ok = [r for r in records if r.ok]
    dur = max(duration_s, 1e-9)
    inp = sum(r.prompt_tokens or 0 for r in ok)
    out = sum(r.output_tokens for r in ok)
    slo = {"ttft_ms": cfg.slo_ttft_ms, "itl_ms": cfg.slo_itl_ms}
    good = None
    if cfg.slo_ttft_ms is not None or cfg.slo_itl_ms is not None:
        good = sum((cfg.slo_ttft_ms is None or 1000 * r.ttft_s <= cfg.slo_ttft_ms)
                   and (cfg.slo_itl_ms is None or 1000 * r.tpot_s <= cfg.slo_itl_ms) for r in ok)
    summary = {
        "url": cfg.base, "endpoint": cfg.endpoint, "model": target.model, "prompts": target.kind,
        "input_len": cfg.input_len if target.kind != "dataset" else None, "output_len": cfg.output_len,
        "request_rate": cfg.request_rate if math.isfinite(cfg.request_rate) else "inf",
        "max_concurrency": cfg.max_concurrency, "seed": cfg.seed, "num_prompts": cfg.max_requests,
        "duration_limit_s": cfg.duration, "timeout_s": cfg.timeout,
        "issued": len(records), "ok": len(ok), "failed": len(records) - len(ok),
        "failures": dict(Counter(r.reason for r in records if not r.ok)),
        "duration_s": duration_s, "input_tokens": inp, "output_tokens": out,
        "usage_from_server": sum(r.usage for r in ok),
        "request_throughput": len(ok) / dur, "output_throughput": out / dur,
        "total_token_throughput": (inp + out) / dur,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]), "itl_ms": _stats_ms([g for r in ok for g in r.itl_s]),
        "tpot_ms": _stats_ms([r.tpot_s for r in ok if r.output_tokens > 1]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
        "slo": slo, "good": good, "goodput": None if good is None else good / dur,
        "client": client,
    }
    return Report(summary, records)


def _f(v, fmt=".1f") -> str:
    return "–" if v is None else format(v, fmt)


@dataclass
class Report:
    """summary: the numbers (report.json's "summary"); requests: every request's record."""

    summary: dict
    requests: list[RequestRecord]

    def markdown(self) -> str:
        s = self.summary
        head = (f"{s['model']} at {s['url']} ({s['endpoint']}); prompts: {s['prompts']}; rate {s['request_rate']} "
                f"req/s; max concurrency {s['max_concurrency'] or '–'}; seed {s['seed']}")
        slo = " and ".join(f"{k.replace('_ms', '').upper()} <= {v:g} ms" for k, v in s["slo"].items() if v)
        lines = [head, "",
                 "| requests | ok | failed | duration s | req/s | output tok/s | total tok/s | goodput req/s |",
                 "|---|---|---|---|---|---|---|---|",
                 f"| {s['issued']} | {s['ok']} | {s['failed']} | {s['duration_s']:.2f} | "
                 f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {s['total_token_throughput']:.1f} | "
                 f"{_f(s['goodput'], '.2f')} |", "",
                 "| latency ms | mean | p50 | p90 | p99 |", "|---|---|---|---|---|"]
        for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms")):
            st = s[key]
            lines.append(f"| {name} | {_f(st['mean'])} | {_f(st['p50'])} | {_f(st['p90'])} | {_f(st['p99'])} |")
        notes = [f"goodput: {s['good']} of {s['ok']} ok requests met {slo} (TPOT for ITL, as vLLM)"] if slo else []
        for reason, n in s["failures"].items():
            example = next(r.error for r in self.requests if r.reason == reason)
            notes.append(f"failed: {n} × {reason} (e.g. {example})")
        return "\n".join(lines + ([""] + notes if notes else [])) + "\n"

    def write(self, out: Path) -> None:
        """out/report.json (summary + every request) and out/report.md, written into a temporary
        folder beside out and renamed into place (a report is never left half-written)."""
        out = Path(out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            prov = provenance()  # the client's side: command, code, versions, the machine it ran on
            (tmp / "report.json").write_text(json.dumps(
                {"summary": self.summary, "requests": [asdict(r) for r in self.requests], "provenance": prov},
                indent=1))
            (tmp / "report.md").write_text(self.markdown() + "\n" + provenance_md(prov))
            if out.is_dir():
                shutil.rmtree(out)
            os.replace(tmp, out)
        except OSError as e:
            raise UserError(f"cannot write the report to {out}: {e.strerror or e}") from None
