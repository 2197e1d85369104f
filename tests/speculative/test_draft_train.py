"""train-draft end to end on a tiny random Llama: the output folder, an interrupted run
resumed to the same losses, and bad input as one clear line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from optllm.errors import UserError
from optllm.speculative.data import read_dataset
from optllm.speculative.target import same_target, target_identity
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


def test_identity_ignores_the_writer_and_accepts_the_byte_hash_drafts_recorded_before(tiny_chat, tmp_path):
    """The same model written by another transformers (its version, key order, indentation) keeps
    its identity; a draft's record of the older hash (config.json's bytes) still matches."""
    other = tmp_path / "other"
    shutil.copytree(tiny_chat, other)
    raw = (other / "config.json").read_bytes()
    cfg = json.loads(raw)
    moved = {"transformers_version": "9.99.0", "_name_or_path": "/elsewhere"} | dict(reversed(list(cfg.items())))
    (other / "config.json").write_text(json.dumps(moved, indent=4))
    assert target_identity(other) == target_identity(tiny_chat)
    assert same_target(target_identity(tiny_chat), other) and not same_target(None, other)
    # the legacy hash: sha256 of the bytes, then the tensor's name and bytes
    tensors = {}
    for f in sorted(Path(tiny_chat).glob("*.safetensors")):
        tensors |= load_file(f)
    name = "lm_head.weight" if not cfg.get("tie_word_embeddings") and "lm_head.weight" in tensors \
        else "model.embed_tokens.weight"
    legacy = hashlib.sha256(raw + name.encode() + tensors[name].contiguous().reshape(-1).view(torch.uint8)
                            .numpy().tobytes()).hexdigest()
    assert legacy != target_identity(tiny_chat)
    assert same_target(legacy, tiny_chat) and not same_target(legacy, other)  # other's bytes differ
    assert not same_target("0" * 64, tiny_chat)


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

    # the run's own held-out split continues, whatever --holdout the resume is given (0: none held out)
    assert json.loads((work / "checkpoint-2" / "trainer_state.json").read_text())["holdout"] == 1
    resumed = train_draft(DraftConfig(target=str(tiny_chat), out=out, resume=work / "checkpoint-2",
                                      **{**SMALL, "holdout": 0}), log=lambda _: None)
    assert [s for s, _ in resumed.losses] == [3, 4]
    for (_, want), (_, got) in zip(result.losses[2:], resumed.losses):
        assert abs(want - got) < 1e-6
    a, b = load_file(a_out / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_bad_input_through_the_api(tiny_chat, tmp_path):
    with pytest.raises(UserError, match="unknown method 'foo'; allowed: medusa"):
        DraftConfig(target=str(tiny_chat), out=tmp_path / "o", method="foo")
    with pytest.raises(UserError, match="labels='kl' is not allowed; allowed: soft, hard"):
        DraftConfig(target=str(tiny_chat), out=tmp_path / "o", method="eagle3", labels="kl")
    with pytest.raises(UserError, match="labels is an eagle / eagle3 option"):
        DraftConfig(target=str(tiny_chat), out=tmp_path / "o", method="medusa", labels="soft")
    assert DraftConfig(target=str(tiny_chat), out=tmp_path / "o", method="eagle3").labels == "soft"
    with pytest.raises(UserError, match="prompt file .*nope.jsonl not found"):
        train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "o", prompts=tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match="not a checkpoint folder"):
        train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "o", resume=tmp_path))
    (tmp_path / "exists").mkdir()
    with pytest.raises(UserError, match="exists; pass --overwrite"):
        train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "exists"))


def test_dataset_of_an_earlier_run_is_reused(straight, tiny_chat, tmp_path):
    """--dataset: another method trains on the first run's sequences, nothing generated."""
    _, first, _ = straight
    logs: list[str] = []
    out = tmp_path / "eagle"
    small = {**SMALL, "max_steps": 2, "checkpoint_every": 2}
    result = train_draft(DraftConfig(target=str(tiny_chat), out=out, method="eagle", dataset=first / "dataset.jsonl",
                                     **small), log=logs.append)
    assert result.step == 2 and not any(line.startswith("data:") for line in logs)
    assert (out / "dataset.jsonl").read_bytes() == (first / "dataset.jsonl").read_bytes()
    assert json.loads((out / "config.json").read_text())["training"]["dataset"] == str(first / "dataset.jsonl")


@pytest.mark.parametrize("content, pattern", [
    ('{"token_ids": [1, 2, 999], "num_prompt_tokens": 1}\n', "token id 999, past the target's vocabulary of 320"),
    ('{"token_ids": [1, 2], "num_prompt_tokens": 2}\n', "sequence 1 has no answer token"),
    ('{"tokens": [1, 2]}\n', "not a train-draft dataset.jsonl"),
    ("not json\n", "not a train-draft dataset.jsonl"),
    ("", "no sequences"),
])
def test_bad_dataset_is_one_clear_error(content, pattern, tiny_chat, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(content)
    with pytest.raises(UserError, match=pattern):
        train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "o", method="eagle", dataset=data,
                                **{**SMALL, "max_steps": 1}))
    assert not (tmp_path / "o").exists()


