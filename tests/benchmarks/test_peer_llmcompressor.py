"""benchmarks/peer_llmcompressor.py without the peer venv: the token hash it copies from
optllm, and `eval`'s bookkeeping (who made a folder, same calibration, the table, a folder
that fails to load) around a stand-in evaluate_ppl."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from optllm.benchmarks import peer_llmcompressor as peer
from optllm.quant.calib_data import token_hash


def test_token_hash_copy_matches_optllm():
    ids = torch.randint(0, 49152, (3, 17), generator=torch.Generator().manual_seed(0))
    assert peer.token_hash(ids) == token_hash(ids)


def test_peer_name():
    assert peer.peer_name("gptq", 4, 64, False) == "llmc-gptq-w4-g64-sym"
    assert peer.peer_name("awq", 3, 128, True) == "llmc-awq-w3-g128-asym"


@dataclass
class _Row:
    model: str
    kind: str
    ppl: float
    nll: float = 1.0
    num_tokens: int = 100
    num_windows: int = 2
    seconds: float = 0.5
    ppl_by_kind: dict = field(default_factory=dict)


def _folder(path, quantized: bool, record: tuple[str, dict] | None = None):
    path.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"]}
    if quantized:
        cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    (path / "config.json").write_text(json.dumps(cfg))
    if record:
        (path / record[0]).write_text(json.dumps(record[1]))
    return path


def test_eval_table_and_json(tmp_path, monkeypatch, capsys):
    sha = "ab" * 32
    (tmp_path / peer.PREPARE_FILE).write_text(json.dumps({"calibration": {"sha256": sha}}))
    fl = _folder(tmp_path / "float", quantized=False)
    theirs = _folder(tmp_path / "llmc-gptq-w4-g64-sym", True, (peer.PEER_FILE, {
        "versions": {"llmcompressor": "0.14.0.1"}, "algo": "gptq",
        "calibration": {"sha256": sha}, "seconds": {"oneshot": 12.5}}))
    ours = _folder(tmp_path / "optllm-gptq-w4-g64-sym", True, (peer.OUR_REPORT, {
        "scheme": "w4a16-gptq", "calibration": {"sha256": "cd" * 32}, "seconds": {"quantize": 3.0}}))
    broken = _folder(tmp_path / "llmc-awq-w4-g64-sym", True)

    ppls = {str(fl): (10.0, 4.0), str(theirs): (11.0, 5.0), str(ours): (10.5, 4.4)}
    seen = {}

    def fake_evaluate_ppl(models, kinds=None, **kw):
        seen.update(kw, kinds=kinds)
        (name,) = models
        if name == str(broken):
            raise ValueError("weight_g_idx is not supported\nsecond line")
        docs, code = ppls[name]
        return [_Row(name, "float", docs, ppl_by_kind={"docs": docs, "code": code})]

    monkeypatch.setattr("optllm.eval.evaluate.evaluate_ppl", fake_evaluate_ppl)
    out = tmp_path / "eval.json"
    peer.main(["eval", "--dirs", str(fl), str(theirs), str(ours), str(broken), "--kinds", "docs", "code",
               "--max-windows", "2", "--json", str(out)])

    assert seen["kinds"] == ["docs", "code"] and seen["max_windows"] == 2 and seen["device"] == "cpu"
    data = json.loads(out.read_text())
    rows = {r["model"]: r for r in data["rows"]}
    assert rows["float"]["made_by"] == "float" and rows["float"]["same_calibration"] is None
    assert rows["llmc-gptq-w4-g64-sym"]["same_calibration"] is True
    assert rows["optllm-gptq-w4-g64-sym"]["same_calibration"] is False
    assert rows["llmc-awq-w4-g64-sym"]["error"] == "ValueError: weight_g_idx is not supported"
    assert "Traceback" in rows["llmc-awq-w4-g64-sym"]["traceback"]
    table = capsys.readouterr().out
    assert "| ppl docs | ppl code | Δ vs float |" in table
    assert "| llmc-gptq-w4-g64-sym | llm-compressor 0.14.0.1 gptq | yes | 11.0000 | 5.0000 | +10.0% / +25.0% | 12.5 |" \
        in table
    assert "| optllm-gptq-w4-g64-sym | optllm w4a16-gptq | NO |" in table
    assert "load failed: ValueError: weight_g_idx is not supported" in table


def test_eval_kinds_need_a_kinds_argument(tmp_path, monkeypatch):
    fl = _folder(tmp_path / "float", quantized=False)

    def old_evaluate_ppl(models, seq_len=512, max_windows=None, dtype="float32", device="cpu", progress=True):
        return [_Row(models[0], "float", 9.0)]

    monkeypatch.setattr("optllm.eval.evaluate.evaluate_ppl", old_evaluate_ppl)
    with pytest.raises(SystemExit, match="no kinds= argument"):
        peer.main(["eval", "--dirs", str(fl), "--kinds", "docs"])
    peer.main(["eval", "--dirs", str(fl)])  # without --kinds: the one ppl column
