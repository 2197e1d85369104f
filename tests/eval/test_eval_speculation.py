"""eval --draft (eval/speculation.py): speed with and without a draft on held-out prompts, tau,
acceptance per depth, greedy outputs identical; the report's section and plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import write_draft

from optllm.eval.evaluate import EvalRow
from optllm.eval.report import speculation_table, write_report
from optllm.eval.speculation import evaluate_speculation, heldout_user_prompts


def test_heldout_prompts_are_the_chat_eval_family():
    users = heldout_user_prompts()
    assert len(users) == 62 and all(u and "<|im" not in u for u in users)
    assert users[0].startswith("Write a short story")


@pytest.fixture(scope="module")
def measured(tiny_llama, tmp_path_factory):
    draft = write_draft(tmp_path_factory.mktemp("eval-draft") / "medusa", tiny_llama, "medusa")
    res = evaluate_speculation([str(tiny_llama)], str(draft), [1, 3], 12, device="cpu", dtype="float32",
                               temperatures=(0.0, 1.0), reps=1, policy="fixed", progress=False)
    return res, draft


def test_rows_count_every_step_and_greedy_is_identical(measured):
    res, draft = measured
    rows = res[0]["speculation"]
    assert [(r["temperature"], r["batch_size"]) for r in rows] == [(0.0, 1), (0.0, 3), (1.0, 1), (1.0, 3)]
    for r in rows:
        hist, steps = r["histogram"], r["spec_seq_steps"]
        assert steps > 0 and sum(hist) == steps
        assert r["accepted"] == sum(k * n for k, n in enumerate(hist))
        assert r["tau"] == pytest.approx((r["accepted"] + steps) / steps)
        assert r["accept_at_depth"][0] == pytest.approx(sum(hist[1:]) / steps)
        assert all(a >= b for a, b in zip(r["accept_at_depth"], r["accept_at_depth"][1:]))
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0
        assert r["speedup"] == pytest.approx(r["spec_tok_s"] / r["plain_tok_s"])
        # one timed batch (reps 1, one order on a CPU): one pair, the speedup itself; no spread yet
        assert r["speedup_pairs"] == [pytest.approx(r["speedup"])] and r["speedup_se"] is None
        assert r["draft_method"] == "medusa" and r["draft"] == str(draft)
        assert r["identical"] is (True if r["temperature"] == 0 else None)
        assert r["catch_up_model"] is None  # a fixed policy (and Medusa: no catch-up)
        if r["temperature"] == 0:
            assert (r["same_seqs"], r["seqs"], r["max_divergence_margin"]) == (r["batch_size"],) * 2 + (None,)
    assert res[0]["scheme"] == "float"


def test_time_split_accounts_for_every_step(measured):
    """Each row says where the engines' time went: the runner's steps within the call's seconds,
    the speculative engine's speculative and plain parts within its runner time, one speculative
    part per speculative step (fixed trees: every decode of a speculating sequence speculates)."""
    res, _ = measured
    for r in res[0]["speculation"]:
        t = r["time"]
        for label in ("plain", "spec"):
            e = t[label]
            assert e["steps"] > 0 and 0 < e["runner_ms"] <= e["total_ms"]
            assert e["host_ms"] == pytest.approx(e["total_ms"] - e["runner_ms"])
            assert e["total_ms"] == pytest.approx(1e3 * r["requests"] * r["output_len"] / r[f"{label}_tok_s"])
        q = t["spec"]
        assert q["spec_steps"] == sum(r["steps_by_size"].values()) > 0
        assert q["spec_part_ms"] + q["plain_part_ms"] + q["fused_ms"] <= q["runner_ms"] + 1e-6
        assert q["fused_steps"] <= q["spec_steps"]
        assert r["explored"] == 0  # a fixed policy never explores (it never declines)
        assert 0 <= q["split_steps"] <= min(q["plain_parts"], q["spec_steps"])
        # every request prefills in a plain part; medusa never catches up
        assert q["plain_parts"] >= 1 and q["caught_up_steps"] == q["catch_up_rows"] == 0
        # a plain engine decodes output_len - 1 steps after the prefill (batch arriving at once)
        assert t["plain"]["steps"] >= r["output_len"]


def test_a_parting_sequence_is_measured_at_its_first_difference(tiny_llama):
    """Where the speculative tokens part from the plain ones, the margin reported is the
    target's top-2 log-prob gap at that position (the plain tokens up to there, scored)."""
    from optllm.eval.report import _same_tokens
    from optllm.eval.speculation import _divergence_margins, _identity
    from optllm.runtime.llm import LLM
    from optllm.runtime.sampling_params import SamplingParams

    llm = LLM(str(tiny_llama), device="cpu", dtype="float32")
    prompts = [[5, 17, 250, 3], [11, 12, 13]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2))
    plain = [o.outputs[0].token_ids for o in outs]
    spec = [plain[0], plain[1][:5] + [(plain[1][5] + 1) % 300] + plain[1][6:]]
    margins = _divergence_margins(llm, prompts, plain, spec)
    top = sorted(outs[1].outputs[0].logprobs[5].values(), reverse=True)
    assert margins[0] is None and margins[1] == pytest.approx(top[0] - top[1], abs=1e-4)
    ident = _identity(margins)
    assert (ident["same_seqs"], ident["seqs"]) == (1, 2)
    assert _same_tokens({"identical": False, **ident, "max_divergence_margin": 0.125}) == "1/2 (ties ≤ 0.125)"
    assert _same_tokens({"identical": False, **ident, "max_divergence_margin": 3.0}).startswith("**no** (1/2")
    assert _same_tokens({"identical": True}) == "yes" and _same_tokens({"identical": None}) == "–"


