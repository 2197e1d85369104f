"""`optllm quantize --target-bits` end to end (a subprocess, as the other quantize CLI tests):
the checkpoint of several config groups within the budget, the choice printed and reported,
the closing comparison's RTN checkpoint on the same layout; a target no choice can meet is one
line and exit code 2, before any sensitivity pass."""

import json
import subprocess
import sys

import pytest
import yaml


def run(*args):
    return subprocess.run([sys.executable, "-m", "optllm", *args], capture_output=True, text=True)


def test_target_bits_end_to_end(tiny_llama, tmp_path):
    out = tmp_path / "q"
    r = run(
        "quantize",
        str(tiny_llama),
        "--scheme",
        "w4a16-gptq",
        "--target-bits",
        "4.6",
        "--mixed-candidates",
        "w4g64,w4g32,w8",
        "--num-samples",
        "4",
        "--seq-len",
        "32",
        "--compare-windows",
        "1",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "optllm-report.json").read_text())
    mixed = report["mixed"]
    assert mixed["target_bits"] == 4.6 and mixed["average_bits"] <= 4.6 and mixed["optimal"]
    assert report["config"]["target_bits"] == 4.6 and report["config"]["mixed_candidates"] == ["w4g64", "w4g32", "w8"]
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert len(groups) == len({u["choice"] for u in mixed["units"]}) >= 2
    # the choice is printed: the table per block, then the one-line summary with the bits reached
    assert "mixed precision: scheme per linear (sensitivity)" in r.stdout
    assert f"mixed precision: {mixed['average_bits']:.4f} bits per weight on average (target 4.6)" in r.stdout
    # the comparison ran beside the float model and an RTN checkpoint of the same picks
    rows = report["comparison"]["rows"]
    assert [x["label"] for x in rows] == ["float", "w4a16-gptq (this checkpoint)", "w4a16-rtn"]
    assert all(v > 1 for x in rows for v in x["ppl"].values())
    # the checkpoint keeps its configuration as a recipe, target included
    assert yaml.safe_load((out / "recipe.yaml").read_text())["target_bits"] == 4.6


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--target-bits", "3"],
            "error: target_bits=3.0 is below the cheapest candidate (w4g128: 4.125 bits per weight); "
            "allowed: 4.125 to 16, or cheaper mixed_candidates",
        ),
        (
            ["--target-bits", "17"],
            "error: target_bits=17.0 is not allowed; allowed: a number of bits per weight up to 16, e.g. 4.5",
        ),
        (
            ["--target-bits", "4.5", "--scheme", "fp8"],
            "error: target_bits (mixed precision) needs a weight-only integer "
            "scheme (w4a16-*, w8a16-*, w3a16-*), not 'fp8'",
        ),
        (
            ["--target-bits", "4.5", "--mixed-candidates", "w4g64,int4"],
            "error: mixed candidate 'int4' is not allowed; allowed: w{bits}g{group}",
        ),
        # no group of 128 divides the tiny model's in_features (64, 192): only w8 fits, 8 bits + its scales'
        # 16 / in_features
        (
            ["--target-bits", "4.2", "--mixed-candidates", "w4g128,w8"],
            "error: target_bits 4.2 is below the cheapest "
            "choice the candidates allow on this model "
            "(8.2083 bits per weight on average); allowed: "
            "8.2084 to 16",
        ),
    ],
)
def test_target_bits_mistakes_are_one_line(tiny_llama, tmp_path, args, message):
    r = run(
        "quantize",
        str(tiny_llama),
        *args,
        "--num-samples",
        "2",
        "--seq-len",
        "16",
        "--no-compare",
        "--out",
        str(tmp_path / "q"),
    )
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
    assert not (tmp_path / "q").exists()
