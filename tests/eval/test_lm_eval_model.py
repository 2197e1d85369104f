"""OptllmLM (lm-eval's model interface over the runtime) against HF transformers on a tiny
random Llama, float32 on CPU: log-likelihoods, rolling log-likelihoods and greedy
generations equal those computed from the HF model's own logits; both of optllm's offline
tasks run end to end through lm_eval.simple_evaluate. Bound: 1e-4 nats per request (float32
summation order; the values are tens of nats)."""

from __future__ import annotations

import json
import string

import pytest
import torch
from conftest import make_tiny_model

pytest.importorskip("lm_eval")  # a base dependency; absent only on a GPU machine that runs `pytest -m gpu` bare
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from optllm import LLM  # noqa: E402
from optllm.eval.lm_eval_model import OptllmLM, to_sampling_params  # noqa: E402
from optllm.eval.tasks import BUILTIN_TASKS, TAG, builtin_task_dir, task_manager

MAX_MODEL_LEN = 128
ATOL = 1e-4
EOS = 0  # the tiny tokenizer's "</s>"; it has no BOS, so EOS is lm-eval's prefix token

PAIRS = [
    ("The Python language", " is a programming language"),
    ("def main():", "\n    return 0"),
    ("", "Hello world"),  # empty context: conditioned on the prefix token
    ("A context with a trailing space ", "word"),  # the space moves to the continuation
    ("x", " y"),
    ("In the beginning " * 20, "was the word"),  # longer than max_length: cut on the left
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lm-eval") / "llama", "llama")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder, device="cpu", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def lm(llm):
    return OptllmLM(llm)


def hf_token_logprobs(model, ids: list[int]) -> tuple[list[float], list[int]]:
    """Per position i >= 1: log p(ids[i] | ids[:i]) and the argmax token, from HF's float32 logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))], lp[:-1].argmax(-1).tolist()


def hf_loglikelihood(hf, context: str, continuation: str, max_length: int) -> tuple[float, bool]:
    """The reference, written from lm-eval's rules: encode context + continuation whole and
    split at the context's token count (trailing spaces of the context belong to the
    continuation); empty context: the prefix token; keep the last max_length + 1 tokens."""
    model, tok = hf
    if context:
        stripped = context.rstrip()
        continuation, context = context[len(stripped):] + continuation, stripped
        whole = tok.encode(context + continuation)
        n_cont = len(whole) - len(tok.encode(context))
    else:
        whole = [EOS] + tok.encode(continuation)
        n_cont = len(whole) - 1
    whole = whole[-(max_length + 1):]
    lps, argmax = hf_token_logprobs(model, whole)
    scored = range(len(whole) - n_cont, len(whole))
    return sum(lps[p - 1] for p in scored), all(argmax[p - 1] == whole[p] for p in scored)


def instances(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_equals_hf(lm, llm, hf):
    assert lm.max_length == MAX_MODEL_LEN - 1 and lm.prefix_token_id == EOS
    assert len(hf[1].encode(PAIRS[-1][0])) > lm.max_length  # the truncation case is one
    got = lm.loglikelihood(instances("loglikelihood", PAIRS))
    want = [hf_loglikelihood(hf, c, x, lm.max_length) for c, x in PAIRS]
    for (c, x), (lp, greedy), (ref_lp, ref_greedy) in zip(PAIRS, got, want):
        assert lp == pytest.approx(ref_lp, abs=ATOL), (c, x)
        assert greedy == ref_greedy
    # requests handed to the engine two at a time: the same numbers
    chunked = OptllmLM(llm, batch_size=2).loglikelihood(instances("loglikelihood", PAIRS))
    assert [g for _, g in chunked] == [g for _, g in got]
    assert [lp for lp, _ in chunked] == pytest.approx([lp for lp, _ in got], abs=ATOL)


def test_choices_share_their_context_through_the_prefix_cache(folder, hf):
    """Four continuations of one long context: the first request computes the context, the
    other three read its whole KV blocks from the prefix cache (each scores only its own
    continuation, prompt_logprobs_start), and every log-likelihood still equals HF's."""
    context = "In the beginning was the word and the word was " * 3
    pairs = [(context, c) for c in (" good", " a tree", " seven", " light")]
    lm = OptllmLM(LLM(folder, device="cpu", max_model_len=MAX_MODEL_LEN))
    assert len(lm.tok_encode(context)) >= 32  # two whole blocks of 16 to share
    got = lm.loglikelihood(instances("loglikelihood", pairs))
    for (c, x), (lp, greedy) in zip(pairs, got):
        ref_lp, ref_greedy = hf_loglikelihood(hf, c, x, lm.max_length)
        assert lp == pytest.approx(ref_lp, abs=ATOL) and greedy == ref_greedy
    bm = lm.llm.engine.scheduler.block_manager
    assert bm.num_hit_tokens >= 3 * 32, bm.num_hit_tokens


