"""benchmarks/spec_tau.py on a tiny chat model with a pass-through EAGLE draft: tau and the depth shares from
the histogram, the draft's own held-out prompts as train-draft splits them, the depth penalty's shift and its
undoing, bad --trees in one line."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from conftest import write_draft

from optllm.benchmarks import spec_tau
from optllm.runtime.llm import LLM
from optllm.speculative.data import DraftSequence
from optllm.speculative.train import _split


def test_tau_and_depth_shares_from_the_histogram(tmp_path, tiny_chat):
    draft = write_draft(tmp_path / "eagle", tiny_chat, "eagle")
    rows = spec_tau.main(["--draft", str(draft), "--model", str(tiny_chat), "--trees", "d2k2n3,d3k2n6",
                          "--num", "3", "--output-len", "12", "--max-len", "128", "--depth-penalties", "0,0.5",
                          "--out", str(tmp_path / "out")])
    assert [(r["tree"], r["set"], r["prompts"]) for r in rows] == [(t, "eval", 3) for t in (
        "d2k2n3", "d2k2n3 -0.5/depth", "d3k2n6", "d3k2n6 -0.5/depth")]
    for r in rows:
        hist, steps = r["histogram"], r["seq_steps"]
        assert steps == sum(hist) > 0 and len(hist) <= r["spec_depth"] + 1
        assert r["tau"] == pytest.approx(sum((d + 1) * c for d, c in enumerate(hist)) / steps)
        assert r["at_least"] == pytest.approx([sum(hist[d:]) / steps for d in range(1, len(hist))])
        assert r["given_previous"][:1] == r["at_least"][:1]
    assert sum(rows[2]["histogram"][2:]) > 0  # the pass-through draft's paths reach depth 2
    payload = json.loads((tmp_path / "out" / "spec_tau.json").read_text())
    assert len(payload["rows"]) == 4 and "| d3k2n6 | eval (3) |" in (tmp_path / "out" / "spec_tau.md").read_text()


def test_depth_penalty_shifts_every_log_prob_and_zero_undoes_it(tmp_path, tiny_chat):
    draft = write_draft(tmp_path / "eagle", tiny_chat, "eagle")
    llm = LLM(str(tiny_chat), device="cpu", draft=str(draft), spec_policy="fixed", max_model_len=128)
    d = llm.engine.runner.spec.draft
    out = torch.randn(5, json.loads((tiny_chat / "config.json").read_text())["hidden_size"])
    lp, ids = d.ranked(out, 3)
    spec_tau.penalize_depth(llm, 0.75)
    lp2, ids2 = d.ranked(out, 3)
    assert torch.equal(ids2, ids) and torch.allclose(lp2, lp - 0.75)
    spec_tau.penalize_depth(llm, 0.0)
    assert torch.equal(d.ranked(out, 3)[0], lp) and "ranked" not in d.__dict__


def test_holdout_prompts_are_train_drafts_held_out_split(tmp_path):
    seqs = [DraftSequence([1, 100 + i, 7, 8, 9], 2 + i % 2) for i in range(40)]
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(s.to_json()) + "\n" for s in seqs)
    _, held = _split(seqs, 6, 3)
    got = spec_tau.holdout_prompts(path, 6, 3, skip=20, num=10)
    assert got == [s.token_ids[:s.num_prompt_tokens] for s in held if s.token_ids[1] - 100 >= 20]
    assert spec_tau.holdout_prompts(path, 6, 3, skip=0, num=2) == [s.token_ids[:s.num_prompt_tokens] for s in held[:2]]


def test_a_bad_tree_is_one_line():
    with pytest.raises(SystemExit, match="'d5k8' is not a tree; allowed: dDkKnN"):
        spec_tau.parse_tree("d5k8")
    assert spec_tau.parse_tree("d6k10n60") == dict(spec_depth=6, spec_top_k=10, spec_num_draft=60)
    with pytest.raises(SystemExit, match="--depth-penalties: '0,x'; allowed: comma-separated numbers"):
        spec_tau.main(["--draft", "d", "--depth-penalties", "0,x"])
    with pytest.raises(SystemExit, match="--sets holdout needs --data"):
        spec_tau.main(["--draft", "d", "--sets", "holdout"])
