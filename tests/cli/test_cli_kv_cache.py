"""`optllm quantize --kv-cache`: the flag reaches the checkpoint's kv_cache_scheme (and a
recipe's field loses to it); a bad value is one line and exit code 2."""

import json
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "optllm", *args], capture_output=True, text=True)


def test_quantize_kv_cache_flag_writes_the_scheme(tiny_llama, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("scheme: w4a16-rtn\ngroup_size: 32\nnum_samples: 2\nseq_len: 16\nkv_cache: fp8\n")
    r = run("quantize", str(tiny_llama), "--recipe", str(recipe), "--kv-cache", "fp8-head", "--no-compare",
            "--out", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["strategy"] == "attn_head" and qc["kv_cache_scheme"]["type"] == "float"
    report = json.loads((tmp_path / "q" / "optllm-report.json").read_text())
    assert report["config"]["kv_cache"] == "fp8-head" and len(report["kv_cache"]["layers"]) == 2


def test_quantize_bad_kv_cache_is_one_line(tiny_llama, tmp_path):
    r = run("quantize", str(tiny_llama), "--kv-cache", "fp16", "--no-compare", "--out", str(tmp_path / "q"))
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0] == "error: kv_cache='fp16' is not allowed; allowed: none, fp8, fp8-head"
