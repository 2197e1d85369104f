"""evaluate_ppl per text kind (built-in kinds and user texts) and the report that shows them."""

from __future__ import annotations

import json

import pytest

from optllm.eval.evaluate import EvalRow, evaluate_ppl, parse_kinds, read_texts
from optllm.eval.perplexity import eval_token_stream, perplexity
from optllm.eval.report import markdown_table, write_report
from optllm.hub.corpus import KINDS

SEQ, WINDOWS = 32, 2


def test_parse_kinds():
    assert parse_kinds(None) == KINDS
    assert parse_kinds("code, docs,code") == ("code", "docs")
    assert parse_kinds(["chat"]) == ("chat",)
    assert parse_kinds("") == ()
    with pytest.raises(ValueError, match=r"unknown text kind 'poems'; allowed: docs, code, chat"):
        parse_kinds("docs,poems")


def test_read_texts_names_files_after_their_stem(tmp_path):
    (tmp_path / "mine.txt").write_text("one text", encoding="utf-8")
    (tmp_path / "docs.md").write_text("another", encoding="utf-8")
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "mine.txt").write_text(f"text in {sub}", encoding="utf-8")
    got = read_texts([tmp_path / "mine.txt", tmp_path / "docs.md", tmp_path / "a" / "mine.txt"], taken=("docs",))
    # "docs" is a built-in kind measured too, "mine" an earlier file: the full file name then
    assert got == {"mine": "one text", "docs.md": "another", "mine.txt": "text in a"}
    with pytest.raises(ValueError, match="two texts are named 'mine.txt'"):
        read_texts([tmp_path / "mine.txt", tmp_path / "a" / "mine.txt", tmp_path / "b" / "mine.txt"])
    with pytest.raises(ValueError, match="does not exist"):
        read_texts([tmp_path / "nope.txt"])


def test_evaluate_ppl_per_kind_equals_perplexity_on_each_stream(tiny_llama, tmp_path):
    from optllm import LLM

    user = "A user's own text, measured as one more kind. " * 40
    rows = evaluate_ppl([str(tiny_llama)], kinds="code,chat", texts={"mine": user}, seq_len=SEQ,
                        max_windows=WINDOWS, progress=False)
    (row,) = rows
    assert list(row.ppl_by_kind) == ["code", "chat", "mine"]
    assert row.windows_by_kind == {"code": WINDOWS, "chat": WINDOWS, "mine": WINDOWS}
    assert row.tokens_by_kind == {k: WINDOWS * (SEQ - 1) for k in ("code", "chat", "mine")}
    # the first kind is what row.ppl reports, for callers from before kinds
    assert (row.ppl, row.nll, row.num_tokens) == (row.ppl_by_kind["code"], row.nll_by_kind["code"], 2 * (SEQ - 1))
    llm = LLM(str(tiny_llama), device="cpu", max_model_len=SEQ)
    for kind in ("code", "chat"):
        ref = perplexity(llm, eval_token_stream(llm.tokenizer, kind), seq_len=SEQ, max_windows=WINDOWS)
        assert abs(row.ppl_by_kind[kind] / ref.ppl - 1) < 1e-6
    assert len(set(row.ppl_by_kind.values())) == 3  # three different texts, three numbers
    # the text= argument of before kinds: that file instead of the built-in kinds
    path = tmp_path / "mine.txt"
    path.write_text(user, encoding="utf-8")
    (old,) = evaluate_ppl([str(tiny_llama)], text=str(path), seq_len=SEQ, max_windows=WINDOWS, progress=False)
    assert list(old.ppl_by_kind) == ["mine"] and abs(old.ppl / row.ppl_by_kind["mine"] - 1) < 1e-6


def test_evaluate_ppl_checks_texts_before_loading_a_model(tmp_path):
    missing = str(tmp_path / "no-model")  # never loaded: the texts fail first
    with pytest.raises(ValueError, match="allowed: docs, code, chat"):
        evaluate_ppl([missing], kinds=["docs", "prose"])
    with pytest.raises(ValueError, match="nothing to measure"):
        evaluate_ppl([missing], kinds=())
    with pytest.raises(ValueError, match="'mine' is empty"):
        evaluate_ppl([missing], kinds=(), texts={"mine": "  "})


def test_a_text_shorter_than_a_window_is_named(tiny_llama):
    with pytest.raises(ValueError, match="text 'short': the token stream has"):
        evaluate_ppl([str(tiny_llama)], kinds=(), texts={"short": "Too short."}, seq_len=SEQ, progress=False)


def _row(model, scheme, ppl):
    return EvalRow(model, scheme, ppl["docs"], 1.0, 62, 2, 1.5, ppl_by_kind=ppl, nll_by_kind=dict.fromkeys(ppl, 1.0),
                   tokens_by_kind=dict.fromkeys(ppl, 62), windows_by_kind=dict.fromkeys(ppl, 2))


def test_report_has_a_column_and_a_delta_per_kind(tmp_path):
    rows = [_row("base", "float", {"docs": 10.0, "code": 4.0}), _row("q", "w4a16-awq", {"docs": 11.0, "code": 4.2})]
    table = markdown_table(rows)
    assert "| model | scheme | ppl docs | Δ docs | ppl code | Δ code | tokens | windows | s |" in table
    assert "| q | w4a16-awq | 11.0000 | +10.00% | 4.2000 | +5.00% | 124 | 4 | 1.5 |" in table
    assert "| base | float | 10.0000 | +0.00% | 4.0000 | +0.00% |" in table
    out = write_report(rows, tmp_path / "rep")
    data = json.loads((out / "report.json").read_text())
    assert data["rows"][1]["ppl_by_kind"] == {"docs": 11.0, "code": 4.2} and data["rows"][1]["ppl"] == 11.0
    md = (out / "report.md").read_text()
    assert "ppl code" in md and (out / "ppl.png").stat().st_size > 1000
    # where the numbers came from: report.md's last section and report.json's provenance
    import torch

    prov = data["provenance"]
    assert prov["versions"]["torch"] == torch.__version__ and prov["commit"] and prov["command"]
    assert "cpu" in prov["hardware"].lower() and md.rstrip().split("\n## ")[-1].startswith("Provenance")
    assert f"torch {torch.__version__}" in md and f"commit {prov['commit']}" in md
    # rows from before kinds (no per-kind dicts) still print
    assert "| x | float | 5.0000 | +0.00% |" in markdown_table([EvalRow("x", "float", 5.0, 1.6, 10, 1, 0.1)])
