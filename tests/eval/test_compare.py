"""eval --compare: regressions beyond the noise thresholds are marked, in the right direction
for each measure (perplexity up, task metric down, tok/s down); what only one run has is left out;
a file that is not a report is one clear error."""

from __future__ import annotations

import json

import pytest

from optllm.errors import UserError
from optllm.eval.compare import PPL_TOL, compare, compare_table, load_report
from optllm.eval.evaluate import EvalRow


def row(model="m", ppl=None, tasks=None, speed=None):
    ppl = ppl or {}
    r = EvalRow(model, "float", next(iter(ppl.values()), float("nan")), 0.0, 10, 1 if ppl else 0, 1.0,
                ppl_by_kind=dict(ppl))
    r.task_main = tasks or {}
    r.speed = speed or []
    return r


def test_each_measure_regresses_in_its_own_direction():
    old = [{"model": "m", "ppl_by_kind": {"docs": 10.0, "code": 5.0}, "task_main": {"mc": ["acc", 0.50]},
            "speed": [{"batch_size": 1, "tok_s": 100.0}, {"batch_size": 8, "tok_s": 500.0}]},
           {"model": "gone", "ppl_by_kind": {"docs": 1.0}}]
    new = [row("m", ppl={"docs": 10.0 * (1 + 2 * PPL_TOL), "code": 4.9, "chat": 3.0},
               tasks={"mc": ["acc", 0.485], "gen": ["exact_match", 0.1]},
               speed=[{"batch_size": 1, "tok_s": 99.0}, {"batch_size": 8, "tok_s": 400.0}]),
           row("new-model", ppl={"docs": 1.0})]
    d = {x["measure"]: x for x in compare(new, old)}
    assert set(d) == {"ppl docs", "ppl code", "mc acc", "tok/s bs=1", "tok/s bs=8"}  # only what both have
    assert d["ppl docs"]["regression"] and not d["ppl code"]["regression"]  # +1% worse, -2% better
    assert d["mc acc"]["regression"] and d["mc acc"]["change"] == pytest.approx(-0.015)
    assert not d["tok/s bs=1"]["regression"] and d["tok/s bs=8"]["regression"]  # -1% noise, -20% not
    md = compare_table(list(d.values()), "old.json")
    assert md.startswith("Against old.json: 3 regression(s)") and md.count("**regression**") == 3
    assert "+1.00%" in md and "-1.50 pts" in md


def test_a_different_metric_is_not_compared():
    old = [{"model": "m", "task_main": {"mc": ["acc_norm", 0.9]}}]
    assert compare([row("m", tasks={"mc": ["acc", 0.1]})], old) == []
    assert compare_table([]) == ""


def test_bad_report_files_are_one_error(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_report(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="not JSON"):
        load_report(tmp_path / "bad.json")
    (tmp_path / "dict.json").write_text(json.dumps({"model": "m"}))
    with pytest.raises(UserError, match="not an optllm eval report"):
        load_report(tmp_path / "dict.json")
