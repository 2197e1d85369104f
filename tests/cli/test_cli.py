"""The CLI: bad input is one line on stderr and exit code 2, never a traceback."""

import json
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


def test_bad_gptq_grid(tiny_llama, tmp_path):
    _one_clear_line(run("quantize", str(tiny_llama), "--scheme", "w4a16-gptq", "--gptq-grid", "absmax",
                        "--out", str(tmp_path / "o")), "GPTQ grid 'absmax' is not allowed; allowed: minmax, mse, hmse")
    assert not (tmp_path / "o").exists()


def test_corrupt_checkpoint_in_eval(tiny_llama, tmp_path):
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    _one_clear_line(run("eval", str(tmp_path / "m"), "--ppl"), "is not a valid safetensors file")


def test_quantize_then_eval(tiny_llama, tmp_path):
    r = run("quantize", str(tiny_llama), "--scheme", "w4a16-gptq", "--group-size", "32", "--num-samples", "4",
            "--seq-len", "32", "--no-compare", "--out", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    assert "w4a16-gptq" in r.stdout and "vLLM: loads this checkpoint" in r.stdout
    r = run("eval", str(tiny_llama), str(tmp_path / "q"), "--ppl", "--seq-len", "64", "--max-windows", "4",
            "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    assert "| ppl docs | Δ docs | ppl code | Δ code | ppl chat | Δ chat |" in r.stdout and "w4a16-gptq" in r.stdout
    assert (tmp_path / "rep" / "report.md").is_file() and (tmp_path / "rep" / "ppl.png").is_file()


def test_eval_per_kind_and_a_text_file(tiny_llama, tmp_path):
    (tmp_path / "notes.txt").write_text("Some notes of mine, measured as a kind of their own. " * 30, encoding="utf-8")
    r = run("eval", str(tiny_llama), "--kinds", "code,chat", "--text", str(tmp_path / "notes.txt"), "--seq-len", "32",
            "--max-windows", "2", "--device", "cpu", "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    assert "| ppl code | Δ code | ppl chat | Δ chat | ppl notes | Δ notes |" in r.stdout
    (row,) = json.loads((tmp_path / "rep" / "report.json").read_text())["rows"]
    assert list(row["ppl_by_kind"]) == ["code", "chat", "notes"] and row["ppl"] == row["ppl_by_kind"]["code"]
    assert row["windows_by_kind"] == {"code": 2, "chat": 2, "notes": 2}


def test_eval_bad_text_file_or_kind_is_one_line(tiny_llama, tmp_path):
    (tmp_path / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    _one_clear_line(run("eval", str(tiny_llama), "--text", str(tmp_path / "binary.txt")), "is not UTF-8 text")
    _one_clear_line(run("eval", str(tiny_llama), "--text", str(tmp_path / "missing.txt")), "does not exist")
    _one_clear_line(run("eval", str(tiny_llama), "--kinds", "docs,poems"),
                    "unknown text kind 'poems'; allowed: docs, code, chat")


def test_models_lists_the_builtin_alias():
    r = run("models")
    assert r.returncode == 0 and "smollm2-135m" in r.stdout


def test_generate_streams_the_greedy_completion(tiny_llama):
    from optllm import LLM, SamplingParams

    r = run("generate", str(tiny_llama), "def main", "--max-tokens", "12", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    want = LLM(tiny_llama, device="cpu").generate("def main", SamplingParams(temperature=0, max_tokens=12))
    assert r.stdout.rstrip("\n") == want[0].outputs[0].text
    assert "stopped at --max-tokens" in r.stderr or want[0].outputs[0].finish_reason == "stop"


def test_generate_bad_input_is_one_line(tiny_llama):
    _one_clear_line(run("generate", str(tiny_llama), "hi", "--temperature", "-1", "--device", "cpu"), "temperature")
    _one_clear_line(run("generate", str(tiny_llama), "hi " * 600, "--device", "cpu"), "max_model_len")


def test_chat_uses_the_template_over_turns(tiny_llama, tmp_path):
    import json
    import shutil

    _one_clear_line(run("chat", str(tiny_llama), "--device", "cpu"), "no chat template")
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "optllm", "chat", str(folder), "--device", "cpu", "--max-tokens", "8",
                        "--temperature", "0"], input="hello\nand again\n\n", capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("model> ") == 2 and r.stdout.count("you> ") == 3


def test_eval_kernels_on_a_checkpoint_the_kernels_do_not_take(tiny_llama, tmp_path):
    r = run("quantize", str(tiny_llama), "--scheme", "w3a16-rtn", "--group-size", "32", "--num-samples", "4",
            "--seq-len", "32", "--no-compare", "--out", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    _one_clear_line(run("eval", str(tmp_path / "q"), "--ppl", "--kernels", "--device", "cpu", "--seq-len", "64"),
                    "use --dequant")


def test_quantize_says_when_vllm_will_not_load_the_checkpoint(tiny_llama, tmp_path):
    r = run("quantize", str(tiny_llama), "--scheme", "w3a16-rtn", "--group-size", "32", "--num-samples", "2",
            "--seq-len", "16", "--no-compare", "--out", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    note = [x for x in r.stderr.splitlines() if "will not load in vLLM" in x]
    assert len(note) == 1 and "not 3-bit" in note[0], r.stderr  # before the calibration, one line
    assert "vLLM: will not load this checkpoint. vLLM loads 4- and 8-bit integer weights" in r.stdout


def test_quantize_refuses_to_overwrite_the_model_it_reads(tiny_llama, tmp_path):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model)
    before = sorted(p.name for p in model.iterdir())
    _one_clear_line(run("quantize", str(model), "--scheme", "w4a16-rtn", "--group-size", "32", "--num-samples", "2",
                        "--seq-len", "16", "--out", str(model), "--overwrite"), "is the model being quantized")
    assert sorted(p.name for p in model.iterdir()) == before


def test_quantize_compares_with_rtn_on_every_text_kind(tiny_llama, tmp_path):
    r = run("quantize", str(tiny_llama), "--scheme", "w4a16-gptq", "--group-size", "32", "--num-samples", "4",
            "--seq-len", "32", "--compare-windows", "1", "--compare-symmetry", "--out", str(tmp_path / "q"))
    assert r.returncode == 0, r.stderr
    assert "Perplexity on each text kind's held-out split" in r.stdout
    assert "held-out calibration windows (2): " in r.stdout
    comp = json.loads((tmp_path / "q" / "optllm-report.json").read_text())["comparison"]
    assert comp["kinds"] == ["docs", "code", "chat"] and comp["max_windows_per_kind"] == 1
    rows = {(x["algorithm"], x["symmetric"]): x for x in comp["rows"]}
    assert set(rows) == {(None, None), ("gptq", True), ("rtn", True), ("gptq", False), ("rtn", False)}
    for (algo, sym), row in rows.items():
        assert set(row["ppl"]) == set(comp["kinds"]) and all(v > 1 for v in row["ppl"].values())
        assert ("gap_closed" in row) == (algo == "gptq")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".optllm-compare-")]  # temporaries removed


def test_eval_lm_eval_tasks_beside_perplexity(tiny_llama, tmp_path):
    """--tasks runs lm-eval tasks (our offline ones) through the runtime beside ppl, one report."""
    import json

    r = run("eval", str(tiny_llama), "--tasks", "ppl,optllm_mc,optllm_gen", "--limit", "3", "--seq-len", "64",
            "--max-windows", "2", "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    assert "| ppl docs |" in r.stdout and "optllm_mc acc_norm" in r.stdout and "optllm_gen exact_match" in r.stdout
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## lm-eval tasks" in md and (tmp_path / "rep" / "ppl.png").is_file()
    (row,) = json.loads((tmp_path / "rep" / "report.json").read_text())["rows"]
    assert set(row["tasks"]) == {"optllm_mc", "optllm_gen"}
    assert 0.0 <= row["tasks"]["optllm_mc"]["acc"] <= 1.0 and row["task_main"]["optllm_mc"][0] == "acc_norm"
    # tasks only: no perplexity table, no plot
    r = run("eval", str(tiny_llama), "--tasks", "optllm_mc", "--limit", "2", "--out", str(tmp_path / "rep2"))
    assert r.returncode == 0, r.stderr
    assert "ppl docs" not in r.stdout and not (tmp_path / "rep2" / "ppl.png").exists()


def test_eval_bad_tasks_are_one_line(tiny_llama, tmp_path):
    _one_clear_line(run("eval", str(tiny_llama), "--tasks", "optllm_mc,no_such_task_xyz"), "no_such_task_xyz")
    _one_clear_line(run("eval", str(tiny_llama), "--tasks", "optllm_mc", "--include-path", str(tmp_path / "nope")),
                    "not a folder")
    _one_clear_line(run("eval", str(tiny_llama), "--tasks", "optllm_mc", "--limit", "0"), "--limit")


def _png(path) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024


_SPEED = ("--speed", "--batch-sizes", "1,2", "--prompt-len", "8", "--output-len", "8", "--device", "cpu")


def test_eval_speed_alone_and_beside_perplexity(tiny_llama, tmp_path):
    """--speed alone measures only speed; with --ppl both land in one report, with every plot."""
    head = "| model | scheme | batch | tok/s | decode tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |"
    r = run("eval", str(tiny_llama), *_SPEED, "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    assert head in r.stdout and "ppl docs" not in r.stdout
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Speed" in md and head in md and "ppl docs" not in md
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == [
        "latency.png", "report.json", "report.md", "speed.png"]
    assert _png(tmp_path / "rep" / "speed.png") and _png(tmp_path / "rep" / "latency.png")
    (row,) = json.loads((tmp_path / "rep" / "report.json").read_text())["rows"]
    assert [s["batch_size"] for s in row["speed"]] == [1, 2] and row["num_windows"] == 0
    for s in row["speed"]:
        assert s["output_tokens"] == 2 * s["batch_size"] * 8 and s["itl_count"] == 2 * s["batch_size"] * 7
        assert s["tok_s"] > 0 and 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] and 0 < s["itl_p50_ms"] <= s["itl_p99_ms"]
    r = run("eval", str(tiny_llama), "--ppl", "--kinds", "docs", "--seq-len", "32", "--max-windows", "1", *_SPEED,
            "--out", str(tmp_path / "both"))
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "both" / "report.md").read_text()
    assert "| ppl docs |" in md and "## Speed" in md and head in md
    pngs = sorted(p for p in (tmp_path / "both").iterdir() if p.suffix == ".png")
    assert [p.name for p in pngs] == ["latency.png", "ppl.png", "quality_bits.png", "speed.png"]
    assert all(_png(p) for p in pngs)


def test_eval_bad_speed_options_are_one_line(tiny_llama):
    for bad in ("1,x", "0", "1,,2"):
        _one_clear_line(run("eval", str(tiny_llama), "--speed", "--batch-sizes", bad, "--device", "cpu"),
                        "--batch-sizes")
    # checked before the perplexity runs
    _one_clear_line(run("eval", str(tiny_llama), "--ppl", "--speed", "--output-len", "1", "--device", "cpu"),
                    "--output-len 1 is not allowed; allowed: an integer >= 2")
    _one_clear_line(run("eval", str(tiny_llama), "--speed", "--bandwidth", "-5", "--device", "cpu"), "--bandwidth")


def test_eval_compare_marks_regressions_against_an_earlier_report(tiny_llama, tmp_path):
    import json

    args = ("eval", str(tiny_llama), "--ppl", "--kinds", "docs", "--seq-len", "32", "--max-windows", "1")
    r = run(*args, "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    r = run(*args, "--compare", str(tmp_path / "a" / "report.json"), "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert "0 regression(s)" in r.stdout  # the same model, the same windows
    assert "## Compared with an earlier run" in (tmp_path / "b" / "report.md").read_text()
    # an earlier run that was better: marked
    old = json.loads((tmp_path / "a" / "report.json").read_text())
    old["rows"][0]["ppl_by_kind"]["docs"] *= 0.9
    (tmp_path / "better.json").write_text(json.dumps(old))
    r = run(*args, "--compare", str(tmp_path / "better.json"), "--out", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    assert "1 regression(s)" in r.stdout
    (entry,) = json.loads((tmp_path / "c" / "compare.json").read_text())
    assert entry["measure"] == "ppl docs" and entry["regression"] is True
    _one_clear_line(run(*args, "--compare", str(tmp_path / "nope.json")), "no such file")


def test_eval_keeps_the_phases_it_finished_when_a_later_one_fails(tiny_llama, tmp_path):
    """--ppl then --draft with a draft built for another model: the draft fails to load after the
    perplexity phase, the run exits non-zero, and OUT holds the perplexity report, marked partial."""
    from conftest import make_tiny_model, write_draft

    other = make_tiny_model(tmp_path / "other", hidden=32)
    draft = write_draft(tmp_path / "draft", other, "medusa")
    r = run("eval", str(tiny_llama), "--ppl", "--kinds", "docs", "--seq-len", "32", "--max-windows", "1",
            "--draft", str(draft), "--batch-sizes", "1", "--output-len", "4", "--out", str(tmp_path / "rep"))
    assert r.returncode != 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert md.startswith("# optllm eval (partial: speculation not measured yet)") and "| ppl docs |" in md