def test_report_has_the_speculation_section_and_plot(measured, tmp_path):
    res, _ = measured
    nan = float("nan")
    row = EvalRow("tiny", "float", nan, nan, 0, 0, 0.0, speculation=res[0]["speculation"])
    table = speculation_table([row])
    assert table.count("\n") == 2 + 4 and "| tiny | float | 0 | 1 |" in table and "yes" in table
    out = write_report([row], tmp_path / "rep")
    md = (out / "report.md").read_text()
    assert "## Speculative decoding" in md and "acceptance.png" in md
    png = (out / "acceptance.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    saved = json.loads((out / "report.json").read_text())
    assert saved["rows"][0]["speculation"][0]["histogram"] == res[0]["speculation"][0]["histogram"]
    assert "Where the time went" in md and "| tiny | 0 | 1 | " in md
    # the plain parts' cell: how many split a speculative step, where any did
    from optllm.eval.report import _plain_parts_cell

    q = {"plain_parts": 350, "plain_part_ms": 380.04, "split_steps": 317}
    assert _plain_parts_cell(q) == "350 (380.0; 317 split)"
    assert _plain_parts_cell(q | {"split_steps": 0}) == "350 (380.0)" == _plain_parts_cell({**q, "split_steps": None})
    # the steps' cell: per tree size, and the explorations among them where the policy made any
    s = dict(res[0]["speculation"][0], steps_by_size={20: 7, 41: 3}, explored=3)
    assert "| 20: 7, 41: 3 (3 explored) |" in speculation_table([EvalRow("tiny", "float", nan, nan, 0, 0, 0.0,
                                                                         speculation=[s])])
    # the speedup's cell: ± the standard error of the per-batch pairs, where there are two or more
    s = dict(res[0]["speculation"][0], speedup=0.9749, speedup_se=0.0123)
    assert "| 0.97× ±0.01 |" in speculation_table([EvalRow("tiny", "float", nan, nan, 0, 0, 0.0, speculation=[s])])


def test_the_speedups_standard_error():
    """pair_se: the sample standard deviation of the per-batch speedups over sqrt(n); none below two."""
    from optllm.eval.speculation import pair_se

    assert pair_se([]) is None and pair_se([0.97]) is None
    assert pair_se([1.0, 1.1, 0.9]) == pytest.approx((0.01 / 3) ** 0.5)
    assert pair_se([0.98, 0.98, 0.98, 0.98]) == 0.0


def test_eval_draft_bad_input_is_one_line(tiny_llama, tmp_path, measured):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "optllm", "eval", str(tiny_llama), *args, "--device", "cpu"],
                              capture_output=True, text=True)

    draft = str(measured[1])
    for args, pattern in ((("--draft", str(tmp_path)), "not a draft folder"),
                          (("--draft", draft, "--temperatures", "0,x"), "--temperatures '0,x'"),
                          (("--draft", draft, "--spec-policy", "greedy"), "--spec-policy 'greedy'"),
                          (("--draft", draft, "--spec-load", "bursty"), "--spec-load 'bursty'"),
                          (("--draft", draft, "--spec-reps", "0"), "--spec-reps 0")):
        r = run(*args)
        lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
        assert r.returncode == 2 and len(lines) == 1 and pattern in lines[0], r.stderr


