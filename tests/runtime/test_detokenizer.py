"""Incremental detokenization: the streamed pieces add up to the tokenizer's own decode of the
output (multi-byte characters split across byte-level tokens included), the Rust fast path
gives the text of transformers' batch_decode, tokens that add no text keep the decoded
window short, and a stop string that spans tokens cuts the text."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from optllm.runtime.detokenizer import _CONTEXT_TOKENS, Detokenizer

TEXT = "naïve café — 東京の夜 ✓ 🎉 déjà vu: x = [1, 2]; print(x)\n\tend."


@pytest.fixture(scope="module")
def tok():
    from conftest import tiny_tokenizer

    return tiny_tokenizer(vocab_size=400)


def seq(ids, n_prompt, skip=True, stop=(), include=False):
    params = SimpleNamespace(skip_special_tokens=skip, stop=list(stop), include_stop_str_in_output=include)
    return SimpleNamespace(token_ids=list(ids[:n_prompt]), params=params, n_prompt=n_prompt)


def stream(detok, ids, n_prompt, **kw):
    """Feed ids[n_prompt:] one token a step; returns (pieces, state, stop found, slice lengths)."""
    s = seq(ids, n_prompt, **kw)
    st = detok.start(n_prompt)
    pieces, found = [], None
    for t in ids[n_prompt:]:
        s.token_ids.append(t)
        before = st.text
        (found,) = detok.update([(s, st)])
        pieces.append(st.text[len(before):])
        if found is not None:
            break
    return pieces, st, found


def test_pieces_add_up_to_the_decode_of_the_output(tok):
    prompt = tok.encode("Question: ")
    out = tok.encode(TEXT)
    ids = prompt + out
    # byte-level BPE with a 400-token vocabulary splits the CJK characters and the emoji into
    # several byte tokens: some steps must hold their text back
    assert any(tok.decode([t]).endswith("\ufffd") for t in out)
    for fast in (True, False):
        detok = Detokenizer(tok)
        if not fast:
            detok._backend = None
        else:
            assert detok._backend is not None
        pieces, st, _ = stream(detok, ids, len(prompt))
        assert "".join(pieces) == st.text == tok.decode(out) == TEXT
        assert not any("\ufffd" in p for p in pieces)


def test_tokens_without_text_keep_the_window_short(tok):
    """200 EOS tokens under skip_special_tokens add no text; each step still decodes a few
    tokens only (before the fix the window grew by one token a step)."""
    eos = tok.eos_token_id
    prompt = tok.encode("Hello there")
    ids = prompt + [eos] * 200 + tok.encode(" world")
    detok = Detokenizer(tok)
    lengths = []
    real = detok._decode

    def spy(batch, skip):
        lengths.extend(len(x) for x in batch)
        return real(batch, skip)

    detok._decode = spy
    pieces, st, _ = stream(detok, ids, len(prompt))
    assert st.text == " world" == "".join(pieces)
    assert max(lengths) <= _CONTEXT_TOKENS + 2


def test_stop_string_across_tokens_cuts_the_text(tok):
    prompt = tok.encode("Say: ")
    ids = prompt + tok.encode("alpha beta STOP gamma delta")
    pieces, st, found = stream(Detokenizer(tok), ids, len(prompt), stop=("STOP",))
    assert found == "STOP"
    assert st.text[: st.stop_at] == "alpha beta "
    pieces, st, found = stream(Detokenizer(tok), ids, len(prompt), stop=("STOP",), include=True)
    assert st.text[: st.stop_at] == "alpha beta STOP"
