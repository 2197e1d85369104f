"""`optllm serve --draft`: the same completions as without a draft, and the speculation
counters on /metrics."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")  # as test_server: the server extra is optional

from conftest import write_draft  # noqa: E402
from test_server import KEY, PROMPTS, get, start  # noqa: E402


@pytest.fixture(scope="module")
def draft_server(tiny_llama, tmp_path_factory):
    draft = write_draft(tmp_path_factory.mktemp("serve-draft") / "eagle", tiny_llama, "eagle")
    proc, base = start(tiny_llama, "--max-model-len", "256", "--draft", str(draft), "--spec-top-k", "3",
                       "--spec-depth", "4", "--spec-tokens", "10")
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_served_draft_gives_the_same_completions_and_counts_speculation(draft_server, tiny_llama):
    from optllm import LLM, SamplingParams

    _, base = draft_server
    client = openai.OpenAI(api_key=KEY, base_url=base + "/v1", max_retries=0, timeout=120)
    want = LLM(tiny_llama, device="cpu").generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [w.outputs[0].text for w in want]
    chunks = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0].outputs[0].text
    _, text = get(base + "/metrics")
    values = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("optllm_spec_decode")}
    assert values["optllm_spec_decode_num_drafts_total"] > 0
    assert values["optllm_spec_decode_num_draft_tokens_total"] == 10 * values["optllm_spec_decode_num_drafts_total"]
    accepted = sum(v for k, v in values.items() if k.startswith("optllm_spec_decode_accepted_length_total{"))
    assert accepted == values["optllm_spec_decode_num_drafts_total"]
    assert values["optllm_spec_decode_mean_accepted_length"] >= 1.0
