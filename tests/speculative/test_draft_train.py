"""train-draft end to end on a tiny random Llama: the output folder, an interrupted run
resumed to the same losses, and bad input as one clear line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from optllm.errors import UserError
from optllm.speculative.data import read_dataset
from optllm.speculative.target import target_identity
from optllm.speculative.train import DraftConfig, train_draft

SMALL = dict(num_heads=3, num_prompts=6, max_steps=4, batch_size=2, grad_accum=2, warmup_steps=1, seq_len=96,
             answer_tokens=12, checkpoint_every=2, eval_every=2, holdout=1, device="cpu", seed=0)


@pytest.fixture(scope="module")
def straight(tiny_chat, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft") / "straight"
    logs: list[str] = []
    result = train_draft(DraftConfig(target=str(tiny_chat), out=out, **SMALL), log=logs.append)
    return result, out, logs


def test_output_folder(straight, tiny_chat):
    result, out, logs = straight
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "config.json", "dataset.jsonl",
                                                     "model.safetensors"]
    assert not any(p.name.endswith(".partial") for p in out.parent.iterdir())
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["method"], cfg["num_heads"], cfg["hidden_size"], cfg["vocab_size"]) == ("medusa", 3, 64, 320)
    assert cfg["target"]["sha256"] == target_identity(tiny_chat) and len(cfg["target"]["sha256"]) == 64
    assert cfg["training"]["steps"] == 4 and cfg["training"]["final_loss"] == pytest.approx(result.losses[-1][1])
    weights = load_file(out / "model.safetensors")
    assert sorted(weights) == sorted(f"medusa_head.{k}.{n}" for k in range(3)
                                     for n in ("0.linear.weight", "0.linear.bias", "1.weight"))
    assert weights["medusa_head.0.1.weight"].shape == (320, 64)
    assert float(weights["medusa_head.0.0.linear.weight"].abs().max()) > 0  # trained away from zero
    seqs = read_dataset(out / "dataset.jsonl")
    assert len(seqs) == 6 and all(0 < s.num_prompt_tokens < len(s.token_ids) <= 96 for s in seqs)
    assert [s for s, _ in result.losses] == [1, 2, 3, 4] and len(result.accuracy) == 3
    assert any("held-out top-1 h0" in line for line in logs) and any(line.startswith("step 4/4") for line in logs)


def test_identity_changes_with_the_target(tiny_chat, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_chat, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5 if cfg.get("rms_norm_eps") != 1e-5 else 1e-6
    (other / "config.json").write_text(json.dumps(cfg))
    assert target_identity(other) != target_identity(tiny_chat)


class _Stop(Exception):
    pass


def test_interrupted_run_resumes_to_the_same_losses(straight, tiny_chat, tmp_path):
    result, a_out, _ = straight
    out = tmp_path / "resumed"

    def crash_after_step_2(line):
        if line.startswith("step 3/"):
            raise _Stop

    with pytest.raises(_Stop):
        train_draft(DraftConfig(target=str(tiny_chat), out=out, **SMALL), log=crash_after_step_2)
    work = tmp_path / ".resumed.partial"
    assert (work / "checkpoint-2").is_dir() and not out.exists()
    with pytest.raises(UserError, match="unfinished run.*--resume .*checkpoint-2"):
        train_draft(DraftConfig(target=str(tiny_chat), out=out, **SMALL), log=lambda _: None)

    resumed = train_draft(DraftConfig(target=str(tiny_chat), out=out, resume=work / "checkpoint-2", **SMALL),
                          log=lambda _: None)
    assert [s for s, _ in resumed.losses] == [3, 4]
    for (_, want), (_, got) in zip(result.losses[2:], resumed.losses):
        assert abs(want - got) < 1e-6
    a, b = load_file(a_out / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_bad_input_through_the_api(tiny_chat, tmp_path):
    with pytest.raises(UserError, match="unknown method 'foo'; allowed: medusa"):
        DraftConfig(target=str(tiny_chat), out=tmp_path / "o", method="foo")
    with pytest.raises(UserError, match="prompt file .*nope.jsonl not found"):
        train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "o", prompts=tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match="not a checkpoint folder"):
        train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "o", resume=tmp_path))
    (tmp_path / "exists").mkdir()
    with pytest.raises(UserError, match="exists; pass --overwrite"):
        train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "exists"))


def _cli(*args):
    """The command in-process (typer's runner): the same code path as the console script,
    without a new interpreter's start-up per case."""
    from typer.testing import CliRunner

    from optllm.cli.app import app

    return CliRunner().invoke(app, ["train-draft", *args])


@pytest.mark.parametrize("case, pattern", [
    ("method", "unknown method 'eagle9'; allowed: medusa"),
    ("exists", "exists; pass --overwrite"),
    ("no-template", "no chat template"),
    ("missing-prompts", "not found"),
])
def test_bad_input_is_one_line(case, pattern, tiny_llama, tiny_chat, tmp_path):
    args = {"method": [str(tiny_chat), "--method", "eagle9", "--out", str(tmp_path / "o")],
            "exists": [str(tiny_chat), "--out", str(tmp_path)],
            "no-template": [str(tiny_llama), "--out", str(tmp_path / "o"), "--device", "cpu", "--num-prompts", "2"],
            "missing-prompts": [str(tiny_chat), "--out", str(tmp_path / "o"), "--prompts", str(tmp_path / "x.jsonl")],
            }[case]
    r = _cli(*args)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and pattern in lines[0], r.stderr
    assert "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


def test_time_limit_shortens_the_schedule_and_writes_the_draft(tiny_chat, tmp_path, monkeypatch):
    """A run whose max_steps cannot fit its time limit: after the probe steps the cosine schedule
    is planned for the steps that fit (the learning rate still reaches zero at the last one), and
    the draft is written. The clock is faked (one second per reading), so the test is exact."""
    import itertools
    from types import SimpleNamespace

    from optllm.speculative import train as train_mod

    ticks = itertools.count(0.0, 1.0)
    monkeypatch.setattr(train_mod, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    logs: list[str] = []
    kw = {**SMALL, "max_steps": 1000, "warmup_steps": 2, "checkpoint_every": 1000, "eval_every": 1000}
    out = tmp_path / "timed"
    result = train_draft(DraftConfig(target=str(tiny_chat), out=out, time_limit=40, **kw), log=logs.append)
    # readings: t0 = 0; step 1 starts the probe at 1; steps 2..10 read once each; step 11 reads 12 and 13:
    # 1.1 s a step, 40 - 13 - 10 = 17 s left -> 11 + 15 = 26 steps
    assert any("26 of 1000 steps fit" in line for line in logs), logs
    assert result.step == 26 and [s for s, _ in result.losses] == list(range(1, 27))
    assert logs[-2].startswith("step 26/26") and "lr 0.00e+00" in logs[-2]
    assert (out / "model.safetensors").is_file()
    with pytest.raises(UserError, match="time_limit"):
        DraftConfig(target=str(tiny_chat), out=tmp_path / "o", time_limit=0)
