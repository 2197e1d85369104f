"""Draft data: .jsonl and ShareGPT prompts, Magpie prompts written by the target itself
(deterministic, deduplicated), and the target's answers as training sequences."""

from __future__ import annotations

import json

import pytest

from optllm.errors import UserError
from optllm.runtime.llm import LLM, render_chat
from optllm.runtime.sampling_params import SamplingParams
from optllm.speculative.data import answer_prompts, distinct_texts, magpie_prompts, read_prompts, user_prefix


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_plain_and_sharegpt_prompts(tmp_path):
    f = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Name three rivers."},
        "",
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi?"},
                           {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "More?"}]},
        {"conversations": [{"role": "user", "content": "Why is the sky blue?"},
                           {"role": "assistant", "content": "Rayleigh."}]},
    ])
    assert read_prompts(f) == [
        "Name three rivers.",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
        [{"role": "user", "content": "Why is the sky blue?"}],
    ]


@pytest.mark.parametrize("row, where", [
    ("{not json", "p.jsonl:2: not JSON"),
    ({"text": "no prompt key"}, "p.jsonl:2: expected"),
    ({"conversations": [{"from": "gpt", "value": "an answer before any question"}]}, "p.jsonl:2: expected"),
])
def test_bad_prompt_lines_name_the_line(tmp_path, row, where):
    f = _jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(UserError, match=where):
        read_prompts(f)


def test_missing_and_empty_prompt_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="no prompts"):
        read_prompts(_jsonl(tmp_path / "e.jsonl", [""]))


def test_no_chat_template_is_one_clear_error(tiny_llama):
    from transformers import AutoTokenizer

    with pytest.raises(UserError, match="no chat template.*--prompts"):
        user_prefix(AutoTokenizer.from_pretrained(tiny_llama))


def test_user_prefix_of_a_template(tiny_chat):
    from transformers import AutoTokenizer

    assert user_prefix(AutoTokenizer.from_pretrained(tiny_chat)) == ("<|user|>\n", "</s>")


@pytest.fixture(scope="module")
def chat_llm(tiny_chat):
    return LLM(str(tiny_chat), device="cpu", max_model_len=128)


def test_magpie_prompts_are_deterministic_distinct_and_non_empty(chat_llm):
    a = magpie_prompts(chat_llm, 5, seed=3, max_tokens=8)
    b = magpie_prompts(chat_llm, 5, seed=3, max_tokens=8)
    assert a == b and len(a) == 5
    texts = [c[0]["content"] for c in a]
    assert all(c == [{"role": "user", "content": t}] and t.strip() for c, t in zip(a, texts))
    assert len({" ".join(t.casefold().split()) for t in texts}) == 5
    assert magpie_prompts(chat_llm, 5, seed=4, max_tokens=8) != a


def test_magpie_openers_start_the_turns_and_keep_them_deterministic(chat_llm):
    """With openers each request's prefix ends with its opener (by its seed, so a resampled round keeps them) and
    the turn is the opener and what the model wrote after it; the same seeds give the same turns."""
    from optllm.speculative.data import TASK_OPENERS

    openers = ("Write a story", "Explain")
    a = magpie_prompts(chat_llm, 6, seed=3, max_tokens=8, openers=openers)
    assert a == magpie_prompts(chat_llm, 6, seed=3, max_tokens=8, openers=openers) and len(a) == 6
    texts = [c[0]["content"] for c in a]
    assert all(t.startswith(openers) for t in texts)
    assert {t.startswith("Explain") for t in texts} == {True, False}  # both kinds were asked for and came back
    # the opener is in the prefix the model continued: request i (seed 3 + i) is openers[(3 + i) % 2]
    before, _ = user_prefix(chat_llm.tokenizer)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=8, seed=3)
    ids = chat_llm.tokenizer(before + openers[1], add_special_tokens=False)["input_ids"]
    first = openers[1] + chat_llm.generate([ids], params)[0].outputs[0].text
    assert first.strip() == texts[0]
    assert len(TASK_OPENERS) == len(set(TASK_OPENERS)) and any(o.startswith("Write") for o in TASK_OPENERS)


def test_read_openers(tmp_path):
    from optllm.speculative.data import TASK_OPENERS, read_openers

    assert read_openers("builtin") == TASK_OPENERS
    f = tmp_path / "o.txt"
    f.write_text("  Write a story \n\n Explain\n")
    assert read_openers(str(f)) == ("Write a story", "Explain")
    for bad in ("\n \n", None):
        if bad is not None:
            f.write_text(bad)
        with pytest.raises(ValueError, match="allowed builtin or a file with one opener a line"):
            read_openers(str(f) if bad is not None else str(tmp_path / "missing.txt"))


