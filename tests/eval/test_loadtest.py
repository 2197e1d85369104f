"""The load tester (eval/loadtest.py, `optllm bench serve`): against `optllm serve` as a process on
127.0.0.1 with a tiny model it stops by itself (count bound, duration bound, drain timeout),
counts every request, and its token counts equal the server's; the arrival schedule, the
percentile and goodput maths and the dataset reader on known inputs; bad input through the
CLI is one line and exit code 2."""

from __future__ import annotations

import itertools
import json
import math
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import make_tiny_model
from typer.testing import CliRunner

from optllm.cli.app import app
from optllm.errors import UserError
from optllm.eval.loadtest import (
    LoadTestConfig,
    RequestRecord,
    Target,
    arrival_offsets,
    find_target,
    load_prompts,
    percentile,
    run_loadtest,
    summarize,
)

KEY = "sk-loadtest"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except OSError:
        return 0, ""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`optllm serve` of a tiny llama with a chat template, behind an API key: (base URL, process)."""
    root = tmp_path_factory.mktemp("loadtest")
    folder = make_tiny_model(root / "m", "llama")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "optllm", "serve", str(folder), "--port", str(port), "--device",
                             "cpu", "--served-model-name", "tiny", "--max-model-len", "512", "--api-key", KEY],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise AssertionError(f"server exited {proc.returncode}: {(root / 'server.log').read_text()[-3000:]}")
            if http_get(base + "/health")[0] == 200:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("server did not come up in 60 s")
        yield base, proc
    finally:
        proc.kill()
        proc.wait()
        log.close()


def counters(base: str) -> dict[str, float]:
    """The server's own token counters (Prometheus, /metrics)."""
    text = http_get(base + "/metrics")[1]
    want = ("optllm_prompt_tokens_total", "optllm_generation_tokens_total")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] in want}


def measured(base: str, cfg: LoadTestConfig, progress=None):
    """run the load test between two readings of the server's counters: (report, counter deltas).
    The target is found first, so its probe requests stay out of the deltas."""
    target = find_target(cfg)
    before = counters(base)
    report = run_loadtest(cfg, progress=progress, target=target)
    after = counters(base)
    return report, target, {k: after[k] - before[k] for k in after}


# ---------------------------------------------------------------- against the server


