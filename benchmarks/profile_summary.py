"""One line a step graph of a profile_step.py report: its graph time and the named kernels' calls and µs a step.

    python benchmarks/profile_summary.py REPORT.json [--kernels _extend_kernel,_combine_kernel] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def summary_lines(report: dict, kernels: list[str], name: str = "") -> list[str]:
    out = []
    for r in report["rows"]:
        parts = [f"graph {r['graph_us']:.1f} us"]
        for k in kernels:
            v = r["kernels"].get(k, {"count": 0, "us": 0.0})
            parts.append(f"{k} {v['count']:.0f} calls {v['us']:.1f} us")
        out.append(f"{name + ': ' if name else ''}{r['case']}: " + ", ".join(parts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path)
    ap.add_argument("--kernels", default="_extend_kernel")
    ap.add_argument("--name", default="")
    a = ap.parse_args()
    try:
        report = json.loads(a.report.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{a.report}: not a profile_step.py report ({e})")
    print("\n".join(summary_lines(report, [k for k in a.kernels.split(",") if k], a.name)))


if __name__ == "__main__":
    main()