def test_is_greedy_is_the_argmax_of_every_continuation_token(lm, hf):
    model, tok = hf
    ctx = tok.encode("The Python language is")
    ids = list(ctx)
    for _ in range(5):  # HF's greedy continuation, one token at a time
        ids.append(hf_token_logprobs(model, ids + [EOS])[1][-1])
    greedy = ids[len(ctx):]
    off_last = greedy[:-1] + [(greedy[-1] + 1) % 320]
    off_first = [(greedy[0] + 1) % 320] + greedy[1:]
    got = lm._loglikelihood_tokens([(None, ctx, greedy), (None, ctx, off_last), (None, ctx, off_first),
                                    (None, ctx, greedy[:1])])
    assert [g for _, g in got] == [True, False, False, True]
    lps, _ = hf_token_logprobs(model, ctx + greedy)
    assert got[0][0] == pytest.approx(sum(lps[len(ctx) - 1:]), abs=ATOL)
    assert got[3][0] == pytest.approx(lps[len(ctx) - 1], abs=ATOL)


def test_loglikelihood_rolling_equals_hf(llm, lm, hf):
    model, tok = hf
    short = "Python is a programming language that lets you work quickly."
    ids = [EOS] + tok.encode(short)
    assert len(ids) <= lm.max_length
    [got] = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(short,)]))
    assert got == pytest.approx(sum(hf_token_logprobs(model, ids)[0]), abs=ATOL)

    # windows of 16 tokens: every token scored exactly once, each window a fresh context
    from lm_eval.models.huggingface import HFLM

    long = short + " It integrates systems effectively, and the standard library is large. " * 3
    assert len(tok.encode(long)) > 3 * 16
    small = OptllmLM(llm, max_length=16)
    ref = HFLM(pretrained=model, tokenizer=tok, device="cpu", max_length=16, batch_size=4)
    texts = [(short,), (long,), ("",)]
    got = small.loglikelihood_rolling(instances("loglikelihood_rolling", texts))
    want = ref.loglikelihood_rolling(instances("loglikelihood_rolling", texts))
    assert got == pytest.approx(want, abs=ATOL)
    assert got[2] == 0.0
    assert got[1] != pytest.approx(lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(long,)]))[0],
                                   abs=1e-2)  # the window length matters: it was applied