def test_dataset_excludes_other_data_sources(tiny_chat, tmp_path):
    with pytest.raises(UserError, match="dataset is not allowed with prompts or resume"):
        DraftConfig(target=str(tiny_chat), out=tmp_path / "o", dataset=tmp_path / "d.jsonl", prompts=tmp_path / "p")
    with pytest.raises(UserError, match="dataset file .*nope.jsonl not found"):
        train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "o", dataset=tmp_path / "nope.jsonl"))


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
    ("missing-dataset", "dataset file"),
    ("init-from", "not a draft folder"),
    ("openers-file", "--openers"),
    ("openers-dataset", "--openers is not allowed with --dataset"),
])
def test_bad_input_is_one_line(case, pattern, tiny_llama, tiny_chat, tmp_path):
    args = {"method": [str(tiny_chat), "--method", "eagle9", "--out", str(tmp_path / "o")],
            "exists": [str(tiny_chat), "--out", str(tmp_path)],
            "no-template": [str(tiny_llama), "--out", str(tmp_path / "o"), "--device", "cpu", "--num-prompts", "2"],
            "missing-prompts": [str(tiny_chat), "--out", str(tmp_path / "o"), "--prompts", str(tmp_path / "x.jsonl")],
            "missing-dataset": [str(tiny_chat), "--out", str(tmp_path / "o"), "--dataset", str(tmp_path / "x.jsonl")],
            "init-from": [str(tiny_chat), "--out", str(tmp_path / "o"), "--init-from", str(tmp_path)],
            "openers-file": [str(tiny_chat), "--out", str(tmp_path / "o"), "--openers", str(tmp_path / "none.txt")],
            "openers-dataset": [str(tiny_chat), "--out", str(tmp_path / "o"), "--openers", "builtin",
                                "--dataset", str(tmp_path / "x.jsonl")],
            }[case]
    r = _cli(*args)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and pattern in lines[0], r.stderr
    assert "Traceback" not in r.output
    assert not (tmp_path / "o").exists()


def _timed_run(monkeypatch, increments: list[float]) -> dict:
    """Fake train.py's clock: each reading advances it by the next of `increments` (one reading at the
    start, one after each step); returns the DraftConfig fields of a long run with no evaluation or
    checkpoint in the way."""
    from types import SimpleNamespace

    from optllm.speculative import train as train_mod

    steps = iter(increments)
    clock = {"now": 0.0}

    def monotonic() -> float:
        clock["now"] += next(steps)
        return clock["now"]

    monkeypatch.setattr(train_mod, "time", SimpleNamespace(monotonic=monotonic))
    return {**SMALL, "max_steps": 1000, "warmup_steps": 2, "checkpoint_every": 1000, "eval_every": 1000}


def test_time_limit_shortens_the_schedule_and_writes_the_draft(tiny_chat, tmp_path, monkeypatch):
    """A run whose max_steps cannot fit its time limit: after the probe steps the cosine schedule
    is planned for the steps that fit (the learning rate still reaches zero at the last one), and
    the draft is written. The plan takes the probe's median step, not its mean: the first steps at
    a new padded length are slow (warm-up), the rest are not. The clock is faked (one reading at the
    start and one after each step), so the test is exact."""
    # the readings: t0 = 0; after step 1 (warm-up, not timed): 1; steps 2-4 take 5 s each, then 1 s
    logs: list[str] = []
    kw = _timed_run(monkeypatch, [0.0, 1.0] + [5.0] * 3 + [1.0] * 1000)
    out = tmp_path / "timed"
    result = train_draft(DraftConfig(target=str(tiny_chat), out=out, time_limit=60, **kw), log=logs.append)
    # after step 11 the clock reads 1 + 15 + 7 = 23; median 1 s a step (mean 2.2 s), 60 - 23 - 10 = 27 s
    # left -> 11 + 27 = 38 steps (planning on the mean would have given 23)
    assert any("1000.0 ms a step (median of steps 2-11; mean 2200.0)" in line for line in logs), logs
    assert any("38 of 1000 steps fit" in line for line in logs), logs
    assert result.step == 38 and [s for s, _ in result.losses] == list(range(1, 39))
    assert logs[-2].startswith("step 38/38") and "lr 0.00e+00" in logs[-2]
    assert (out / "model.safetensors").is_file()
    with pytest.raises(UserError, match="time_limit"):
        DraftConfig(target=str(tiny_chat), out=tmp_path / "o", time_limit=0)