def test_overlaps_finds_an_evaluation_prompt_inside_a_written_one():
    from optllm.speculative.data import overlaps

    refs = ["Write a short story about a robot who learns to paint.", "Tell me a joke."]
    texts = ["Please write a SHORT story about a robot, who learns to paint today",  # 8 words in a row, case/commas
             "Write a short story about a robot that dances.",  # 7 words in a row only
             "tell me a joke",  # a short reference whole
             "Could you tell me a joke?",
             "Tell me a jokester's secret"]  # not the word "joke"
    assert overlaps(texts, refs) == [True, False, True, True, False]
    assert overlaps(texts[:2], refs, n=7) == [True, True]
    with pytest.raises(ValueError, match="n=0"):
        overlaps(texts, refs, n=0)


def test_distinct_texts():
    seen = {"old one"}
    assert distinct_texts(["  Old   ONE ", "a b", " A  b ", "", "   ", "c", "a b"], seen) == ["a b", "c"]
    assert seen == {"old one", "a b", "c"}


def test_magpie_drops_empty_turns(chat_llm):
    # the tiny model's greedy user turn is empty (it ends the turn at once): nothing survives
    assert magpie_prompts(chat_llm, 3, temperature=0.0, max_tokens=8) == []


def test_answers_are_the_targets_own_continuations(chat_llm):
    prompts = [[{"role": "user", "content": "Hello there"}], "Plain text prompt"]
    seqs = answer_prompts(chat_llm, prompts, max_tokens=6, temperature=0.0, max_len=128)
    assert len(seqs) == 2
    rendered = render_chat(chat_llm.tokenizer, prompts[0])
    plain = list(chat_llm.tokenizer("Plain text prompt")["input_ids"])
    for s, ids in zip(seqs, [rendered, plain]):
        assert s.num_prompt_tokens == len(ids) and s.token_ids[: len(ids)] == ids
        greedy = chat_llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].token_ids
        assert s.token_ids[len(ids):] == list(greedy)
    # a prompt that leaves no room for an answer under max_len is dropped
    assert answer_prompts(chat_llm, prompts, max_tokens=6, max_len=len(rendered)) == [] or \
        all(len(s.token_ids) <= len(rendered) for s in answer_prompts(chat_llm, prompts, max_tokens=6,
                                                                      max_len=len(rendered)))


def test_an_earlier_datasets_prompts_answered_again(tmp_path, chat_llm):
    """A train-draft dataset.jsonl as --prompts: each line's prompt part (token ids as they are),
    answered by this target -- the float target's prompts for its quantized checkpoint's draft."""
    rendered = render_chat(chat_llm.tokenizer, [{"role": "user", "content": "Hello there"}])
    f = _jsonl(tmp_path / "dataset.jsonl", [
        {"token_ids": rendered + [5, 6, 7], "num_prompt_tokens": len(rendered)},
        {"token_ids": [11, 12, 13, 14], "num_prompt_tokens": 2},
    ])
    prompts = read_prompts(f)
    assert prompts == [tuple(rendered), (11, 12)]
    seqs = answer_prompts(chat_llm, prompts, max_tokens=5, temperature=0.0, max_len=128)
    assert [s.num_prompt_tokens for s in seqs] == [len(rendered), 2]
    for s, ids in zip(seqs, [rendered, [11, 12]]):
        greedy = chat_llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0].token_ids
        assert s.token_ids == ids + list(greedy)  # the old answer (5, 6, 7; 13, 14) is not kept


@pytest.mark.parametrize("row", [
    {"token_ids": [1, 2, 3], "num_prompt_tokens": 0},  # no prompt
    {"token_ids": [1, 2, 3], "num_prompt_tokens": 4},  # past the sequence
    {"token_ids": [1, -2, 3], "num_prompt_tokens": 2},  # a negative id
    {"token_ids": [1, 2.5, 3], "num_prompt_tokens": 2},  # not an integer
    {"token_ids": [1, 2, 3]},  # no boundary
])
def test_bad_dataset_lines_as_prompts(tmp_path, row):
    with pytest.raises(UserError, match="p.jsonl:1: expected.*token_ids"):
        read_prompts(_jsonl(tmp_path / "p.jsonl", [row]))


def test_token_prompts_past_the_vocabulary_are_one_clear_error(chat_llm):
    vocab = chat_llm.engine.runner.vocab_size
    with pytest.raises(UserError, match=f"token id {vocab}, past this target's vocabulary of {vocab}"):
        answer_prompts(chat_llm, [(1, vocab)], max_tokens=2)
