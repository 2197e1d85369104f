"""The CLI: bad input is one line on stderr and exit code 2, never a traceback."""

import subprocess
import sys


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "optllm", *args], capture_output=True, text=True, env=env)


def _one_clear_line(r, pattern):
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and pattern in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_missing_model(tmp_path):
    _one_clear_line(run("quantize", "nope-model", "--scheme", "w4a16-rtn", "--out", str(tmp_path / "o")), "not found")


def test_unknown_scheme(tiny_llama, tmp_path):
    _one_clear_line(run("quantize", str(tiny_llama), "--scheme", "w4a16-foo", "--out", str(tmp_path / "o")),
                    "unknown scheme 'w4a16-foo'")


def test_unwritable_output(tiny_llama, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _one_clear_line(run("quantize", str(tiny_llama), "--scheme", "w4a16-rtn", "--out", str(blocker / "sub")),
                    "cannot write")


def test_bad_group_size(tiny_llama, tmp_path):
    _one_clear_line(run("quantize", str(tiny_llama), "--scheme", "w4a16-rtn", "--group-size", "48",
                        "--num-samples", "2", "--seq-len", "16", "--out", str(tmp_path / "o")),
                    "does not divide")
    assert not (tmp_path / "o").exists()


def test_corrupt_checkpoint_in_eval(tiny_llama, tmp_path):
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    _one_clear_line(run("eval", str(tmp_path / "m"), "--ppl"), "is not a valid safetensors file")


def test_quantize_then_eval(tiny_llama, tmp_path):
    r = run("quantize", str(tiny_llama), "--scheme", "w4a16-gptq", "--group-size", "32", "--num-samples", "4",
            "--seq-len", "32", "--out", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    assert "w4a16-gptq" in r.stdout
    r = run("eval", str(tiny_llama), str(tmp_path / "q"), "--ppl", "--seq-len", "64", "--max-windows", "4",
            "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    assert "| perplexity |" in r.stdout and "w4a16-gptq" in r.stdout
    assert (tmp_path / "rep" / "report.md").is_file() and (tmp_path / "rep" / "ppl.png").is_file()


def test_models_lists_the_builtin_alias():
    r = run("models")
    assert r.returncode == 0 and "smollm2-135m" in r.stdout
