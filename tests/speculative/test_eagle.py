"""The EAGLE draft: a causal layer (against transformers' Llama layer), its loss against a hand
computation with prompt tokens masked, learning, and train-draft --method eagle end to end
(output folder, resume to the same losses, bad input as one line)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from optllm.speculative import eagle
from optllm.speculative.eagle import EagleDraft, eagle_accuracy, eagle_inputs, eagle_loss
from optllm.speculative.target import last_hidden, load_target, target_identity
from optllm.speculative.train import DraftConfig, train_draft

SMALL = dict(method="eagle", num_prompts=4, max_steps=4, batch_size=2, grad_accum=2, warmup_steps=1, seq_len=96,
             answer_tokens=12, checkpoint_every=2, eval_every=2, holdout=1, device="cpu", seed=0)


def _draft(hidden=16, vocab=12, heads=4, kv=2, seed=0) -> EagleDraft:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    return EagleDraft(torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g),
                      heads, kv, hidden // heads, 2 * hidden, 1e-6, 10000.0)


def test_layer_is_causal():
    draft = _draft()
    g = torch.Generator().manual_seed(3)
    feats, ids = torch.randn(2, 7, 16, generator=g), torch.randint(0, 12, (2, 7), generator=g)
    with torch.no_grad():
        pred, logits = draft(feats, ids)
        feats2, ids2 = feats.clone(), ids.clone()
        feats2[:, 4:] += 5.0
        ids2[:, 4:] = (ids2[:, 4:] + 1) % 12
        pred2, logits2 = draft(feats2, ids2)
    torch.testing.assert_close(pred2[:, :4], pred[:, :4], rtol=0, atol=1e-6)
    torch.testing.assert_close(logits2[:, :4], logits[:, :4], rtol=0, atol=1e-5)
    assert float((pred2[:, 4:] - pred[:, 4:]).abs().max()) > 1e-2  # later positions do see the change
    assert pred.shape == (2, 7, 16) and logits.shape == (2, 7, 12)


def test_layer_matches_transformers_llama_layer():
    """The draft's decoder layer is a Llama layer with its input norm left out (as in EAGLE):
    same weights, same output as transformers' LlamaDecoderLayer with that norm an identity."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    draft = _draft(hidden=32, heads=4, kv=2)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      rms_norm_eps=1e-6, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    ref = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    missing = ref.load_state_dict(draft.layers[0].state_dict(), strict=False)
    assert set(missing.missing_keys) == {"input_layernorm.weight"} and not missing.unexpected_keys
    ref.input_layernorm = torch.nn.Identity()
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(9)[None].expand(2, 9)
    causal = torch.full((9, 9), float("-inf")).triu(1)[None, None].expand(2, 1, 9, 9)
    with torch.no_grad():
        want = ref(x, attention_mask=causal, position_ids=pos,
                   position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos))
        want = want[0] if isinstance(want, tuple) else want
        got = draft.layers[0](x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def _smooth_l1(d: float) -> float:
    return 0.5 * d * d if abs(d) < 1 else abs(d) - 0.5


def _hand_loss(pred, logits, feats, ids, mask, w_reg=1.0, w_cls=0.1):
    """Loops: draft position t predicts feature t + 1 and token t + 2; counted when mask[t + 2]."""
    regs, ces = [], []
    b_n, t_n = ids.shape
    for b in range(b_n):
        for t in range(t_n - 2):
            if not mask[b, t + 2]:
                continue
            d = (pred[b, t] - feats[b, t + 1]).tolist()
            regs.append(sum(_smooth_l1(x) for x in d) / len(d))
            p = torch.softmax(logits[b, t].double(), -1)[ids[b, t + 2]]
            ces.append(-float(torch.log(p)))
    reg, ce = sum(regs) / len(regs), sum(ces) / len(ces)
    return w_reg * reg + w_cls * ce, reg, ce


def test_loss_matches_hand_computation():
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(2, 7, 4, generator=g) * 2  # some differences past SmoothL1's knee at 1
    pred, logits = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 5, generator=g)
    ids = torch.randint(0, 5, (2, 7), generator=g)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    loss, parts = eagle_loss(pred, logits, feats, ids, mask)
    want, reg, ce = _hand_loss(pred, logits, feats, ids, mask)
    assert abs(float(loss) - want) < 1e-5
    torch.testing.assert_close(parts, torch.tensor([reg, ce], dtype=torch.float32), rtol=0, atol=1e-5)
    hits, count = eagle_accuracy(logits, ids, mask)
    assert count == 5 and hits == sum(int(logits[b, t].argmax() == ids[b, t + 2])
                                      for b in range(2) for t in range(5) if mask[b, t + 2])


