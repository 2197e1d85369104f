"""`optllm eval` end to end on the CPU: one call over two tiny checkpoints (the float tiny Llama
and its W4 RTN quantization) with perplexity, lm-eval tasks, speed, a draft and --compare
against an earlier run writes a report.md with every section eval/report.py can emit, both
models a row in each of its tables, a report.json whose two rows carry every measurement, and
every plot the report names as a real PNG with data drawn on it.

Two eval calls: the first (perplexity only, the cheapest) only writes the earlier report.json
that the second one's --compare reads; everything asserted comes from the second call.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

from conftest import write_draft

# every "## " section write_report can emit, in the order it writes them. Perplexity has no
# heading of its own: it is the part between the title and the first "## ".
SECTIONS = ("## lm-eval tasks", "## Speed", "## Speculative decoding", "## Compared with an earlier run",
            "## Provenance")
# every plot write_report can write: perplexity per kind, quality against bits, tok/s and
# latency against batch size, accepted draft tokens per step
PNGS = {"ppl.png", "quality_bits.png", "speed.png", "latency.png", "acceptance.png"}
KINDS = ("docs", "code", "chat")
TASKS = {"optllm_mc", "optllm_gen"}
BATCH_SIZES = [1, 2]
TEMPERATURES = [0.0, 1.0]


def run(*args):
    # one intra-op thread: a tiny model's steps are a few ms, and on a 2-core machine torch's
    # default threads (one per core) spend ~10x that contending (runtime only, nothing asserted)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "optllm", *args], capture_output=True, text=True, env=env)


def _sections(md: str) -> dict[str, str]:
    """report.md split at its "## " headings: {heading: body}; the part before the first one
    (title and perplexity) under "#"."""
    parts = re.split(r"^(## .+)$", md, flags=re.M)
    return {"#": parts[0], **{h: body for h, body in zip(parts[1::2], parts[2::2])}}


def _table_models(body: str) -> list[str]:
    """The first cell of each data row of the Markdown table(s) in body."""
    rows = [line for line in body.splitlines() if line.startswith("| ")]
    return [line.split(" | ")[0][2:] for line in rows[1:] if not line.startswith("| model |")]


def _png_with_data(path) -> bool:
    """A real PNG (signature, > 1 KB) whose pixels include colour: the series are drawn in
    colour, axes, text and grid in greys, so a plot with no data drawn has no colour at all."""
    from PIL import Image

    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n" or len(data) <= 1024:
        return False
    with Image.open(path) as im:
        rgb = im.convert("RGB")
        w, h = rgb.size
        return w > 100 and h > 100 and any(max(c) - min(c) > 60 for _n, c in rgb.getcolors(w * h))


def test_eval_report_has_every_section_and_plot_for_two_checkpoints(tiny_llama, tmp_path):
    quant = tmp_path / "q"
    r = run("quantize", str(tiny_llama), "--scheme", "w4a16-rtn", "--group-size", "32", "--num-samples", "2",
            "--seq-len", "16", "--no-compare", "--out", str(quant))
    assert r.returncode == 0, r.stderr
    draft = write_draft(tmp_path / "draft", tiny_llama, "medusa")
    models = [str(tiny_llama), str(quant)]
    schemes = {str(tiny_llama): "float", str(quant): "w4a16-rtn"}
    ppl = ("--seq-len", "32", "--max-windows", "1", "--device", "cpu")

    r = run("eval", *models, "--ppl", *ppl, "--out", str(tmp_path / "earlier"))
    assert r.returncode == 0, r.stderr
    rep = tmp_path / "rep"
    r = run("eval", *models, "--tasks", "ppl,optllm_mc,optllm_gen", "--limit", "2", *ppl,
            "--speed", "--batch-sizes", ",".join(map(str, BATCH_SIZES)), "--prompt-len", "8", "--output-len", "4",
            "--draft", str(draft), "--temperatures", ",".join(f"{t:g}" for t in TEMPERATURES),
            "--compare", str(tmp_path / "earlier" / "report.json"), "--out", str(rep))
    assert r.returncode == 0, r.stderr

    md = (rep / "report.md").read_text()
    assert md.startswith("# optllm eval\n"), md[:200]  # the final report, not a partial one
    sections = _sections(md)
    assert list(sections) == ["#", *SECTIONS], list(sections)
    head = "| model | scheme | " + " | ".join(f"ppl {k} | Δ {k}" for k in KINDS) + " | tokens | windows | s |"
    assert "Perplexity (lower is better)" in sections["#"] and head in sections["#"]
    assert "![quality vs bits](quality_bits.png)" in sections["#"]
    tasks = sections["## lm-eval tasks"]
    assert "optllm_mc acc_norm" in tasks and "optllm_gen exact_match" in tasks
    assert "| TTFT p50 ms |" in sections["## Speed"] and "greedily to exactly 4 tokens" in sections["## Speed"]
    assert "| spec tok/s | speedup | τ |" in sections["## Speculative decoding"]
    assert "0 regression(s)" in sections["## Compared with an earlier run"]  # same models, same windows
    prov = sections["## Provenance"]  # how to run it again, and on what
    assert "- command: `optllm eval " in prov and "--draft" in prov and "- hardware: " in prov and "torch " in prov

    # each model a row of every table: once in perplexity and tasks, per batch size in speed,
    # per temperature and batch size in speculation, per text kind in the comparison
    per_model = {"#": 1, "## lm-eval tasks": 1, "## Speed": len(BATCH_SIZES),
                 # its table, then the time table (where each engine's time went)
                 "## Speculative decoding": 2 * len(TEMPERATURES) * len(BATCH_SIZES),
                 "## Compared with an earlier run": len(KINDS)}
    for section, n in per_model.items():
        got = _table_models(sections[section])
        assert sorted(got) == sorted(models * n), (section, got)
    for section in ("#", *SECTIONS[:3]):
        for m in models:
            assert f"| {m} | {schemes[m]} |" in sections[section], (section, m)

    rows = json.loads((rep / "report.json").read_text())["rows"]
    assert [(row["model"], row["kind"]) for row in rows] == [(m, schemes[m]) for m in models]
    for row in rows:
        assert list(row["ppl_by_kind"]) == list(KINDS) and all(1 < v < math.inf for v in row["ppl_by_kind"].values())
        assert row["windows_by_kind"] == dict.fromkeys(KINDS, 1)
        assert set(row["tasks"]) == TASKS and set(row["task_main"]) == TASKS
        assert all(0.0 <= v <= 1.0 for v in (row["task_main"][t][1] for t in TASKS))
        assert [s["batch_size"] for s in row["speed"]] == BATCH_SIZES and all(s["tok_s"] > 0 for s in row["speed"])
        spec = row["speculation"]
        assert [(s["temperature"], s["batch_size"]) for s in spec] == [(t, b) for t in TEMPERATURES
                                                                        for b in BATCH_SIZES]
        assert all(s["spec_seq_steps"] > 0 and sum(s["histogram"]) == s["spec_seq_steps"] for s in spec)
    diffs = json.loads((rep / "compare.json").read_text())
    assert sorted((d["model"], d["measure"]) for d in diffs) == sorted((m, f"ppl {k}") for m in models for k in KINDS)
    assert not any(d["regression"] for d in diffs)

    named = set(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md))
    assert named == PNGS
    assert {p.name for p in rep.iterdir()} == PNGS | {"report.md", "report.json", "compare.json"}
    for name in sorted(PNGS):
        assert _png_with_data(rep / name), name
