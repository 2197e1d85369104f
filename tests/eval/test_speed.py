"""eval --speed: the numbers measure_speed reports (exact token and step counts, rates equal to
their counts over their times, ordered percentiles), its arithmetic on hand-made token times,
the weight bytes against HF's parameters, average bits from quantization configs, and the
report's speed table and plots."""

from __future__ import annotations

import json

import pytest

from optllm.errors import UserError
from optllm.eval.evaluate import EvalRow
from optllm.eval.report import average_bits, speed_table, write_report
from optllm.eval.speed import BatchTiming, measure_speed, parse_batch_sizes, stream_batch, summarize, weight_bytes

PROMPT, OUTPUT, REPS = 8, 8, 2


def _png(path) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024


def test_parse_batch_sizes():
    assert parse_batch_sizes("1, 8,32") == (1, 8, 32)
    assert parse_batch_sizes("4,1,4") == (4, 1)  # duplicates once, order kept
    assert parse_batch_sizes([2, 16]) == (2, 16)
    for bad, shown in (("1,x", "'x'"), ("0", "'0'"), ("-2", "'-2'"), ("1.5", "'1.5'"), ("1,,2", "''"), ("", "''")):
        with pytest.raises(UserError, match=f"{shown} is not allowed; allowed: comma-separated integers >= 1"):
            parse_batch_sizes(bad)


def test_summarize_on_hand_made_token_times():
    # two requests arriving at 0: A's first token at 1.0 (then 1.5, 2.5), B's at 2.0 (then 2.5,
    # 3.0) -- as when B's prompt is prefilled a step later
    t = BatchTiming(start=0.0, end=3.0, token_times=[[1.0, 1.5, 2.5], [2.0, 2.5, 3.0]],
                    step_times=[1.0, 1.5, 2.0, 2.5, 3.0])
    s = summarize([t], batch_size=2, wbytes=1000, kv_bytes_per_token=10.0, prompt_len=4, output_len=3,
                  bandwidth=1e4)
    assert (s["output_tokens"], s["requests"], s["seconds"], s["tok_s"]) == (6, 2, 3.0, 2.0)
    # ttft [1, 2]; itl [0.5, 1.0, 0.5, 0.5]: numpy's linear-interpolated percentiles
    assert s["ttft_p50_ms"] == pytest.approx(1500) and s["ttft_p99_ms"] == pytest.approx(1990)
    assert s["itl_p50_ms"] == pytest.approx(500) and s["itl_p99_ms"] == pytest.approx(985)
    assert s["itl_count"] == 4  # output_len - 1 per request
    # decode window: from the last first token (2.0) to the last token (3.0): tokens 2.5, 2.5, 3.0
    assert (s["decode_tokens"], s["decode_steps"], s["decode_seconds"], s["decode_tok_s"]) == (3, 2, 1.0, 3.0)
    assert s["weight_gb_s"] == pytest.approx(1000 * 2 / 1.0 / 1e9)
    # two steps, each reading the weights and 2 sequences x (4 + 3/2) tokens of KV, at 1e4 B/s, in 1 s
    assert s["roofline_pct"] == pytest.approx(100 * 2 * (1000 + 2 * 5.5 * 10) / 1e4 / 1.0)
    assert summarize([t], 2, 1000, 10.0, 4, 3, None)["roofline_pct"] is None


def test_stream_batch_times_every_token(tiny_llama):
    from optllm import LLM, SamplingParams

    llm = LLM(str(tiny_llama), device="cpu")
    free = llm.engine.stats().num_free_blocks
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, ignore_eos=True, detokenize=False)
    t = stream_batch(llm, [[5, 6, 7, 8, 9]] * 2 + [[10, 11, 12]], params)
    assert [len(tt) for tt in t.token_times] == [6, 6, 6]
    for tt in t.token_times:
        assert t.start <= tt[0] and all(a <= b for a, b in zip(tt, tt[1:])) and tt[-1] <= t.end
    assert len(t.step_times) == 6 and t.preemptions == 0  # all prompts in one step, then one token a step
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats().num_free_blocks == free


def test_weight_bytes_are_the_parameters_a_step_reads(tiny_models):
    from transformers import AutoModelForCausalLM

    from optllm import LLM

    for arch in ("llama", "mistral"):  # tied embedding (read as the LM head) and untied (left out)
        hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch])
        total = sum(p.numel() * p.element_size() for p in hf.parameters())
        embed = hf.get_input_embeddings().weight
        want = total - (0 if hf.config.tie_word_embeddings else embed.numel() * embed.element_size())
        assert weight_bytes(LLM(str(tiny_models[arch]), device="cpu")) == want