def test_count_bound_counts_every_request_and_matches_server_usage(server):
    base, _ = server
    seen = []
    cfg = LoadTestConfig(base, api_key=KEY, num_prompts=12, max_concurrency=4, input_len=8, output_len=6,
                         ignore_eos=True, seed=1)
    report, target, delta = measured(base, cfg, progress=seen.append)
    s = report.summary
    assert target.model == "tiny" and target.kind == "token ids"
    assert (s["issued"], s["ok"], s["failed"], s["failures"]) == (12, 12, 0, {})
    assert [r.index for r in report.requests] == list(range(12))
    assert all(r.prompt_tokens == 8 and r.output_tokens == 6 and r.usage for r in report.requests)
    # the totals are the server's own: its Prometheus counters moved by exactly as much
    assert s["input_tokens"] == delta["optllm_prompt_tokens_total"] == 12 * 8
    assert s["output_tokens"] == delta["optllm_generation_tokens_total"] == 12 * 6
    for r in report.requests:
        assert 0 < r.ttft_s <= r.e2e_s and r.sent_s >= r.scheduled_s == 0.0
        # the gaps tile the stream up to its last chunk; e2e also holds the tail ([DONE] after the usage chunk),
        # which a busy machine can stretch, so only the order is a fact here
        assert r.itl_s and all(g >= 0 for g in r.itl_s) and r.ttft_s + sum(r.itl_s) <= r.e2e_s + 1e-9
    assert s["output_throughput"] == pytest.approx(72 / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(12 / s["duration_s"])
    assert seen and (seen[-1].issued, seen[-1].ok, seen[-1].failed, seen[-1].in_flight) == (12, 12, 0, 0)


def test_duration_bound_stops_issuing_at_the_deadline(server):
    base, _ = server
    cfg = LoadTestConfig(base, api_key=KEY, duration=1.0, request_rate=10, input_len=4, output_len=3, seed=7)
    due = sum(1 for _ in itertools.takewhile(lambda t: t < 1.0, arrival_offsets(10, 7)))
    t0 = time.perf_counter()
    report, _, delta = measured(base, cfg)
    s = report.summary
    assert s["issued"] == due > 3  # every arrival before the deadline, none after
    assert 1.0 <= s["issuing_stopped_s"] < 1.2
    assert s["ok"] + s["failed"] == s["issued"] and s["ok"] == due
    assert [r.scheduled_s for r in report.requests] == list(itertools.islice(arrival_offsets(10, 7), due))
    assert s["output_tokens"] == delta["optllm_generation_tokens_total"]
    assert time.perf_counter() - t0 < 30


def test_in_flight_requests_past_the_timeout_count_as_failed(server):
    base, _ = server
    cfg = LoadTestConfig(base, api_key=KEY, duration=0.2, max_concurrency=2, input_len=4, output_len=500,
                         ignore_eos=True, timeout=0.1)
    t0 = time.perf_counter()
    report = run_loadtest(cfg, target=Target("tiny", "token ids", (32, 256)))
    elapsed = time.perf_counter() - t0
    s = report.summary
    # two requests took the two slots at t=0; the third waited for a slot past the deadline
    assert (s["issued"], s["ok"], s["failed"], s["failures"]) == (2, 0, 2, {"timeout": 2})
    assert 0.2 <= s["issuing_stopped_s"] < 0.4
    assert all(0.29 < r.done_s < 1.0 for r in report.requests)  # cut at 0.2 + 0.1 s
    assert elapsed < 5


def test_failed_requests_carry_their_reason(server):
    base, _ = server
    cfg = LoadTestConfig(base, api_key=KEY, model="gpt-9", num_prompts=3, input_len=4, output_len=2)
    report = run_loadtest(cfg)
    s = report.summary
    assert (s["issued"], s["ok"], s["failed"], s["failures"]) == (3, 0, 3, {"HTTP 404": 3})
    assert all("does not exist" in r.error for r in report.requests)
    assert "failed: 3 × HTTP 404" in report.markdown()


def test_chat_with_a_sharegpt_dataset(server, tmp_path):
    base, _ = server
    rows = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "answer"}]}
            for i in range(3)]
    (tmp_path / "sg.json").write_text(json.dumps(rows))
    cfg = LoadTestConfig(base, endpoint="chat", api_key=KEY, dataset=tmp_path / "sg.json", num_prompts=5,
                         output_len=5, ignore_eos=True, request_rate=50)
    report, target, delta = measured(base, cfg)
    s = report.summary
    assert target.kind == "dataset" and (s["issued"], s["ok"]) == (5, 5)
    assert all(r.output_tokens == 5 and r.usage for r in report.requests)
    assert s["input_tokens"] == delta["optllm_prompt_tokens_total"]
    assert s["output_tokens"] == delta["optllm_generation_tokens_total"] == 25


def test_cli_writes_the_report(server, tmp_path):
    base, _ = server
    r = CliRunner().invoke(app, ["bench", "serve", base + "/v1", "--api-key", KEY, "--num-prompts", "4",
                                 "--input-len", "4", "--output-len", "3", "--ignore-eos", "--request-rate", "40",
                                 "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000", "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    assert "| requests | ok | failed |" in r.stdout and "| TTFT |" in r.stdout
    saved = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert (saved["summary"]["ok"], saved["summary"]["good"], len(saved["requests"])) == (4, 4, 4)
    assert saved["provenance"]["command"] and "## Provenance" in (tmp_path / "rep" / "report.md").read_text()
    assert saved["summary"]["goodput"] == pytest.approx(4 / saved["summary"]["duration_s"])
    assert (tmp_path / "rep" / "report.md").read_text().startswith("tiny at ")


# ---------------------------------------------------------------- bad input through the CLI


@pytest.mark.parametrize("args, pattern", [
    (["not a url"], "is not an http(s)://host[:port] address"),
    (["ftp://127.0.0.1:8000"], "is not an http(s)://host[:port] address"),
    (["http://127.0.0.1:8000", "--endpoint", "embeddings"], "--endpoint 'embeddings' is not one of: completions, chat"),
    (["http://127.0.0.1:8000", "--request-rate", "-1"], "--request-rate -1 must be > 0"),
    (["http://127.0.0.1:8000", "--max-concurrency", "0"], "--max-concurrency 0 must be >= 1"),
    (["http://127.0.0.1:8000", "--duration", "5"], "--request-rate inf with --duration needs"),
    (["http://127.0.0.1:8000", "--dataset", "/no/such.jsonl"], "--dataset /no/such.jsonl: no such file"),
    (["http://127.0.0.1:{free}"], "cannot reach http://127.0.0.1:"),
])
def test_bad_input_is_one_clear_line(args, pattern):
    args = [a.format(free=free_port()) for a in args]
    one_clear_line(CliRunner().invoke(app, ["bench", "serve", *args, "--api-key", ""]), pattern)


def test_a_refused_key_is_one_clear_line(server):
    base, _ = server
    one_clear_line(CliRunner().invoke(app, ["bench", "serve", base, "--api-key", "wrong", "--num-prompts", "1"]),
                   "refused the API key (HTTP 401: invalid or missing API key")


def one_clear_line(r, pattern):
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and pattern in lines[0], r.stderr
    assert "Traceback" not in r.output and r.stdout == ""


# ---------------------------------------------------------------- maths on known inputs


def test_poisson_schedule_is_reproducible_and_has_its_rate():
    first = list(itertools.islice(arrival_offsets(2.0, 3), 50))
    assert first == list(itertools.islice(arrival_offsets(2.0, 3), 50))
    assert first != list(itertools.islice(arrival_offsets(2.0, 4), 50))
    assert first[0] == 0.0 and all(b > a for a, b in zip(first, first[1:]))
    assert list(itertools.islice(arrival_offsets(math.inf, 3), 5)) == [0.0] * 5
    # n exponential gaps of rate r: their sum has mean n/r and sd sqrt(n)/r, so the observed rate
    # is within 5 sd (5/sqrt(n) relative) of r; the gaps' coefficient of variation is 1 (+- 5 sd)
    n, rate = 20_000, 8.0
    times = list(itertools.islice(arrival_offsets(rate, 11), n + 1))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert abs(n / times[-1] / rate - 1) < 5 / math.sqrt(n)
    mean = sum(gaps) / n
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1))
    assert abs(sd / mean - 1) < 5 * math.sqrt(2 / n)