def test_each_finished_model_is_handed_on_before_the_next(tiny_llama, tmp_path, monkeypatch):
    """eval rewrites its partial report after each model's speculation runs (on_model): a run
    cut short by a time limit keeps the models it finished. The last model gets no call (the
    full report follows)."""
    import optllm.eval.speculation as spec

    draft = write_draft(tmp_path / "medusa", tiny_llama, "medusa")
    measured_models, seen = [], []
    monkeypatch.setattr(spec, "measure_speculation",
                        lambda name, *a, **kw: measured_models.append(name) or [{"batch_size": 1, "model": name}])
    models = [str(tiny_llama)] * 3
    res = evaluate_speculation(models, str(draft), [1], 4, on_model=lambda done: seen.append(
        (len(measured_models), [r["speculation"][0]["model"] for r in done])))
    assert len(res) == 3 and [len(d) for _, d in seen] == [1, 2]
    assert [n for n, _ in seen] == [1, 2]  # called right after each model, before the next is measured


def test_both_build_orders_sum_two_passes(tiny_llama, measured):
    """both_orders: each case measured with the engines built plain first, then speculative
    first; tokens and speculative steps are those of two passes (greedy, fixed trees: the same
    steps twice), the token ids and identity those of the first."""
    from optllm.eval.speculation import measure_speculation

    _, draft = measured
    one = measure_speculation(str(tiny_llama), str(draft), [2], 6, temperatures=(0.0,), both_orders=False)[0]
    two = measure_speculation(str(tiny_llama), str(draft), [2], 6, temperatures=(0.0,), both_orders=True)[0]
    assert two["spec_seq_steps"] == 2 * one["spec_seq_steps"] and two["accepted"] == 2 * one["accepted"]
    assert two["histogram"] == [2 * h for h in one["histogram"]] and two["tau"] == pytest.approx(one["tau"])
    assert two["steps_by_size"] == {n: 2 * c for n, c in one["steps_by_size"].items()}
    assert two["identical"] and two["requests"] == one["requests"]


