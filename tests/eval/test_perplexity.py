"""Perplexity against float64 references and limiting models."""

from __future__ import annotations

import math
import types

import pytest
import torch

from optllm.eval.perplexity import PerplexityResult, eval_token_stream, perplexity, text_token_stream
from optllm.hub.corpus import KINDS, eval_text

REL_TOL = 1e-5  # float32 log-softmax vs a float64 reference


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE (vocab 320) trained in-process on the built-in corpus; EOS <eos>."""
    from conftest import tiny_tokenizer

    return tiny_tokenizer(320, eos="<eos>", docs=None)


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a sharper, non-uniform distribution than the default init
        m.lm_head.weight.normal_(0, 0.5)
    return m


class _LogitModel(torch.nn.Module):
    """Logits = fn(input_ids); stands in for a causal LM with a known distribution."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the model a device

    def forward(self, input_ids):
        return types.SimpleNamespace(logits=self.fn(input_ids))


def _ref_nll_f64(model, ids: torch.Tensor, start: int, end: int, first: int) -> tuple[float, int]:
    """Sum of -log p(ids[p] | ids[start:p]) for p in [first, end), in float64."""
    with torch.no_grad():
        logits = model(input_ids=ids[None, start:end]).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(first, end)
    return float(-logp[pos - start - 1, ids[pos]].sum()), len(pos)


def test_non_overlapping_matches_float64_reference(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 300, (5 * 48 + 17,))  # 5 full windows and a tail that is not used
    res = perplexity(model, ids, seq_len=48, batch_size=2)  # batches of 2, 2, 1
    nll, n = 0.0, 0
    for w in range(5):
        s, c = _ref_nll_f64(model, ids, w * 48, (w + 1) * 48, w * 48 + 1)
        nll, n = nll + s, n + c
    assert isinstance(res, PerplexityResult)
    assert (res.num_windows, res.num_tokens, res.seq_len, res.stride) == (5, 5 * 47, 48, 48)
    assert abs(res.nll_mean - nll / n) / (nll / n) < REL_TOL
    assert abs(res.ppl - math.exp(nll / n)) / math.exp(nll / n) < REL_TOL
    assert res.ppl > 1.5  # the model is far from perfect: the comparison is not trivial


def test_sliding_window_matches_hf_style_reference(model):
    torch.manual_seed(2)
    seq_len, stride = 40, 16
    ids = torch.randint(0, 300, (150,))
    res = perplexity(model, ids, seq_len=seq_len, stride=stride, batch_size=3)
    # Reference: the usual loop, each window scoring the tokens past the previous window's end.
    nll, n, prev_end, windows = 0.0, 0, 0, 0
    for begin in range(0, ids.numel() - seq_len + 1, stride):
        end = begin + seq_len
        s, c = _ref_nll_f64(model, ids, begin, end, max(prev_end, begin + 1))
        nll, n, prev_end, windows = nll + s, n + c, end, windows + 1
    assert (res.num_windows, res.num_tokens) == (windows, n)
    assert n == prev_end - 1  # every token after the first, to the last window's end, once
    assert abs(res.nll_mean - nll / n) / (nll / n) < REL_TOL


def test_max_windows_uses_the_first_windows(model):
    torch.manual_seed(3)
    ids = torch.randint(0, 300, (200,))
    res = perplexity(model, ids, seq_len=32, max_windows=2)
    ref = perplexity(model, ids[:64], seq_len=32)
    assert res.num_windows == 2 and res.num_tokens == ref.num_tokens == 62
    assert res.nll_mean == ref.nll_mean


def test_oracle_model_has_perplexity_one():
    vocab = 97
    nxt = lambda x: (7 * x + 3) % vocab  # noqa: E731  the stream's deterministic successor
    ids = [5]
    for _ in range(299):
        ids.append(nxt(ids[-1]))
    oracle = _LogitModel(lambda x: 60.0 * torch.nn.functional.one_hot(nxt(x), vocab).float())
    res = perplexity(oracle, torch.tensor(ids), seq_len=64, stride=32)
    assert abs(res.ppl - 1.0) < 1e-6


