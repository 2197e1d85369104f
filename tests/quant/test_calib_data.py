"""Calibration data: shapes, determinism, windows taken from the stream, sources (the built-in
mixture and its kinds, files, self, hub), errors."""

from __future__ import annotations

import hashlib
import json
import logging
import random

import pytest
import torch

from optllm.hub.corpus import KINDS, texts
from optllm.quant import calib_data
from optllm.quant.calib_data import CalibrationData, builtin_counts, load_calibration, token_hash


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE (vocab 384) trained in-process on the built-in corpus; EOS <eos>."""
    from conftest import tiny_tokenizer

    return tiny_tokenizer(384, eos="<eos>", docs=None)


@pytest.fixture(scope="module")
def model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(cfg).eval()


def _random_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = ["alpha", "river", "stone", "quiet", "seven", "lamp", "orbit", "maple", "crane", "delta", "ember"]
    return " ".join(rng.choice(vocab) + str(rng.randrange(1000)) for _ in range(words))


def _find(stream: list[int], window: list[int]) -> list[int]:
    n = len(window)
    return [i for i in range(len(stream) - n + 1) if stream[i : i + n] == window]


def test_builtin_shape_determinism_and_seed(tokenizer):
    a = load_calibration(tokenizer, "builtin", num_samples=6, seq_len=64, seed=0)
    b = load_calibration(tokenizer, "builtin", num_samples=6, seq_len=64, seed=0)
    c = load_calibration(tokenizer, "builtin", num_samples=6, seq_len=64, seed=1)
    assert isinstance(a, CalibrationData)
    assert a.input_ids.shape == (6, 64) and a.input_ids.dtype == torch.int64
    assert torch.equal(a.input_ids, b.input_ids) and a.sha256 == b.sha256
    assert not torch.equal(a.input_ids, c.input_ids) and a.sha256 != c.sha256
    assert a.source.startswith("builtin")
    assert 0 <= int(a.input_ids.min()) and int(a.input_ids.max()) < len(tokenizer)


def test_builtin_counts_follow_the_shares():
    assert builtin_counts(128) == {"docs": 51, "code": 39, "chat": 38}
    assert builtin_counts(10) == {"docs": 4, "code": 3, "chat": 3}
    assert builtin_counts(1) == {"docs": 1, "code": 0, "chat": 0}
    for n in range(1, 300):
        counts = builtin_counts(n)
        assert sum(counts.values()) == n and list(counts) == list(KINDS)
        assert all(abs(counts[k] - share * n) < 1 for k, share in calib_data.BUILTIN_SHARES)
        assert n < 3 or min(counts.values()) >= 1


def _kind_of(tokenizer, window: list[int], joined: dict[str, str]) -> str:
    """The kind whose calib text holds the window's longest EOS-free piece (decoded: the tiny
    byte-level BPE is lossless but for a character cut at the window's edge)."""
    pieces = [p.strip("\ufffd") for p in tokenizer.decode(window).split(tokenizer.eos_token)]
    longest = max(pieces, key=len)
    found = [k for k, text in joined.items() if longest in text]
    assert len(found) == 1 and len(longest) >= 20, (longest, found)
    return found[0]


@pytest.fixture(scope="module")
def calib_joined() -> dict[str, str]:
    return {k: "\x00".join(texts(k, "calib")) for k in KINDS}


def test_builtin_is_the_mixture_of_kinds_in_their_shares(tokenizer, calib_joined):
    data = load_calibration(tokenizer, "builtin", num_samples=10, seq_len=64, seed=0)
    kinds = [_kind_of(tokenizer, row, calib_joined) for row in data.input_ids.tolist()]
    assert {k: kinds.count(k) for k in KINDS} == {"docs": 4, "code": 3, "chat": 3}
    assert kinds != sorted(kinds, key=KINDS.index)  # interleaved, not kind after kind
    assert "docs 4 + code 3 + chat 3" in data.source and "40/30/30" in data.source


@pytest.mark.parametrize("kind", KINDS)
def test_one_kind_of_the_builtin_corpus(tokenizer, calib_joined, kind):
    a = load_calibration(tokenizer, kind, num_samples=4, seq_len=64, seed=0)
    b = load_calibration(tokenizer, kind, num_samples=4, seq_len=64, seed=0)
    assert a.input_ids.shape == (4, 64) and torch.equal(a.input_ids, b.input_ids)
    assert a.source.startswith(f"builtin {kind}: calib split")
    assert all(_kind_of(tokenizer, row, calib_joined) == kind for row in a.input_ids.tolist())