def test_prompt_tokens_do_not_count():
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(1, 8, 4, generator=g)
    pred, logits = torch.randn(1, 7, 4, generator=g), torch.randn(1, 7, 6, generator=g)
    ids = torch.randint(0, 6, (1, 8), generator=g)
    mask = torch.zeros(1, 8, dtype=torch.bool)
    mask[0, 5:] = True  # tokens 0..4 are the prompt: positions 0..2 predict them (token t + 2)
    loss, _ = eagle_loss(pred, logits, feats, ids, mask)
    pred2, logits2, ids2, feats2 = pred.clone(), logits.clone(), ids.clone(), feats.clone()
    pred2[0, :3] += 7.0
    logits2[0, :3] = torch.randn(3, 6, generator=g) * 10
    ids2[0, 2:5] = (ids2[0, 2:5] + 1) % 6
    feats2[0, 1:4] -= 3.0  # the features positions 0..2 regress onto
    assert float(eagle_loss(pred2, logits2, feats2, ids2, mask)[0]) == float(loss)
    # an answer position does count, in both terms
    pred3 = pred.clone()
    pred3[0, 4] += 1.0
    assert float(eagle_loss(pred3, logits, feats, ids, mask)[1][0]) != float(eagle_loss(pred, logits, feats, ids,
                                                                                          mask)[1][0])
    ids3 = ids.clone()
    ids3[0, 6] = (ids3[0, 6] + 1) % 6
    assert float(eagle_loss(pred, logits, feats, ids3, mask)[1][1]) != float(eagle_loss(pred, logits, feats, ids,
                                                                                         mask)[1][1])
    # nothing to learn: zero, not NaN
    assert float(eagle_loss(pred, logits, feats, ids, torch.zeros_like(mask))[0]) == 0.0


def _loss_and_grads(draft, fn):
    draft.zero_grad()
    loss, parts = fn()
    loss.backward()
    return loss.detach(), parts.detach(), [p.grad.clone() for p in draft.parameters()]