def test_kv_blocks_for_a_workload():
    """The KV cache eval sizes on a GPU: every sequence's blocks of max_len tokens, one more each
    (a lookahead past a block's end), 16 spare -- what both eval paths pass as num_kv_blocks."""
    from optllm.eval.evaluate import _kv_args
    from optllm.eval.speculation import _engine_args
    from optllm.runtime.config import EngineConfig

    assert EngineConfig.block_size == 16
    assert EngineConfig.kv_blocks_for(64, 512) == 64 * 33 + 16 and EngineConfig.kv_blocks_for(3, 17) == 3 * 3 + 16
    assert _kv_args("cuda", 512) == {"num_kv_blocks": 64 * 33 + 16} and _kv_args("cpu", 512) == {}
    args = _engine_args([1, 8], 128, "cuda", "auto", 100)  # max_len = 100 + 128 + 64
    assert args["num_kv_blocks"] == 8 * (-(-292 // 16) + 1) + 16 and "num_kv_blocks" not in _engine_args(
        [1, 8], 128, "cpu", "auto", 100)


def test_eval_takes_the_eagle_tree_options(tiny_llama, tmp_path):
    """--spec-top-k / --spec-depth / --spec-tokens reach the engine (no tree verifies more than
    spec_tokens + 1 nodes) and the report records them; a bad one is one line."""
    draft = write_draft(tmp_path / "eagle", tiny_llama, "eagle")
    opts = dict(spec_top_k=2, spec_depth=2, spec_num_draft=3)
    res = evaluate_speculation([str(tiny_llama)], str(draft), [2], 10, device="cpu", dtype="float32",
                               temperatures=(0.0,), reps=1, policy="fixed", spec_options=opts, progress=False)
    row = res[0]["speculation"][0]
    assert row["spec_options"] == opts and row["spec_seq_steps"] > 0
    assert {int(n) for n in row["steps_by_size"]} == {4}
    r = subprocess.run([sys.executable, "-m", "optllm", "eval", str(tiny_llama), "--device", "cpu", "--no-ppl",
                        "--draft", str(draft), "--spec-depth", "0", "--batch-sizes", "1", "--temperatures", "0"],
                       capture_output=True, text=True)
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--spec-depth 0" in lines[0], r.stderr


def test_an_adaptive_eagle_row_reports_its_catch_up_model(tiny_llama, tmp_path):
    """Under the adaptive policy an EAGLE row carries the policy's catch-up model: the start-up fit
    (c0 ms + c1 ms a row) and the measured / profiled ratio its catch-ups had moved it to (1 while
    none was measured; the catch-ups' own counts are in the time split); and the policy's snapshot
    at the case's end (its estimates per class and size, the verifies behind them, cost ratios)."""
    draft = write_draft(tmp_path / "eagle", tiny_llama, "eagle")
    res = evaluate_speculation([str(tiny_llama)], str(draft), [2], 8, device="cpu", dtype="float32",
                               temperatures=(0.0,), reps=1, policy="adaptive", progress=False)
    row = res[0]["speculation"][0]
    m = row["catch_up_model"]
    assert set(m) == {"c0_ms", "c1_ms_a_row", "measured_ratio"}
    assert m["c0_ms"] > 0 and m["c1_ms_a_row"] >= 0 and 0.25 <= m["measured_ratio"] <= 20
    if row["time"]["spec"]["caught_up_steps"] == 0:
        assert m["measured_ratio"] == 1.0
    # and what the policy had learnt by the case's end: its greedy estimates from this case's verifies
    pol = row["policy_state"]
    sizes = pol["sizes"]
    assert sizes and all(len(pol[k][c]) == len(sizes) for k in ("accepted", "step_variance", "spread_between")
                         for c in ("greedy", "sampled"))
    assert pol["verifies"]["greedy"] >= row["spec_seq_steps"] and pol["verifies"]["sampled"] == 0
    assert all(0 <= a <= n - 1 for a, n in zip(pol["accepted"]["greedy"], sizes))
    assert pol["catch_up_ratio"] == m["measured_ratio"]
    assert all(k.split("/")[2] in ("greedy", "sampled") and 0.25 <= v <= 20 for k, v in pol["cost_ratio"].items())


def test_spec_reps_sets_the_timed_batches(tiny_llama, tmp_path):
    """--spec-reps N: N timed batches per case, batch size x N distinct prompts (a tau at batch 1
    from more than a few prompts)."""
    draft = write_draft(tmp_path / "medusa", tiny_llama, "medusa")
    r = subprocess.run([sys.executable, "-m", "optllm", "eval", str(tiny_llama), "--device", "cpu", "--no-ppl",
                        "--draft", str(draft), "--spec-reps", "3", "--batch-sizes", "2", "--temperatures", "0",
                        "--output-len", "4", "--out", str(tmp_path / "rep")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    row = json.loads((tmp_path / "rep" / "report.json").read_text())["rows"][0]["speculation"][0]
    assert row["requests"] == 6 and row["seqs"] == 6


def test_spread_lengths_are_even_fixed_and_shuffled():
    from optllm.eval.speculation import spread_lengths

    a = spread_lengths(64, 128)
    assert a == spread_lengths(64, 128) and len(a) == 64 and min(a) == 64 and max(a) == 192
    assert abs(sum(a) / 64 - 128) <= 1 and a != sorted(a)
    assert spread_lengths(1, 128) == [64] and spread_lengths(3, 1) == [1, 1, 1]


def test_continuous_load_keeps_at_most_the_batch_running(tiny_llama, tmp_path, monkeypatch):
    """load="continuous": every timed request arrives at once and at most batch-size run together
    (a finished sequence's place goes to a waiting request); the rows say so, greedy output stays
    the plain engine's, and the report marks the batch cell."""
    import optllm.eval.speculation as spec_mod
    from optllm.runtime.scheduler import Scheduler

    most = []
    schedule = Scheduler.schedule

    def watched(self):
        out = schedule(self)
        most.append((self.config.max_num_seqs, len(self.running)))
        return out

    monkeypatch.setattr(Scheduler, "schedule", watched)
    ran = []
    batch = spec_mod._batch

    def counted(llm, prompts, params):
        out = batch(llm, prompts, params)
        ran.append([len(x) for x in out[2]])
        return out

    monkeypatch.setattr(spec_mod, "_batch", counted)
    sized, engine_args = [], spec_mod._engine_args
    monkeypatch.setattr(spec_mod, "_engine_args", lambda *a, **k: sized.append(a) or engine_args(*a, **k))
    draft = write_draft(tmp_path / "eagle", tiny_llama, "eagle")
    rows = spec_mod.measure_speculation(str(tiny_llama), str(draft), [2], 6, device="cpu", dtype="float32",
                                        temperatures=(0.0,), reps=2, policy="fixed", load="continuous",
                                        spec_options=dict(spec_top_k=2, spec_depth=2, spec_num_draft=3))
    # the engines are sized for the longest request (9 tokens of output, not the mean 6), + 64 for a tree
    used = sized[-1]
    assert used[1] == 9 and engine_args(*used)["max_model_len"] == used[4] + 9 + 64
    with pytest.raises(Exception, match="--spec-max-len 10 is not allowed"):
        spec_mod.measure_speculation(str(tiny_llama), str(draft), [2], 6, device="cpu", load="continuous",
                                     max_model_len=10)
    row = rows[0]
    assert row["max_model_len"] == engine_args(*used)["max_model_len"]  # (the report says which)
    assert row["load"] == "continuous" and row["requests"] == 4 and row["identical"] is True
    # requests of varied lengths, the same for both engines: each sequence ran its own length
    lengths = spec_mod.spread_lengths(4, 6)
    assert row["output_lens"] == lengths and sorted(lengths) == [3, 5, 7, 9]
    assert ran == [lengths] * 4  # the stream as warm-up, then timed; plain, then speculative, each time
    capped = [n for cap, n in most if cap == 2]
    assert capped and max(capped) == 2  # the cap held while four requests waited
    assert max(n for _, n in most) >= 2
    nan = float("nan")
    assert "| 2 (continuous) |" in speculation_table([EvalRow("tiny", "float", nan, nan, 0, 0, 0.0, speculation=rows)])
    with pytest.raises(Exception, match="load 'bursty'"):
        spec_mod.measure_speculation(str(tiny_llama), str(draft), [2], 6, device="cpu", load="bursty")


def test_the_time_table_shows_the_catch_up_profile_against_the_measured_ratio():
    """The time table's last cell: c0 + c1 * (catch-up rows / catch-ups), then the measured ratio;
    a dash without catch-ups or without a model."""
    from optllm.eval.report import _catch_up_model_cell

    m = {"c0_ms": 1.2, "c1_ms_a_row": 0.001, "measured_ratio": 3.4}
    assert _catch_up_model_cell(m, {"caught_up_steps": 2, "catch_up_rows": 1000}) == "1.70 (×3.40)"
    assert _catch_up_model_cell(m, {"caught_up_steps": 0, "catch_up_rows": 0}) == "–"
    assert _catch_up_model_cell(None, {"caught_up_steps": 2, "catch_up_rows": 1000}) == "–"