def test_time_limit_plan_is_checked_again_when_steps_slow_down(tiny_chat, tmp_path, monkeypatch):
    """After the probe, every 50 timed steps the plan is checked on the mean step since the probe:
    steps that grew slower (longer sequences later in the data) shorten the schedule again, so the
    learning rate still reaches zero at the limit instead of training stopping mid-schedule."""
    logs: list[str] = []
    kw = _timed_run(monkeypatch, [0.0, 1.0] + [1.0] * 10 + [3.0] * 1000)  # steps 2-11: 1 s; from step 12: 3 s
    result = train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "t", time_limit=200, **kw),
                         log=logs.append)
    # step 11: clock 11, 200 - 11 - 10 = 179 s left at 1 s -> 190 steps; step 51: clock 11 + 40 * 3 = 131,
    # 59 s left at 3 s -> 51 + 19 = 70 steps
    assert any("190 of 1000 steps fit" in line for line in logs), logs
    assert any("3000.0 ms a step, 70 of 190 steps fit" in line for line in logs), logs
    assert not any("reached at step" in line for line in logs), logs
    assert result.step == 70 and logs[-2].startswith("step 70/70") and "lr 0.00e+00" in logs[-2]


def test_collate_rounds_the_padded_length_up():
    from optllm.speculative.data import DraftSequence
    from optllm.speculative.train import _collate

    batch = [DraftSequence(token_ids=list(range(1, 71)), num_prompt_tokens=20),
             DraftSequence(token_ids=list(range(1, 11)), num_prompt_tokens=4)]
    for pad_to, width in ((1, 70), (64, 128), (70, 70)):
        ids, attn, mask = _collate(batch, "cpu", pad_to)
        assert ids.shape == attn.shape == mask.shape == (2, width)
        assert attn.sum(1).tolist() == [70, 10] and mask.sum(1).tolist() == [50, 6]
        assert ids[0, :70].tolist() == list(range(1, 71)) and not ids[:, 70:].any()
        assert mask[1, 4:10].all() and not mask[1, :4].any() and not mask[:, 70:].any()


def test_a_quantized_target_trains_on_its_dequantized_weights(tiny_chat, tmp_path, monkeypatch):
    """train-draft on an `optllm quantize` checkpoint: the target is read through formats/ (no
    compressed-tensors package: importing it fails here), its linears hold the dequantized
    weights, and the draft records the quantized checkpoint's identity."""
    import sys

    from optllm.formats.compressed_tensors import load_quantized_weights
    from optllm.quant.config import QuantizeConfig
    from optllm.quant.pipeline import quantize
    from optllm.speculative.target import load_target

    ckpt = tmp_path / "w4"
    quantize(str(tiny_chat), ckpt, QuantizeConfig(scheme="w4a16-rtn", group_size=32, num_samples=2, seq_len=16),
             progress=False)
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)
    model, folder = load_target(str(ckpt))
    qweights, _, _ = load_quantized_weights(ckpt)
    assert qweights and folder == ckpt
    for name, qw in qweights.items():
        assert torch.equal(model.get_submodule(name).weight, qw.dequantize().to(torch.float32)), name
    float_model, _ = load_target(str(tiny_chat))
    assert not torch.equal(model.model.layers[0].mlp.down_proj.weight, float_model.model.layers[0].mlp.down_proj.weight)
    out = tmp_path / "eagle"
    result = train_draft(DraftConfig(target=str(ckpt), out=out, method="eagle", **{**SMALL, "max_steps": 2}))
    assert result.step == 2
    assert json.loads((out / "config.json").read_text())["target"]["sha256"] == target_identity(ckpt)


def test_init_from_starts_from_an_earlier_draft(straight, tiny_chat, tmp_path):
    """--init-from: the earlier draft's weights start the run (a learning rate too small to move them
    leaves them as they were; without the load the heads start from their fresh initialisation)."""
    _, first, _ = straight
    logs: list[str] = []
    out = tmp_path / "more"
    small = {**SMALL, "max_steps": 1, "checkpoint_every": 1, "lr": 1e-12}
    train_draft(DraftConfig(target=str(tiny_chat), out=out, dataset=first / "dataset.jsonl", init_from=first, **small),
                log=logs.append)
    a, b = load_file(first / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)
    assert any(line.startswith(f"weights from {first} (4 steps") for line in logs)
    assert not any(line.startswith("warning") for line in logs)
    assert json.loads((out / "config.json").read_text())["training"]["init_from"] == str(first)
    fresh = tmp_path / "fresh"
    train_draft(DraftConfig(target=str(tiny_chat), out=fresh, dataset=first / "dataset.jsonl", **small),
                log=lambda _: None)
    assert not torch.allclose(a["medusa_head.0.0.linear.weight"], load_file(fresh / "model.safetensors")[
        "medusa_head.0.0.linear.weight"], atol=1e-6, rtol=0)