@pytest.mark.parametrize(("chunk_rows", "soft"), [(None, False), (3, False), (1, False), (None, True), (3, True)])
def test_draft_loss_equals_the_loss_over_all_logits(chunk_rows, soft, monkeypatch):
    """eagle_draft_loss (the LM head read at the counted positions only, a chunk of rows at a time,
    its gradient made with the logits) gives eagle_loss over the draft's logits at every position:
    the same loss, parts and gradients; also with soft labels (the paper's: the target's
    distribution softmax(LM_head(f_{t+1})) instead of x_{t+2})."""
    draft = _draft(vocab=12, seed=2)
    if chunk_rows is not None:
        monkeypatch.setattr(eagle, "CE_CHUNK_ELEMENTS", chunk_rows * 12)
    g = torch.Generator().manual_seed(8)
    feats, ids = torch.randn(3, 11, 16, generator=g), torch.randint(0, 12, (3, 11), generator=g)
    mask = torch.zeros(3, 11, dtype=torch.bool)
    mask[0, 4:], mask[1, 2:9], mask[2, 10] = True, True, True
    head = draft.lm_head if soft else None
    want = _loss_and_grads(draft, lambda: eagle_loss(*draft(*eagle_inputs(feats, ids)), feats, ids, mask,
                                                     lm_head=head))
    got = _loss_and_grads(draft, lambda: eagle.eagle_draft_loss(draft, feats, ids, mask, soft=soft))
    if soft:  # (not the hard labels' numbers)
        hard = eagle.eagle_draft_loss(draft, feats, ids, mask)[1][1].detach()
        assert not torch.isclose(hard, got[1][1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert float(eagle.eagle_draft_loss(draft, feats, ids, torch.zeros_like(mask))[0].detach()) == 0.0


def test_linear_cross_entropy_gradients_as_autograd():
    """Both gradients (hidden's and a trainable weight's) and per-row weights, against autograd
    through F.cross_entropy, with chunks of two rows."""
    g = torch.Generator().manual_seed(9)
    h = torch.randn(7, 5, generator=g, requires_grad=True)
    w = torch.randn(11, 5, generator=g, requires_grad=True)
    y, scale = torch.randint(0, 11, (7,), generator=g), torch.rand(7, generator=g)
    want = (torch.nn.functional.cross_entropy(h @ w.T, y, reduction="none") * scale).sum()
    eagle.CE_CHUNK_ELEMENTS, old = 2 * 11, eagle.CE_CHUNK_ELEMENTS
    try:
        got = eagle.linear_cross_entropy(h, w, y, scale)
    finally:
        eagle.CE_CHUNK_ELEMENTS = old
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(3 * got, (h, w), retain_graph=True), torch.autograd.grad(3 * want, (h, w))):
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="backward runs once"):  # its gradients were scaled in place
        torch.autograd.grad(got, (h, w))


def test_training_lowers_the_loss_on_a_fixed_batch():
    draft = _draft(seed=4)
    g = torch.Generator().manual_seed(6)
    feats, ids = torch.randn(4, 10, 16, generator=g), torch.randint(0, 12, (4, 10), generator=g)
    mask = torch.ones(4, 10, dtype=torch.bool)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    embed, head = draft.embed_tokens.clone(), draft.lm_head.clone()

    def loss():
        return eagle_loss(*draft(*eagle_inputs(feats, ids)), feats, ids, mask)[0]

    first = float(loss().detach())
    for _ in range(40):
        opt.zero_grad()
        loss().backward()
        opt.step()
    with torch.no_grad():
        assert float(loss()) < 0.5 * first
    assert torch.equal(embed, draft.embed_tokens) and torch.equal(head, draft.lm_head)  # frozen: the target's


