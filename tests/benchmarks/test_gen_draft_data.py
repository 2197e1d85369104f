"""benchmarks/gen_draft_data.py on a tiny chat model: one chunk of Magpie turns with task openers, answered and
merged after an earlier dataset; bad --openers exit with one line."""

from __future__ import annotations

import json

import pytest

from optllm.benchmarks import gen_draft_data
from optllm.speculative.data import DraftSequence, read_dataset


def test_one_chunk_with_openers_merged_after_the_old(tmp_path, tiny_chat):
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps(DraftSequence([1, 2, 3, 4], 2).to_json()) + "\n")
    openers = tmp_path / "openers.txt"
    openers.write_text("Write a story\n\nExplain\n")
    out = tmp_path / "all.jsonl"
    summary = gen_draft_data.main([str(tiny_chat), "--out", str(out), "--seconds", "600", "--chunk", "4",
                                   "--max-chunks", "1", "--seq-len", "64", "--answer-tokens", "6", "--device", "cpu",
                                   "--exclude", str(old), "--merge", "--openers", str(openers)])
    seqs = read_dataset(out)
    assert summary["chunks"] == 1 and summary["merged_old"] == 1 and seqs[0].token_ids == [1, 2, 3, 4]
    assert len(seqs) == 1 + summary["new_sequences"] and summary["new_sequences"] >= 1
    assert not out.with_name(out.name + ".tmp").exists()
    from optllm.runtime.llm import LLM

    tok = LLM(str(tiny_chat), device="cpu", max_model_len=64).tokenizer
    prompts = [tok.decode(s.token_ids[:s.num_prompt_tokens]) for s in seqs[1:]]
    assert all("Write a story" in p or "Explain" in p for p in prompts), prompts
    assert summary["dropped_as_eval_prompts"] == 0


def test_turns_that_hold_an_evaluation_prompt_are_dropped(tmp_path, tiny_chat, monkeypatch):
    """With the held-out prompts set to the very turns the first chunk writes (the same seeds on the same model),
    all of them are dropped and counted, and none is answered."""
    from optllm.runtime.llm import LLM
    from optllm.speculative.data import magpie_prompts, turn_tokens

    llm = LLM(str(tiny_chat), device="cpu", max_model_len=64)
    turns = [c[0]["content"] for c in magpie_prompts(llm, 4, seed=1_000_000, max_tokens=turn_tokens(64),
                                                     openers=("Write",))]
    assert turns
    monkeypatch.setattr(gen_draft_data, "heldout_user_prompts", lambda: turns)
    openers = tmp_path / "openers.txt"
    openers.write_text("Write\n")
    out = tmp_path / "all.jsonl"
    summary = gen_draft_data.main([str(tiny_chat), "--out", str(out), "--seconds", "600", "--chunk", "4",
                                   "--max-chunks", "1", "--seq-len", "64", "--answer-tokens", "6", "--device", "cpu",
                                   "--openers", str(openers)])
    assert summary["new_sequences"] == 0 and summary["dropped_as_eval_prompts"] == len(turns)
    assert read_dataset(out) == []


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_bad_openers_exit_with_one_line(tmp_path, tiny_chat, text, capsys):
    f = tmp_path / "openers.txt"
    f.write_text(text)
    for arg in (str(f), str(tmp_path / "missing.txt")):
        with pytest.raises(SystemExit) as e:
            gen_draft_data.main([str(tiny_chat), "--out", str(tmp_path / "o.jsonl"), "--seconds", "1",
                                 "--openers", arg])
        assert e.value.code == 2
        assert "--openers" in capsys.readouterr().err
