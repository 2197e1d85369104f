"""Side-by-side reports: a Markdown table, the same rows as JSON, and a PNG bar chart.

One perplexity column per text kind (rows' ``ppl_by_kind``), each with its change vs the
first model (the baseline); then, when rows carry lm-eval task scores, one column per task
(its main metric) with the same change.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path


def row_kinds(rows: list) -> list[str]:
    """The text kinds of the rows, in the order measured (first seen first)."""
    kinds: dict[str, None] = {}
    for r in rows:
        kinds.update(dict.fromkeys(_by_kind(r)))
    return list(kinds)


def markdown_table(rows: list, baseline: dict[str, float] | float | None = None) -> str:
    """Rows as a Markdown table: per text kind its perplexity and Δ vs the baseline (default:
    the first row; a float is the first kind's), then scored tokens and windows summed over
    kinds, and seconds; below it, the first row's tokens (windows) per kind."""
    kinds = row_kinds(rows)
    if isinstance(baseline, (int, float)):
        baseline = {kinds[0]: float(baseline)} if kinds else {}
    base = baseline if baseline is not None else (_by_kind(rows[0]) if rows else {})
    cols = [c for k in kinds for c in (f"ppl {k}", f"Δ {k}")]
    head = ["model", "scheme", *cols, "tokens", "windows", "s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ppl = _by_kind(r)
        cells = []
        for k in kinds:
            v, b = ppl.get(k), base.get(k)
            cells += [f"{v:.4f}" if v is not None else "–", f"{100 * (v / b - 1):+.2f}%" if v and b else "–"]
        tokens = sum((getattr(r, "tokens_by_kind", None) or {"": r.num_tokens}).values())
        windows = sum((getattr(r, "windows_by_kind", None) or {"": r.num_windows}).values())
        lines.append("| " + " | ".join([r.model, r.kind, *cells, str(tokens), str(windows), f"{r.seconds:.1f}"]) + " |")
    out = "\n".join(lines) + "\n"
    tokens_by_kind = getattr(rows[0], "tokens_by_kind", None) if rows else None
    if tokens_by_kind:
        per = ", ".join(f"{k} {n} ({rows[0].windows_by_kind[k]})" for k, n in tokens_by_kind.items())
        out += f"\nscored tokens (windows) per kind, first model: {per}\n"
    return out


def tasks_table(rows: list) -> str:
    """lm-eval scores: a column per task (its main metric, higher is better unless it is a
    perplexity), Δ vs the first row in points; "" when no row has tasks."""
    tasks: dict[str, str] = {}
    for r in rows:
        for t, (metric, _v) in (getattr(r, "task_main", None) or {}).items():
            tasks.setdefault(t, metric)
    if not tasks:
        return ""
    base = getattr(rows[0], "task_main", None) or {}
    head = ["model", "scheme", *[c for t, m in tasks.items() for c in (f"{t} {m}", "Δ")]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for t in tasks:
            v = (getattr(r, "task_main", None) or {}).get(t)
            b = base.get(t)
            cells += [f"{v[1]:.4f}" if v else "–", f"{100 * (v[1] - b[1]):+.2f}" if v and b else "–"]
        lines.append("| " + " | ".join([r.model, r.kind, *cells]) + " |")
    return "\n".join(lines) + "\n"


def write_report(rows: list, out_dir: str | Path, title: str = "optllm eval") -> Path:
    """Write report.md, report.json and ppl.png into out_dir (atomically, via a temp folder)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    intro = ("Perplexity (lower is better) on the held-out split of each text kind; "
             "Δ: change vs the first model.\n\n")
    md = f"# {title}\n\n"
    if any(r.num_windows for r in rows):
        md += intro + markdown_table(rows)
    tasks = tasks_table(rows)
    if tasks:
        md += ("\n## lm-eval tasks\n\nEach task's main metric (accuracy-like: higher is better); Δ: points vs the "
               "first model.\n\n" + tasks)
    (tmp / "report.md").write_text(md)
    (tmp / "report.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    if any(r.num_windows for r in rows):
        _plot(rows, tmp / "ppl.png")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _by_kind(row) -> dict[str, float]:
    return getattr(row, "ppl_by_kind", None) or {"text": row.ppl}


def _plot(rows: list, path: Path) -> None:
    """One panel per text kind (their perplexities differ in scale), a bar per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = row_kinds(rows)
    fig, axes = plt.subplots(1, len(kinds), figsize=(len(kinds) * max(3, 1.1 * len(rows) + 1.5), 3.6), squeeze=False)
    labels = [f"{Path(r.model).name}\n{r.kind}" for r in rows]
    for ax, kind in zip(axes[0], kinds):
        values = [_by_kind(r).get(kind, float("nan")) for r in rows]
        ax.bar(range(len(rows)), values, color="#4477aa")
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(kind, fontsize=10)
        seen = [v for v in values if v == v]
        ax.set_ylim(min(seen) * 0.95, max(seen) * 1.02)
    axes[0][0].set_ylabel("perplexity (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