def test_uniform_model_has_perplexity_vocab():
    vocab = 500
    torch.manual_seed(4)
    ids = torch.randint(0, vocab, (333,))
    uniform = _LogitModel(lambda x: torch.full((*x.shape, vocab), 3.25))
    res = perplexity(uniform, ids, seq_len=50, batch_size=4)
    assert abs(res.ppl - vocab) / vocab < 1e-6
    assert abs(res.nll_mean - math.log(vocab)) / math.log(vocab) < 1e-6


def test_bfloat16_logits_are_scored_in_float32(model):
    torch.manual_seed(5)
    ids = torch.randint(0, 300, (96,))

    def bf16_logits(x):
        with torch.no_grad():
            return model(input_ids=x).logits.to(torch.bfloat16)

    res = perplexity(_LogitModel(bf16_logits), ids, seq_len=48)
    ref = perplexity(_LogitModel(lambda x: bf16_logits(x).double()), ids, seq_len=48)
    assert abs(res.nll_mean - ref.nll_mean) / ref.nll_mean < REL_TOL


def test_argument_checks(model):
    ids = torch.randint(0, 300, (64,))
    with pytest.raises(ValueError, match="stride"):
        perplexity(model, ids, seq_len=32, stride=33)
    with pytest.raises(ValueError, match="seq_len"):
        perplexity(model, ids, seq_len=1)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        perplexity(model, ids, seq_len=65)
    with pytest.raises(ValueError, match="batch_size"):
        perplexity(model, ids, seq_len=32, batch_size=0)
    with pytest.raises(ValueError, match="1-D"):
        perplexity(model, ids[None], seq_len=32)


@pytest.mark.parametrize("kind", KINDS)
def test_eval_token_stream_is_the_kinds_eval_text_without_special_tokens(tokenizer, kind):
    a = eval_token_stream(tokenizer, kind)
    b = eval_token_stream(tokenizer, kind)
    assert a.dtype == torch.int64 and a.dim() == 1 and a.numel() > 1000
    assert torch.equal(a, b)
    assert int((a == tokenizer.eos_token_id).sum()) == 0
    assert tokenizer.decode(a.tolist()) == eval_text(kind)  # byte-level BPE is lossless
    if kind == "docs":
        assert torch.equal(eval_token_stream(tokenizer), a)  # the default kind: the corpus before kinds


def test_text_token_stream(tokenizer, tmp_path):
    text = "The quick brown fox jumps over the lazy dog.\n\nA second paragraph follows."
    for name in ("doc.txt", "notes.md"):
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        ids = text_token_stream(tokenizer, path)
        assert ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="does not exist"):
        text_token_stream(tokenizer, tmp_path / "missing.txt")
    (tmp_path / "blank.txt").write_text(" \n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="is empty"):
        text_token_stream(tokenizer, tmp_path / "blank.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        text_token_stream(tokenizer, tmp_path / "latin1.txt")


@pytest.mark.parametrize("stride", (None, 24))
def test_runtime_perplexity_equals_the_hf_model(tiny_models, stride):
    """eval --ppl runs on the serving runtime (prompt log-probs); on the same windows it gives
    the HF model's perplexity (float32 on both sides: within 1e-5 relative)."""
    from transformers import AutoModelForCausalLM

    from optllm import LLM

    folder = tiny_models["qwen2"]
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = perplexity(hf, ids, seq_len=64, stride=stride)
    ours = perplexity(LLM(folder, device="cpu", max_model_len=64), ids, seq_len=64, stride=stride)
    assert (ours.num_tokens, ours.num_windows) == (ref.num_tokens, ref.num_windows)
    assert abs(ours.ppl / ref.ppl - 1) < 1e-5