def hf_greedy_text(hf, eos_ids, context: str, max_new: int) -> str:
    model, tok = hf
    ids = torch.tensor([tok.encode(context)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=sorted(eos_ids), pad_token_id=EOS)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_generate_until_equals_hf_greedy_and_stops_at_until(lm, llm, hf):
    contexts = ["The Python language", "def main():\n", "Question: What is 2 + 3?\nAnswer:"]
    full = [hf_greedy_text(hf, llm.engine.eos_token_ids, c, 12) for c in contexts]
    assert all(len(f) >= 6 for f in full)
    stops = [f[len(f) // 2:len(f) // 2 + 2] for f in full]  # strings the greedy text does contain
    cut = [f.split(s)[0] for f, s in zip(full, stops)]
    assert all(len(c) < len(f) for c, f in zip(cut, full))
    args = [(c, {"until": [s, "@@never@@"], "max_gen_toks": 12}) for c, s in zip(contexts, stops)]
    args += [(c, {"until": ["@@never@@"], "max_gen_toks": 12, "do_sample": False}) for c in contexts]
    got = lm.generate_until(instances("generate_until", args))
    assert got == cut + full


def test_generate_until_honours_sampling(lm):
    ctx = ["The Python language", "Hello", "A"]
    greedy = lm.generate_until(instances("generate_until", [(c, {"until": [], "max_gen_toks": 8}) for c in ctx]))
    hot = {"until": [], "max_gen_toks": 8, "do_sample": True, "temperature": 1.5, "seed": 7}
    a = lm.generate_until(instances("generate_until", [(c, dict(hot)) for c in ctx]))
    b = lm.generate_until(instances("generate_until", [(c, dict(hot)) for c in ctx]))
    assert a == b and a != greedy  # seeded sampling: repeatable, and not the argmax path


def test_sampling_params_from_gen_kwargs():
    sp, until = to_sampling_params({"until": ["\n"]}, eos="</s>")
    assert (sp.temperature, sp.max_tokens, sp.stop, until) == (0.0, 256, ["\n", "</s>"], ["\n", "</s>"])
    sp, _ = to_sampling_params({"until": "Q:", "do_sample": False, "temperature": 0.8, "max_gen_toks": 5}, eos=None)
    assert (sp.temperature, sp.max_tokens, sp.stop) == (0.0, 5, ["Q:"])
    sp, _ = to_sampling_params({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3,
                             "max_new_tokens": 9}, eos=None)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.max_tokens) == (0.7, 0.9, 5, 3, 9)
    assert to_sampling_params({"do_sample": True}, eos=None)[0].temperature == 1.0
    assert to_sampling_params({"temperature": 0.5}, eos=None)[0].temperature == 0.5  # no do_sample: samples


def test_construction_checks(llm):
    assert get_model("optllm") is OptllmLM and get_model("hf").__name__ == "HFLM"  # lm-eval's own kept
    with pytest.raises(ValueError, match="dtype: not allowed with an LLM already built"):
        OptllmLM(llm, dtype="float32")
    with pytest.raises(ValueError, match="batch_size='many' is not allowed"):
        OptllmLM(llm, batch_size="many")
    with pytest.raises(ValueError, match=r"max_length=128 is not allowed; allowed: an integer in \[1, 127\]"):
        OptllmLM(llm, max_length=128)
    assert OptllmLM(llm, batch_size="auto").batch_size is None and OptllmLM(llm, batch_size="3").batch_size == 3


def test_builtin_tasks_are_shipped_and_indexed():
    folder = builtin_task_dir()
    mc = [json.loads(line) for line in (folder / "optllm_mc.jsonl").read_text().splitlines()]
    gen = [json.loads(line) for line in (folder / "optllm_gen.jsonl").read_text().splitlines()]
    assert len(mc) >= 40 and len(gen) >= 30
    assert all(len(d["choices"]) == 4 and d["answer"] in range(4) and d["question"] for d in mc)
    assert {d["answer"] for d in mc} == {0, 1, 2, 3}  # the right answer is not always in one place
    assert all(d["question"] and d["answer"].strip() == d["answer"] != "" for d in gen)
    tm = task_manager()
    assert set(BUILTIN_TASKS) | {TAG} <= set(tm.all_tasks)


def _norm(text: str) -> str:  # the task's exact_match options: ignore case and punctuation
    return text.lower().translate(str.maketrans("", "", string.punctuation))


def samples_of(out, task):
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def test_multiple_choice_task_end_to_end(folder, hf, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the task's data is found wherever lm-eval runs
    out = simple_evaluate(model="optllm", model_args={"pretrained": str(folder), "device": "cpu",
                                                      "max_model_len": MAX_MODEL_LEN},
                          tasks=["optllm_mc"], task_manager=task_manager(), limit=4, bootstrap_iters=0)
    res = out["results"]["optllm_mc"]
    samples = samples_of(out, "optllm_mc")
    assert len(samples) == 4
    acc, acc_norm = [], []
    for s in samples:
        assert len(s["arguments"]) == 4
        lls = [r[0][0] for r in s["resps"]]
        for (ctx, cont), ll in zip(s["arguments"], lls):  # every choice scored as HF scores it
            assert ll == pytest.approx(hf_loglikelihood(hf, ctx, cont, MAX_MODEL_LEN - 1)[0], abs=ATOL)
        choices = s["doc"]["choices"]
        norm = [ll / len(c) for ll, c in zip(lls, choices)]  # lm-eval: per character of the choice
        acc.append(float(max(range(4), key=lls.__getitem__) == s["doc"]["answer"]))
        acc_norm.append(float(max(range(4), key=norm.__getitem__) == s["doc"]["answer"]))
        assert s["doc"]["question"] in s["arguments"][0][0]
    assert res["acc,none"] == pytest.approx(sum(acc) / 4)
    assert res["acc_norm,none"] == pytest.approx(sum(acc_norm) / 4)


def test_generation_task_end_to_end(lm, llm, hf, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = simple_evaluate(model=lm, tasks=["optllm_gen"], task_manager=task_manager(), limit=3, bootstrap_iters=0)
    res = out["results"]["optllm_gen"]
    samples = samples_of(out, "optllm_gen")  # one per document and filter
    assert sorted((s["doc_id"], s["filter"]) for s in samples) == sorted(
        (d, f) for d in range(3) for f in ("strict-match", "first-word"))
    for s in samples:
        prompt, kwargs = s["arguments"][0]
        assert prompt == f"Question: {s['doc']['question']}\nAnswer:" and kwargs["until"] == ["\n", "Question:"]
        full = hf_greedy_text(hf, llm.engine.eos_token_ids, prompt, 16)
        want = full.split("\n")[0].split("Question:")[0]
        assert s["resps"] == [[want]]  # the runtime's greedy text, cut at the first until string
        [filtered] = s["filtered_resps"]
        if s["filter"] == "strict-match":
            assert filtered == want.strip()
        assert s["exact_match"] == float(_norm(filtered) == _norm(s["target"]))
    for name in ("strict-match", "first-word"):
        per_doc = [s["exact_match"] for s in samples if s["filter"] == name]
        assert res[f"exact_match,{name}"] == pytest.approx(sum(per_doc) / 3)