def test_draft_reads_the_target(tiny_llama):
    target, _ = load_target(str(tiny_llama))
    draft = EagleDraft.from_target(target)
    c = target.config
    assert (draft.hidden_size, draft.vocab_size, draft.num_attention_heads, draft.num_key_value_heads,
            draft.intermediate_size) == (c.hidden_size, c.vocab_size, c.num_attention_heads, c.num_key_value_heads,
                                         c.intermediate_size)
    ids = torch.randint(0, c.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # logits are the target's LM head on the draft's feature, the same readout as the target's own
        feats = last_hidden(target, ids)
        torch.testing.assert_close(feats @ draft.lm_head.T, target(input_ids=ids).logits, rtol=0, atol=1e-5)
    assert sorted(draft.state_dict()) == sorted(
        ["fc.weight", "layers.0.post_attention_layernorm.weight"]
        + [f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
        + [f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")])


# --------------------------------------------------------------------------- train-draft --method eagle


def _cli(*args):
    from typer.testing import CliRunner

    from optllm.cli.app import app

    return CliRunner().invoke(app, ["train-draft", *args])


@pytest.fixture(scope="module")
def straight(tiny_chat, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle") / "straight"
    logs: list[str] = []
    return train_draft(DraftConfig(target=str(tiny_chat), out=out, **SMALL), log=logs.append), out, logs


def test_output_folder(straight, tiny_chat):
    result, out, logs = straight
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "config.json", "dataset.jsonl",
                                                     "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["method"], cfg["num_layers"], cfg["hidden_size"], cfg["vocab_size"]) == ("eagle", 1, 64, 320)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert "num_heads" not in cfg and cfg["target"]["sha256"] == target_identity(tiny_chat)
    w = load_file(out / "model.safetensors")
    assert w["fc.weight"].shape == (64, 128) and "layers.0.self_attn.q_proj.weight" in w
    assert not any("embed" in k or "lm_head" in k for k in w)
    assert [s for s, _ in result.losses] == [1, 2, 3, 4] and len(result.accuracy) == 1
    assert 0.0 <= result.accuracy[0] <= 1.0
    assert any("held-out top-1 h0" in line for line in logs)


def test_resume_continues_to_the_same_losses(straight, tiny_chat, tmp_path):
    result, a_out, _ = straight
    out = tmp_path / "resumed"
    resumed = train_draft(DraftConfig(target=str(tiny_chat), out=out, resume=a_out / "checkpoint-2", **SMALL),
                          log=lambda _: None)
    assert [s for s, _ in resumed.losses] == [3, 4]
    for (_, want), (_, got) in zip(result.losses[2:], resumed.losses):
        assert abs(want - got) < 1e-6
    a, b = load_file(a_out / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)
    assert json.loads((out / "config.json").read_text())["method"] == "eagle"


def test_cli_method_eagle_end_to_end(straight, tiny_chat, tmp_path):
    """Through the CLI, continuing the API run's data (its generation is method-independent and
    timed by the Medusa tests): the command trains an EAGLE draft and writes the folder."""
    _, a_out, _ = straight
    out = tmp_path / "cli"
    r = _cli(str(tiny_chat), "--method", "eagle", "--out", str(out), "--device", "cpu", "--max-steps", "4",
             "--batch-size", "2", "--grad-accum", "2", "--seq-len", "96", "--checkpoint-every", "2",
             "--eval-every", "2", "--resume", str(a_out / "checkpoint-2"), "--export", "vllm")
    assert r.exit_code == 0, (r.output, r.exception)
    assert "resumed from" in r.output and "trained 4 steps" in r.output and "held-out top-1 h0" in r.output
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "config.json", "dataset.jsonl",
                                                     "model.safetensors", "vllm"]
    assert sorted(p.name for p in (out / "vllm").iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["method"], cfg["training"]["method"], cfg["training"]["steps"]) == ("eagle", "eagle", 4)
    assert cfg["target"]["sha256"] == target_identity(tiny_chat)
    a, b = load_file(a_out / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)


def test_bad_method_is_one_line(tiny_chat, tmp_path):
    r = _cli(str(tiny_chat), "--method", "eagle4", "--out", str(tmp_path / "o"))
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert lines == ["error: unknown method 'eagle4'; allowed: medusa, eagle, eagle3"], r.stderr
    assert not (tmp_path / "o").exists()


def test_export_needs_an_eagle_draft(tiny_chat, tmp_path):
    for args, msg in ((("--method", "medusa", "--export", "vllm"), "--method medusa has no such layout"),
                      (("--method", "eagle", "--export", "sglang"), "--export 'sglang' is not allowed")):
        r = _cli(str(tiny_chat), *args, "--out", str(tmp_path / "o"))
        lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and msg in lines[0], r.stderr
        assert not (tmp_path / "o").exists()


def test_trained_draft_serves_with_the_same_greedy_output(straight, tiny_chat):
    """What train-draft writes loads in the runtime as a draft, and changes no token."""
    from optllm import LLM, SamplingParams

    _, out, _ = straight
    prompts = ["The interpreter reads", "def main():"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = LLM(str(tiny_chat), device="cpu", dtype="float32").generate(prompts, params)
    spec = LLM(str(tiny_chat), device="cpu", dtype="float32", draft=str(out), spec_top_k=3, spec_depth=3,
               spec_num_draft=8)
    got = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert spec.engine.stats().speculation["seq_steps"] > 0

