"""`optllm serve` as a process on 127.0.0.1 with a tiny model, driven by the official `openai`
client and raw HTTP: greedy answers equal LLM.generate's, 64 concurrent streams each equal
their non-streamed twin, every client error gets its status and the server keeps serving,
a client that leaves mid-stream has its KV blocks back at once, SIGTERM exits 0."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")

KEY = "sk-test-key"
PROMPTS = ["The python language", "def main():", "In the beginning"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(folder, *args, key=KEY):
    port = free_port()
    cmd = [sys.executable, "-m", "optllm", "serve", str(folder), "--port", str(port), "--device", "cpu",
           "--served-model-name", "tiny", *args]
    if key:
        cmd += ["--api-key", key]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            if get(base + "/health")[0] == 200:
                return proc, base
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("server did not come up in 60 s")


def request(method, url, body=None, headers=None, raw=None):
    """(status, parsed JSON body or text) with the standard library only."""
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode(), e.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def get(url, **kw):
    return request("GET", url, **kw)


def post(url, body=None, **kw):
    return request("POST", url, body, **kw)


AUTH = {"Authorization": f"Bearer {KEY}"}


def metric(base, name) -> float:
    _, text = get(base + "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tiny_llama, tmp_path_factory):
    """The tiny model with a chat template."""
    import shutil

    folder = tmp_path_factory.mktemp("chat") / "m"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def server(chat_model):
    proc, base = start(chat_model, "--max-model-len", "256", "--max-body-mb", "0.05")  # 52 KB of body at most
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(api_key=KEY, base_url=server[1] + "/v1", max_retries=0, timeout=120)


def test_greedy_completions_equal_llm_generate(client, chat_model):
    from optllm import LLM, SamplingParams

    want = LLM(chat_model, device="cpu").generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [w.outputs[0].text for w in want]
    assert r.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in want)
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_completions_streamed_and_not(client, chat_model):
    from optllm import LLM, SamplingParams

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    llm = LLM(chat_model, device="cpu")
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(llm.chat_prompt(messages))
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=messages, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}}}}])


def test_logprobs(client):
    r = client.completions.create(model="tiny", prompt="x = ", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)


def test_64_concurrent_streams_equal_their_plain_twins(client):
    prompts = [f"Item {i}: the" for i in range(64)]

    def plain(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0).choices[0].text

    def streamed(p):
        parts, finish, usage = [], None, None
        for chunk in client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0, stream=True,
                                               stream_options={"include_usage": True}):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return "".join(parts), finish, usage

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        got = list(pool.map(streamed, prompts))
    want = [plain(p) for p in prompts]
    assert [g[0] for g in got] == want
    assert all(g[1] in ("length", "stop") and g[2] is not None and g[2].completion_tokens >= 1 for g in got)


def test_client_errors_get_their_status_and_the_server_keeps_serving(server):
    base = server[1]
    url = base + "/v1/completions"
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    cases = [
        (post(url, raw=b"{not json", headers=AUTH), 400, None),
        (post(url, {**ok, "model": "gpt-9"}, headers=AUTH), 404, "model"),
        (post(url, {**ok, "max_tokens": -1}, headers=AUTH), 400, "max_tokens"),
        (post(url, {**ok, "prompt": "word " * 400}, headers=AUTH), 400, "prompt"),
        (post(url, {**ok, "temperature": "hot"}, headers=AUTH), 400, "temperature"),
        (post(url, ok), 401, None),
        (post(url, ok, headers={"Authorization": "Bearer wrong"}), 401, None),
        (post(url, raw=b"x" * 60_000, headers=AUTH), 413, None),
        (get(base + "/v1/nope", headers=AUTH), 404, None),
    ]
    for (status, body), want, param in cases:
        assert status == want, body
        assert set(body["error"]) == {"message", "type", "param", "code"} and "Traceback" not in json.dumps(body)
        if param:
            assert body["error"]["param"] == param
    assert post(url, ok, headers=AUTH)[0] == 200
    assert get(base + "/health")[0] == 200
    assert metric(base, 'optllm_requests_total{endpoint="/v1/completions",status="401"}') >= 2


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server):
    base = server[1]
    import http.client

    host, port = base.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": "tiny", "prompt": "Once upon", "max_tokens": 200, "stream": True,
                       "ignore_eos": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", **AUTH})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.read1(4096)  # the first event(s), de-chunked
    assert first.startswith(b"data: ")
    assert metric(base, "optllm_kv_blocks_used") > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    for _ in range(100):
        if metric(base, "optllm_kv_blocks_used") == 0 and metric(base, "optllm_num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric(base, "optllm_kv_blocks_used") == 0
    assert metric(base, "optllm_num_requests_running") == 0


def test_sigterm_finishes_in_flight_work_and_exits_0(tiny_llama):
    proc, base = start(tiny_llama, "--log-prompts", key=None)
    try:
        engine = engine_pid(proc.pid)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(post, base + "/v1/completions", {"prompt": "secret words", "max_tokens": 64,
                                                               "ignore_eos": True})
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            status, body = fut.result(timeout=60)
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        assert gone(engine, 10)
        err = proc.stderr.read()
        assert "POST /v1/completions 200" in err and "secret words" in err  # one line, with --log-prompts
    finally:
        if proc.poll() is None:
            proc.kill()


def engine_pid(pid: int) -> int:
    """The pid of the server's engine process: its child that multiprocessing spawned (not
    multiprocessing's resource tracker), from Linux's /proc."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    cmd = c.read()
                if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                    found.append(int(child))
    (engine,) = found
    return engine


def gone(pid: int, seconds: float) -> bool:
    for _ in range(int(seconds * 10)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie: exited, its parent has not reaped it yet
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_dead_engine_process_is_reported_and_the_server_still_stops_cleanly(tiny_llama):
    """The engine runs in a child process: killed, /health says 503, requests get a JSON 500
    (no traceback), and SIGTERM still exits 0."""
    proc, base = start(tiny_llama, key=None)
    try:
        engine = engine_pid(proc.pid)
        os.kill(engine, signal.SIGKILL)
        for _ in range(100):
            if get(base + "/health")[0] == 503:
                break
            time.sleep(0.1)
        assert get(base + "/health")[0] == 503
        status, body = post(base + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 500 and set(body["error"]) == {"message", "type", "param", "code"}
        assert "Traceback" not in json.dumps(body)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_engine_process_does_not_outlive_a_killed_server(tiny_llama):
    proc, _ = start(tiny_llama, key=None)
    engine = engine_pid(proc.pid)
    proc.kill()
    proc.wait()
    assert gone(engine, 30), "the engine process kept running after its server was killed"


def test_prompts_stay_out_of_the_log_by_default(server, client):
    client.completions.create(model="tiny", prompt="private text", max_tokens=2)
    proc = server[0]
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    err = proc.stderr.read()
    assert "POST /v1/completions 200" in err and "private text" not in err
