"""`optllm quantize` flags over a recipe: a flag the user gives wins over the recipe's field,
"channel" included (it was lost under --recipe when None meant both "not given" and
"per-channel"); bad values are one line and exit code 2."""

import json
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "optllm", *args], capture_output=True, text=True)


def test_quantize_group_size_channel_survives_a_recipe(tiny_llama, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("scheme: w4a16-rtn\ngroup_size: 32\nnum_samples: 2\nseq_len: 16\n")
    r = run("quantize", str(tiny_llama), "--recipe", str(recipe), "--group-size", "channel", "--no-compare",
            "--out", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["strategy"], w["group_size"]) == ("channel", None)
    report = json.loads((tmp_path / "q" / "optllm-report.json").read_text())
    assert report["config"]["group_size"] == "channel" and report["config"]["num_samples"] == 2


def test_quantize_recipe_null_group_size_is_one_line(tiny_llama, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("scheme: w4a16-rtn\ngroup_size: null\n")
    r = run("quantize", str(tiny_llama), "--recipe", str(recipe), "--no-compare", "--out", str(tmp_path / "q"))
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("error: group_size: null is ambiguous; write 'channel'")


def test_quantize_fp8_compares_with_the_float_model_only(tiny_llama, tmp_path):
    """FP8 has no integer-RTN counterpart: its closing comparison is beside the float model
    only, labelled with the scheme's own name, and the vLLM line names its format."""
    r = run("quantize", str(tiny_llama), "--scheme", "fp8-dynamic", "--compare-windows", "1",
            "--out", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    assert "fp8-dynamic (this checkpoint)" in r.stdout and "rtn" not in r.stdout.lower()
    assert "vLLM: loads this checkpoint (compressed-tensors float-quantized)." in r.stdout
    rows = json.loads((tmp_path / "q" / "optllm-report.json").read_text())["comparison"]["rows"]
    assert [x["label"] for x in rows] == ["float", "fp8-dynamic (this checkpoint)"]
