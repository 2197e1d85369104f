"""`optllm generate --draft`: the same text as without a draft; a bad draft is one line."""

from __future__ import annotations

from conftest import write_draft
from test_cli import _one_clear_line, run


def test_generate_with_a_draft_prints_the_same_text(tiny_llama, tmp_path):
    draft = write_draft(tmp_path / "medusa", tiny_llama, "medusa")
    plain = run("generate", str(tiny_llama), "def main", "--max-tokens", "30", "--device", "cpu")
    spec = run("generate", str(tiny_llama), "def main", "--max-tokens", "30", "--device", "cpu", "--draft", str(draft))
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout


def test_bad_draft_is_one_line(tiny_llama, tmp_path):
    _one_clear_line(run("generate", str(tiny_llama), "hi", "--device", "cpu", "--draft", str(tmp_path)),
                    "not a draft folder")
    draft = write_draft(tmp_path / "eagle", tiny_llama, "eagle")
    _one_clear_line(run("generate", str(tiny_llama), "hi", "--device", "cpu", "--draft", str(draft),
                        "--spec-top-k", "2", "--spec-depth", "2", "--spec-tokens", "9"), "spec_num_draft=9")
    _one_clear_line(run("generate", str(tiny_llama), "hi", "--device", "cpu", "--draft", str(draft),
                        "--spec-policy", "greedy"), "spec_policy='greedy'")