def test_measure_speed_numbers_are_consistent(tiny_llama):
    bw = 1e10  # a bandwidth given explicitly gives a roofline on any device
    rows = measure_speed(str(tiny_llama), batch_sizes=(1, 2), prompt_len=PROMPT, output_len=OUTPUT, device="cpu",
                         dtype="float32", reps=REPS, bandwidth=bw)
    assert [r["batch_size"] for r in rows] == [1, 2]
    kv_tok = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x float32
    for r in rows:
        bs = r["batch_size"]
        assert (r["device"], r["dtype"], r["preemptions"], r["batches"]) == ("cpu", "float32", 0, REPS)
        assert r["requests"] == REPS * bs and r["output_tokens"] == REPS * bs * OUTPUT
        assert r["itl_count"] == REPS * bs * (OUTPUT - 1)
        # every prompt fits one step: the decode window holds the other OUTPUT - 1 tokens and steps
        assert r["decode_tokens"] == REPS * bs * (OUTPUT - 1) and r["decode_steps"] == REPS * (OUTPUT - 1)
        assert 0 < r["decode_seconds"] < r["seconds"]
        assert r["tok_s"] == pytest.approx(r["output_tokens"] / r["seconds"], rel=1e-12)
        assert r["decode_tok_s"] == pytest.approx(r["decode_tokens"] / r["decode_seconds"], rel=1e-12)
        assert r["weight_gb_s"] == pytest.approx(
            r["weight_bytes"] * r["decode_steps"] / r["decode_seconds"] / 1e9, rel=1e-12)
        step = r["weight_bytes"] + bs * (PROMPT + OUTPUT / 2) * kv_tok
        assert r["roofline_pct"] == pytest.approx(100 * r["decode_steps"] * step / bw / r["decode_seconds"])
        assert r["bandwidth_gb_s"] == 10.0
        for what in ("ttft", "itl"):
            p50, p99 = r[f"{what}_p50_ms"], r[f"{what}_p99_ms"]
            assert 0 < p50 <= p99 < 1000 * r["seconds"]
    # CPU: no bandwidth table entry, no roofline
    (r,) = measure_speed(str(tiny_llama), batch_sizes=[1], prompt_len=PROMPT, output_len=2, device="cpu", reps=1)
    assert r["roofline_pct"] is None and r["bandwidth_gb_s"] is None and r["itl_count"] == 1
    with pytest.raises(UserError, match="--output-len 1 is not allowed; allowed: an integer >= 2"):
        measure_speed(str(tiny_llama), batch_sizes=[1], output_len=1, device="cpu")


def test_average_bits_from_the_quantization_config(tiny_llama, tmp_path):
    assert average_bits(tiny_llama) == 16.0

    def folder(name, **weights):
        (tmp_path / name).mkdir()
        qc = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": weights}}}
        (tmp_path / name / "config.json").write_text(json.dumps({"quantization_config": qc}))
        return tmp_path / name

    assert average_bits(folder("g32", num_bits=4, group_size=32, strategy="group", symmetric=True)) == 4.5
    assert average_bits(folder("asym", num_bits=4, group_size=64, strategy="group", symmetric=False)) == 4.3125
    assert average_bits(folder("channel", num_bits=8, group_size=None, strategy="channel", symmetric=True)) == 8.0
    assert average_bits(folder("nvfp4", num_bits=4, group_size=16, strategy="tensor_group", type="float")) == 4.5
    assert average_bits(tmp_path / "missing") is None


def _speed(bs, scale):
    return dict(batch_size=bs, prompt_len=8, output_len=8, batches=2, device="cpu", dtype="float32",
                tok_s=100.0 * bs * scale, decode_tok_s=110.0 * bs * scale, ttft_p50_ms=2.0 * bs, ttft_p99_ms=3.0 * bs,
                itl_p50_ms=1.0, itl_p99_ms=1.5, weight_gb_s=0.4, roofline_pct=None, bandwidth_gb_s=None)


def test_report_speed_table_and_plots(tiny_llama, tmp_path):
    nan = float("nan")
    rows = [EvalRow(str(tiny_llama), "float", nan, nan, 0, 0, 1.0, speed=[_speed(1, 1.0), _speed(8, 1.0)]),
            EvalRow("other", "w4a16-rtn", nan, nan, 0, 0, 1.0, speed=[_speed(1, 1.5), _speed(8, 1.5)])]
    table = speed_table(rows)
    assert table.splitlines()[0] == ("| model | scheme | batch | tok/s | decode tok/s | TTFT p50 ms | TTFT p99 ms | "
                                     "ITL p50 ms | ITL p99 ms | weight GB/s | % roofline |")
    assert "| other | w4a16-rtn | 8 | 1200.0 | 1320.0 | 16.00 | 24.00 | 1.00 | 1.50 | 0.4 | – |" in table
    assert len(table.splitlines()) == 2 + 4
    write_report(rows, tmp_path / "speed-only")
    files = {p.name for p in (tmp_path / "speed-only").iterdir()}
    assert files == {"report.md", "report.json", "speed.png", "latency.png"}  # no perplexity, no ppl plots
    assert _png(tmp_path / "speed-only" / "speed.png") and _png(tmp_path / "speed-only" / "latency.png")
    assert "## Speed" in (tmp_path / "speed-only" / "report.md").read_text()
    assert json.loads((tmp_path / "speed-only" / "report.json").read_text())["rows"][1]["speed"][1]["tok_s"] == 1200.0
    # perplexities too: the quality-vs-bits plot joins (bits read from each model's config.json)
    for r, ppl in zip(rows, (10.0, 10.5)):
        r.ppl, r.num_windows, r.num_tokens = ppl, 1, 31
        r.ppl_by_kind, r.tokens_by_kind, r.windows_by_kind = {"docs": ppl}, {"docs": 31}, {"docs": 1}
    write_report(rows, tmp_path / "all")
    files = {p.name for p in (tmp_path / "all").iterdir()}
    assert files == {"report.md", "report.json", "ppl.png", "quality_bits.png", "speed.png", "latency.png"}
    assert all(_png(tmp_path / "all" / f) for f in files if f.endswith(".png"))
    assert speed_table([EvalRow("m", "float", nan, nan, 0, 0, 0.0)]) == ""