def test_percentiles_on_a_known_list():
    xs = [50, 15, 40, 20, 35]  # sorted: 15 20 35 40 50; rank q/100 * 4, linear between neighbours
    assert [percentile(xs, q) for q in (0, 25, 50, 90, 99, 100)] == pytest.approx([15, 20, 35, 46, 49.6, 50])
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    np = pytest.importorskip("numpy")
    ys = [random.Random(0).random() for _ in range(101)]
    assert [percentile(ys, q) for q in (50, 90, 99)] == pytest.approx(list(np.percentile(ys, [50, 90, 99])))


def test_goodput_counts_requests_meeting_every_target():
    def rec(i, ttft, e2e, tokens, ok=True):
        r = RequestRecord(i, 0.0, sent_s=0.0, done_s=e2e, ok=ok, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens,
                          prompt_tokens=10, usage=True, itl_s=[(e2e - ttft) / max(tokens - 1, 1)] * (tokens - 1))
        if not ok:
            r.fail("HTTP 500", "boom", e2e)
        return r

    records = [rec(0, 0.05, 0.95, 10),   # TPOT 100 ms: misses the ITL target
               rec(1, 0.05, 0.23, 10),   # TPOT 20 ms, TTFT 50 ms: good
               rec(2, 0.30, 0.30, 1),    # TTFT 300 ms: misses; one token, TPOT 0
               rec(3, 0.01, 0.01, 1),    # good (TPOT 0 for one token, as benchmark_serving)
               rec(4, 0.0, 2.0, 0, ok=False)]
    cfg = LoadTestConfig("http://x:1", slo_ttft_ms=100, slo_itl_ms=50)
    s = summarize(cfg, Target("m", "words"), records, duration_s=2.0).summary
    assert (s["issued"], s["ok"], s["failed"], s["failures"]) == (5, 4, 1, {"HTTP 500": 1})
    assert (s["good"], s["goodput"], s["request_throughput"]) == (2, 1.0, 2.0)
    assert (s["output_tokens"], s["input_tokens"], s["output_throughput"]) == (22, 40, 11.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(60.0)  # TPOT over requests with > 1 token: 100, 20
    assert (s["ttft_ms"]["p50"], s["ttft_ms"]["mean"]) == pytest.approx((50.0, 102.5))  # of 50 50 300 10
    only_ttft = summarize(LoadTestConfig("http://x:1", slo_ttft_ms=100), Target("m", "words"), records, 2.0)
    assert only_ttft.summary["good"] == 3
    assert summarize(LoadTestConfig("http://x:1"), Target("m", "words"), records, 2.0).summary["goodput"] is None


def test_dataset_rows(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "one"}\n\n{"messages": [{"role": "system", "content": "s"}, '
                                      '{"role": "user", "content": "two"}]}\n')
    assert load_prompts(tmp_path / "p.jsonl") == ["one", "two"]
    shutil.copy(tmp_path / "p.jsonl", tmp_path / "bad.jsonl")
    with open(tmp_path / "bad.jsonl", "a") as f:
        f.write('{"text": "no prompt"}\n')
    with pytest.raises(UserError, match="row 4 has no"):
        load_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(UserError, match="cannot read it as JSON"):
        load_prompts(tmp_path / "broken.json")