def _runs(ids: list[int], n: int = 32) -> set[int]:
    """Hashes of every n-token run of ids."""
    return {hash(tuple(ids[i : i + n])) for i in range(len(ids) - n + 1)}


@pytest.fixture(scope="module")
def eval_only_runs(tokenizer) -> set[int]:
    """The 32-token runs of the eval splits that no calib document holds. A few runs are in
    both splits by nature (sentences the Python docs repeat in two sections, code idioms, the
    chat template's system message), so they cannot tell calib text from eval text."""
    runs: set[int] = set()
    for kind in KINDS:
        for ids in tokenizer(texts(kind, "eval"), add_special_tokens=False)["input_ids"]:
            runs |= _runs(ids)
    total = len(runs)
    for kind in KINDS:
        for ids in tokenizer(texts(kind, "calib"), add_special_tokens=False)["input_ids"]:
            runs -= _runs(ids)
    assert len(runs) > 0.97 * total  # the shared runs are few
    for kind in KINDS:  # the check has teeth: a window of eval text is caught
        assert _runs(tokenizer(texts(kind, "eval")[0], add_special_tokens=False)["input_ids"][:128]) & runs
    return runs


@pytest.mark.parametrize("source", ("builtin", *KINDS))
def test_calibration_windows_hold_no_eval_text(tokenizer, eval_only_runs, source):
    data = load_calibration(tokenizer, source, num_samples=48, seq_len=128, seed=0)
    hits = [row for row in data.input_ids.tolist() if _runs(row) & eval_only_runs]
    assert not hits, tokenizer.decode(hits[0])


@pytest.mark.model
def test_default_builtin_size_needs_no_overlap(caplog):
    """128 x 512 SmolLM2 tokens: every kind's calib split holds its share without overlap."""
    from transformers import AutoTokenizer

    from optllm.hub.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    with caplog.at_level(logging.WARNING, logger=calib_data.__name__):
        data = load_calibration(tok, "builtin")
    assert data.input_ids.shape == (128, 512)
    assert not [r for r in caplog.records if "overlap" in r.getMessage()]
    for kind, n in builtin_counts(128).items():  # room to spare, for tokenizers that make fewer tokens
        tokens = sum(len(t) for t in tok(texts(kind, "calib"), add_special_tokens=False)["input_ids"])
        assert tokens > 1.5 * n * 512, (kind, tokens)


def test_hash_is_shape_plus_little_endian_int64_and_tracks_content(tokenizer):
    data = load_calibration(tokenizer, "builtin", num_samples=3, seq_len=16, seed=2)
    ids = data.input_ids
    expect = hashlib.sha256(b"3x16:" + ids.numpy().astype("<i8").tobytes()).hexdigest()
    assert data.sha256 == expect
    changed = ids.clone()
    changed[1, 7] = (changed[1, 7] + 1) % len(tokenizer)
    assert token_hash(changed) != data.sha256
    # same bytes, other shape: a different hash
    assert token_hash(ids.reshape(6, 8)) != data.sha256


def test_txt_windows_come_from_the_stream_without_overlap(tokenizer, tmp_path):
    text = _random_text(0, 600)
    path = tmp_path / "calib.txt"
    path.write_text(text, encoding="utf-8")
    stream = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n, s = 5, 32
    assert n * s < len(stream)
    data = load_calibration(tokenizer, str(path), num_samples=n, seq_len=s, seed=3)
    assert data.input_ids.shape == (n, s)
    starts = []
    for row in data.input_ids.tolist():
        hits = _find(stream, row)
        assert len(hits) == 1  # random words: every window occurs once in the stream
        starts.append(hits[0])
    starts.sort()
    assert all(b - a >= s for a, b in zip(starts, starts[1:]))
    assert "txt" in data.source


def test_overlap_when_corpus_is_short_is_logged(tokenizer, tmp_path, caplog):
    text = _random_text(1, 40)
    path = tmp_path / "short.txt"
    path.write_text(text, encoding="utf-8")
    total = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
    s = 16
    n = total // s + 3  # cannot fit without overlap
    with caplog.at_level(logging.WARNING, logger=calib_data.__name__):
        data = load_calibration(tokenizer, str(path), num_samples=n, seq_len=s, seed=0)
    assert data.input_ids.shape == (n, s)
    assert any("overlap" in r.getMessage() for r in caplog.records)


