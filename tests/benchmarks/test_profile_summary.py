"""benchmarks/profile_summary.py: one line a step graph, the named kernels' calls and µs (absent: 0), and one
clear error for a file that is not a report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from optllm.benchmarks.profile_summary import summary_lines

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_summary.py"


def test_summary_lines_name_each_graph_and_kernel():
    report = {"rows": [{"case": "plain", "graph_us": 897.66,
                        "kernels": {"_combine_kernel": {"count": 30.0, "us": 40.4}}},
                       {"case": "trees of 20", "graph_us": 1281.1,
                        "kernels": {"_extend_kernel": {"count": 35.0, "us": 168.84}}}]}
    assert summary_lines(report, ["_extend_kernel", "_combine_kernel"], "x") == [
        "x: plain: graph 897.7 us, _extend_kernel 0 calls 0.0 us, _combine_kernel 30 calls 40.4 us",
        "x: trees of 20: graph 1281.1 us, _extend_kernel 35 calls 168.8 us, _combine_kernel 0 calls 0.0 us"]


def test_a_file_that_is_not_a_report_is_one_line(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text("{not json")
    run = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True, text=True)
    assert run.returncode != 0 and run.stderr.strip().count("\n") == 0 and "not a profile_step.py report" in run.stderr
    good = tmp_path / "g.json"
    good.write_text(json.dumps({"rows": []}))
    assert subprocess.run([sys.executable, str(SCRIPT), str(good)], capture_output=True).returncode == 0