def test_init_from_another_target_warns(straight, tiny_chat, tmp_path):
    _, first, _ = straight
    other = tmp_path / "other"
    shutil.copytree(tiny_chat, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5 if cfg.get("rms_norm_eps") != 1e-5 else 1e-6
    (other / "config.json").write_text(json.dumps(cfg))
    logs: list[str] = []
    train_draft(DraftConfig(target=str(other), out=tmp_path / "o", dataset=first / "dataset.jsonl", init_from=first,
                            **{**SMALL, "max_steps": 1, "checkpoint_every": 1}), log=logs.append)
    assert any(line.startswith(f"warning: --init-from {first} was trained for another target") for line in logs)


@pytest.mark.parametrize("case, pattern", [
    ("method", r"a 'medusa' draft cannot start a --method eagle run"),
    ("sizes", r"its weights do not fit this run's draft \(medusa_head.2.0.linear.bias: \(64,\) there, absent here\)"),
    ("folder", "not a draft folder"),
    ("broken", "cannot read the draft"),
])
def test_init_from_bad_draft_is_one_clear_error(case, pattern, straight, tiny_chat, tmp_path):
    _, first, _ = straight
    src, extra = first, {}
    if case == "method":
        extra = {"method": "eagle"}
    elif case == "sizes":
        extra = {"num_heads": 2}
    elif case == "folder":
        src = tmp_path
    else:
        src = tmp_path / "broken"
        src.mkdir()
        shutil.copy(first / "config.json", src)
        (src / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(UserError, match=pattern):
        train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "o", dataset=first / "dataset.jsonl",
                                init_from=src, **{**SMALL, "max_steps": 1, **extra}), log=lambda _: None)
    assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()  # nothing left half-written
    with pytest.raises(UserError, match="init_from is not allowed with resume"):
        DraftConfig(target=str(tiny_chat), out=tmp_path / "o", init_from=first, resume=first / "checkpoint-2")


@pytest.mark.parametrize("line, pattern", [
    ('{"token_ids": [1, 2, 99999, 4], "num_prompt_tokens": 3}', "token id 99999, past this target's vocabulary"),
    ("{not json", "p.jsonl:1: not JSON"),
])
def test_a_bad_prompt_file_leaves_nothing_behind(tiny_chat, tmp_path, line, pattern):
    """The data are written before any step: a prompt file that fails there is one clear error, and
    the run's work folder goes with it (no 'unfinished run' to resume or overwrite next time)."""
    f = tmp_path / "p.jsonl"
    f.write_text(line + "\n")
    for _ in range(2):  # the second run meets the same error, not the first one's leftovers
        with pytest.raises(UserError, match=pattern):
            train_draft(DraftConfig(target=str(tiny_chat), out=tmp_path / "o", prompts=f, **SMALL), log=lambda _: None)
        assert not (tmp_path / "o").exists() and not (tmp_path / ".o.partial").exists()


def test_openers_start_the_written_prompts_and_evaluation_prompts_are_kept_out(tiny_chat, tmp_path, monkeypatch):
    """train-draft --openers FILE: every written prompt begins with one of them; the cli hands the evaluation's
    held-out prompts to the data step, which drops a written turn that overlaps one (here: every turn that begins
    with the opener "Explain", made a held-out prompt), and the draft's config records the openers, not the list."""
    import optllm.eval.speculation as ev

    monkeypatch.setattr(ev, "heldout_user_prompts", lambda: ["Explain"])
    f = tmp_path / "openers.txt"
    f.write_text("Write a story\nExplain\n")
    out = tmp_path / "d"
    r = _cli(str(tiny_chat), "--out", str(out), "--device", "cpu", "--num-prompts", "6", "--max-steps", "1",
             "--seq-len", "64", "--answer-tokens", "4", "--batch-size", "2", "--holdout", "1", "--openers", str(f))
    assert r.exit_code == 0, (r.output, r.exception)
    from optllm.runtime.llm import LLM
    from optllm.speculative.data import overlaps

    tok = LLM(str(tiny_chat), device="cpu", max_model_len=64).tokenizer
    seqs = read_dataset(out / "dataset.jsonl")
    prompts = [tok.decode(s.token_ids[:s.num_prompt_tokens]) for s in seqs]
    assert prompts and all("Write a story" in p or "Explain" in p for p in prompts), prompts
    assert not any(overlaps(prompts, ["Explain"])), prompts  # no kept prompt holds the held-out one
    assert "dropped as overlapping an evaluation prompt" in r.output
    training = json.loads((out / "config.json").read_text())["training"]
    assert training["openers"] == ["Write a story", "Explain"] and "exclude_prompts" not in training