def test_corpus_shorter_than_seq_len_is_an_error(tokenizer, tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("A few words only.", encoding="utf-8")
    with pytest.raises(ValueError, match="seq_len"):
        load_calibration(tokenizer, str(path), num_samples=1, seq_len=256)


def test_txt_jsonl_parquet_of_one_document_give_the_same_windows(tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = _random_text(2, 300)
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    (tmp_path / "one.jsonl").write_text(json.dumps({"id": 1, "text": text}) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"text": [text], "id": [1]}), tmp_path / "one.parquet")
    got = [
        load_calibration(tokenizer, str(tmp_path / f"one.{ext}"), num_samples=4, seq_len=24, seed=5)
        for ext in ("txt", "jsonl", "parquet")
    ]
    for g in got[1:]:
        assert torch.equal(g.input_ids, got[0].input_ids) and g.sha256 == got[0].sha256
    assert "jsonl" in got[1].source and "parquet" in got[2].source


def test_jsonl_many_documents_are_separated_by_eos(tokenizer, tmp_path):
    docs = [_random_text(10 + i, 30) for i in range(12)]
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    total = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs)
    s = 20
    n = total // s
    data = load_calibration(tokenizer, str(path), num_samples=n, seq_len=s, seed=0)
    # n non-overlapping windows cover all but < s tokens, so nearly every EOS is in one
    eos_count = int((data.input_ids == tokenizer.eos_token_id).sum())
    assert len(docs) - 2 <= eos_count <= len(docs)


def test_missing_text_field_names_the_fields(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"content": "hello there", "meta": 1}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"'text'.*content, meta"):
        load_calibration(tokenizer, str(path), num_samples=1, seq_len=8)


def test_missing_file_and_unknown_source_fail_fast(tokenizer, tmp_path, monkeypatch):
    import datasets

    with pytest.raises(ValueError, match="does not exist"):
        load_calibration(tokenizer, str(tmp_path / "nope.jsonl"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="not a local .*could not be loaded from the Hugging Face hub"):
        load_calibration(tokenizer, "no-such-user/no-such-dataset-xyz")
    # online mode but no route to the hub: the probe answers, not datasets' retries
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(calib_data, "_hub_reachable", lambda: False)
    with pytest.raises(ValueError, match="unreachable"):
        load_calibration(tokenizer, "no-such-dataset-xyz")


def test_argument_checks_name_the_field(tokenizer):
    with pytest.raises(ValueError, match="num_samples"):
        load_calibration(tokenizer, num_samples=0)
    with pytest.raises(ValueError, match="seq_len"):
        load_calibration(tokenizer, seq_len=4)
    with pytest.raises(ValueError, match="model"):
        load_calibration(tokenizer, "self")


def test_self_generation_shape_and_determinism(tokenizer, model):
    before = torch.random.get_rng_state()
    a = load_calibration(tokenizer, "self", num_samples=3, seq_len=16, seed=0, model=model)
    b = load_calibration(tokenizer, "self", num_samples=3, seq_len=16, seed=0, model=model)
    c = load_calibration(tokenizer, "self", num_samples=3, seq_len=16, seed=1, model=model)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is untouched
    assert a.input_ids.shape == (3, 16) and a.input_ids.dtype == torch.int64
    assert torch.equal(a.input_ids, b.input_ids) and a.sha256 == b.sha256
    assert a.sha256 != c.sha256
    assert a.source.startswith("self")


def test_self_uses_the_chat_template_when_there_is_one(tokenizer, model):
    prompt = calib_data.SELF_PROMPTS[0]
    plain = calib_data._encode_prompt(tokenizer, prompt)
    tokenizer.chat_template = "{% for m in messages %}<eos>user: {{ m['content'] }}\n{% endfor %}assistant:"
    try:
        chat = calib_data._encode_prompt(tokenizer, prompt)
        data = load_calibration(tokenizer, "self", num_samples=2, seq_len=16, seed=0, model=model)
    finally:
        tokenizer.chat_template = None
    assert chat[0] == tokenizer.eos_token_id and chat != plain
    assert tokenizer.decode(chat).endswith("assistant:")
    assert data.input_ids.shape == (2, 16)
