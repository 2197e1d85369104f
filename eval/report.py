"""Side-by-side reports: a Markdown table, the same rows as JSON, and a PNG bar chart."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path


def markdown_table(rows: list, baseline: float | None = None) -> str:
    head = "| model | kind | perplexity | Δ vs first | tokens | windows | s |\n|---|---|---|---|---|---|---|\n"
    base = baseline if baseline is not None else (rows[0].ppl if rows else None)
    lines = []
    for r in rows:
        delta = f"{100 * (r.ppl / base - 1):+.2f}%" if base else "–"
        lines.append(
            f"| {r.model} | {r.kind} | {r.ppl:.4f} | {delta} | {r.num_tokens} | {r.num_windows} | {r.seconds:.1f} |"
        )
    return head + "\n".join(lines) + "\n"


def write_report(rows: list, out_dir: str | Path, title: str = "optllm eval") -> Path:
    """Write report.md, report.json and ppl.png into out_dir (atomically, via a temp folder)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    (tmp / "report.md").write_text(f"# {title}\n\n" + markdown_table(rows))
    (tmp / "report.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    _plot(rows, tmp / "ppl.png")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(rows) + 2), 3.5))
    labels = [f"{Path(r.model).name}\n{r.kind}" for r in rows]
    ax.bar(range(len(rows)), [r.ppl for r in rows], color="#4477aa")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("perplexity (lower is better)")
    lo = min(r.ppl for r in rows)
    ax.set_ylim(lo * 0.95, max(r.ppl for r in rows) * 1.02)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
