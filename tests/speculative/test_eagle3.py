"""EAGLE-3 (speculative/eagle3.py): the training-time test computes what drafting step by step
computes, the loss trains, the reduced vocabulary maps ids both ways, and train-draft writes it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_float32
from safetensors.torch import load_file

from optllm.speculative import eagle, eagle3
from optllm.speculative.eagle3 import Eagle3Draft, default_aux_layers, eagle3_features, eagle3_loss
from optllm.speculative.train import DraftConfig, train_draft


def _draft(hidden=16, vocab=12, heads=4, kv=2, seed=0) -> Eagle3Draft:
    g = torch.Generator().manual_seed(seed)
    d = Eagle3Draft(torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g), heads, kv,
                    hidden // heads, 24, 1e-6, 10000.0, (1, 1, 1))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return d


def _sequential(d: Eagle3Draft, aux, ids, t: int, j: int) -> torch.Tensor:
    """Logits over x_{t+2} of a draft at depth j + 1 whose context ends at t - j, computed one row
    at a time with explicit key lists (rows 0..t-j from the target's features, then the chain)."""
    layer, attn = d.midlayer, d.midlayer.self_attn
    emb = d.embed_tokens
    keys, values = [], []

    def row(hidden, token, pos):
        q, k, v = attn.qkv(layer.inputs(hidden[None, None], emb[token][None, None]), torch.tensor([pos]))
        keys.append(k)
        values.append(v)
        kk, vv = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        p = ((q @ kk.transpose(-1, -2)) * d.head_dim ** -0.5).softmax(-1)
        return layer.finish(hidden[None, None], (p @ vv).transpose(1, 2).reshape(1, 1, -1))[0, 0]

    c = t - j
    out = None
    for p in range(c + 1):
        out = row(d.fc(aux[p]), ids[p + 1], p)
    for depth in range(1, j + 1):
        out = row(out, ids[c + depth + 1], c + depth)
    return d.lm_head(d.norm(out))


@pytest.mark.parametrize("seed", [0, 1])
def test_training_time_test_equals_drafting_step_by_step(seed):
    d = _draft(seed=seed)
    g = torch.Generator().manual_seed(10 + seed)
    t_len, steps = 9, 4
    aux = torch.randn(1, t_len, 3 * d.hidden_size, generator=g)
    ids = torch.randint(0, d.vocab_size, (1, t_len), generator=g)
    with torch.no_grad():
        logits = d.ttt(aux[:, :-1], ids[:, 1:], steps)
        for j in range(steps):
            for t in range(j, t_len - 1):
                want = _sequential(d, aux[0], ids[0], t, j)
                torch.testing.assert_close(logits[j][0, t], want, rtol=1e-5, atol=1e-5)


def test_loss_trains_and_counts_only_positions_with_context():
    d = _draft()
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(2, 10, 3 * d.hidden_size, generator=g)
    ids = torch.randint(0, d.vocab_size, (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.bool)
    d.ttt_steps = 3
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss, per_step = eagle3_loss(d, aux, ids, mask)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert per_step.shape == (3,) and loss.item() < 0.5 * first
    # a position before step j's context contributes nothing: changing its target leaves step j's loss
    mask2 = mask.clone()
    mask2[:, 2] = False  # x_2 is the target of position t = 0, counted only by step 0
    _, a = eagle3_loss(d, aux, ids, mask)
    _, b = eagle3_loss(d, aux, ids, mask2)
    assert not torch.isclose(a[0], b[0]) and torch.allclose(a[1:], b[1:])


def _loss_over_logits(d: Eagle3Draft, aux, ids, mask, steps: int):
    """eagle3_loss written over each step's logits at every position (what it computes)."""
    t = ids.shape[1]
    logits = d.ttt(aux[:, :-1], ids[:, 1:], steps)
    tgt = ids[:, 2:]
    counted = mask[:, 2:] & d.t2d[tgt]
    ces = []
    for j, lg in enumerate(logits):
        m = counted.clone()
        m[:, :j] = False
        ce = torch.nn.functional.cross_entropy(lg[:, : t - 2].reshape(-1, lg.shape[-1]),
                                               eagle3._to_draft_ids(d, tgt).reshape(-1), reduction="none").view_as(tgt)
        ces.append((ce * m).sum() / m.sum().clamp(min=1))
    w = torch.tensor([eagle3.STEP_DECAY ** j for j in range(steps)])
    return (torch.stack(ces) * w).sum() / w.sum(), torch.stack(ces).detach()


def _loss_case(vocab, monkeypatch, seed: int, data_seed: int, width: int):
    """(draft with 3 training-time-test steps, over vocab's ids when given; features [2, 10, width * H];
    ids [2, 10]; an all-true mask), the fused cross-entropy made 4 rows a chunk."""
    d = _draft(seed=seed)
    if vocab is not None:
        d.set_vocab(torch.tensor(vocab))
    d.ttt_steps = 3
    monkeypatch.setattr(eagle, "CE_CHUNK_ELEMENTS", 4 * d.draft_vocab_size)
    g = torch.Generator().manual_seed(data_seed)
    feats = torch.randn(2, 10, width * d.hidden_size, generator=g)
    ids = torch.randint(0, d.vocab_size, (2, 10), generator=g)
    return d, feats, ids, torch.ones(2, 10, dtype=torch.bool)


@pytest.mark.parametrize("vocab", [None, [1, 2, 3, 5, 8]])
def test_loss_equals_the_loss_over_all_logits(vocab, monkeypatch):
    """eagle3_loss reads each step's LM head at the counted positions only (in chunks, its gradients
    made with the logits): the same loss, per-step losses and gradients as over the logits at every
    position, the LM head's (trainable) included, with a reduced vocabulary too."""
    d, aux, ids, mask = _loss_case(vocab, monkeypatch, seed=5, data_seed=4, width=3)
    mask[1, :5] = False
    _same_loss_and_gradients(d, lambda: _loss_over_logits(d, aux, ids, mask, 3),
                             lambda: eagle3_loss(d, aux, ids, mask))


def _same_loss_and_gradients(d: Eagle3Draft, want_fn, got_fn) -> torch.Tensor:
    """want_fn and got_fn (each (loss, per-step losses)) agree in loss, per-step losses and every
    parameter's gradient; returns got_fn's loss."""
    runs = []
    for fn in (want_fn, got_fn):
        d.zero_grad()
        loss, per_step = fn()
        loss.backward()
        runs.append((loss.detach(), per_step, [p.grad.clone() for p in d.parameters()]))
    (want, want_steps, want_grads), (got, got_steps, got_grads) = runs
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_steps, want_steps)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return got


def _soft_loss_over_logits(d: Eagle3Draft, feats, ids, mask, steps: int):
    """eagle3_loss with soft labels, written over every position's logits: step j's mean over the
    counted positions t >= j of the cross-entropy against p_t = softmax(last_{t+1} @ W_kept.T), the
    target's next-token distribution over the draft's vocabulary (W: the target's LM head)."""
    h3 = 3 * d.hidden_size
    aux, last = feats[..., :h3], feats[..., h3:]
    t = ids.shape[1]
    logits = d.ttt(aux[:, :-1], ids[:, 1:], steps)
    tgt = ids[:, 2:]
    counted = mask[:, 2:] & d.t2d[tgt]
    kept = d.d2t + torch.arange(d.draft_vocab_size)
    p = torch.softmax(last[:, 1:-1] @ d._target_lm_head[kept].T, dim=-1)
    ces = []
    for j, lg in enumerate(logits):
        m = counted.clone()
        m[:, :j] = False
        ce = -(p * torch.log_softmax(lg[:, : t - 2], dim=-1)).sum(-1)
        ces.append((ce * m).sum() / m.sum().clamp(min=1))
    w = torch.tensor([eagle3.STEP_DECAY ** j for j in range(steps)])
    return (torch.stack(ces) * w).sum() / w.sum(), torch.stack(ces).detach()


@pytest.mark.parametrize("vocab", [None, [1, 2, 3, 5, 8]])
def test_soft_labels_loss_equals_the_loss_over_all_logits(vocab, monkeypatch):
    """Features with the target's last hidden state ([.., 4H]): each position's label is the target's
    next-token distribution at the following position over the draft's vocabulary (EAGLE's and
    SpecForge's training target), made chunk by chunk beside the draft's logits. The same loss,
    per-step losses and gradients as the soft cross-entropy over every position's logits, with a
    reduced vocabulary too; and not the hard-label loss (a teacher shifted by one position, or the
    data's tokens, would give other numbers)."""
    d, feats, ids, mask = _loss_case(vocab, monkeypatch, seed=6, data_seed=8, width=4)
    mask[0, :4] = False
    got = _same_loss_and_gradients(d, lambda: _soft_loss_over_logits(d, feats, ids, mask, 3),
                                   lambda: eagle3_loss(d, feats, ids, mask))
    hard, _ = eagle3_loss(d, feats[..., :3 * d.hidden_size], ids, mask)
    assert not torch.isclose(hard, got)
    shifted = feats.clone()
    shifted[..., 3 * d.hidden_size:] = feats[..., 3 * d.hidden_size:].roll(1, dims=1)
    assert not torch.isclose(eagle3_loss(d, shifted, ids, mask)[0], got)


def test_soft_cross_entropy_against_a_teacher_equals_torch():
    """linear_cross_entropy with target=(teacher hidden, teacher weight): value and gradients of
    sum_i s_i * CE(softmax(teacher_i), hidden_i @ W.T), over several chunks."""
    g = torch.Generator().manual_seed(1)
    n, h, v, ht = 23, 8, 30, 6
    hid = torch.randn(n, h, generator=g, requires_grad=True)
    w = torch.randn(v, h, generator=g, requires_grad=True)
    th, tw, sc = torch.randn(n, ht, generator=g), torch.randn(v, ht, generator=g), torch.rand(n, generator=g)
    old = eagle.CE_CHUNK_ELEMENTS
    eagle.CE_CHUNK_ELEMENTS = 5 * v
    try:
        got = eagle.linear_cross_entropy(hid, w, None, sc, target=(th, tw))
        got.backward()
    finally:
        eagle.CE_CHUNK_ELEMENTS = old
    gh, gw = hid.grad.clone(), w.grad.clone()
    hid.grad = w.grad = None
    want = (-(torch.softmax(th @ tw.T, -1) * torch.log_softmax(hid @ w.T, -1)).sum(-1) * sc).sum()
    want.backward()
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(gh, hid.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)


def test_reduced_vocabulary_maps_both_ways():
    d = _draft(vocab=12)
    target_head = d._target_lm_head.clone()
    d.set_vocab(torch.tensor([7, 2, 9, 2, 4]))
    assert d.draft_vocab_size == 4
    kept = d.d2t + torch.arange(4)
    assert kept.tolist() == [2, 4, 7, 9]
    assert d.t2d.nonzero().flatten().tolist() == [2, 4, 7, 9]
    assert torch.equal(d.lm_head.weight, target_head[kept])


def test_default_aux_layers():
    assert default_aux_layers(30) == (2, 15, 27)
    assert default_aux_layers(2) == (1, 1, 1)
    assert default_aux_layers(6) == (2, 3, 3)


def test_features_are_the_targets_layer_inputs(tiny_llama):
    target = hf_float32(tiny_llama)
    ids = torch.randint(0, target.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    feats = eagle3_features(target, ids, None, (1, 1, 1))
    # with_last: then the target's last hidden state, the one its LM head reads (its logits)
    both = eagle3_features(target, ids, None, (1, 1, 1), with_last=True)
    h = target.config.hidden_size
    torch.testing.assert_close(both[..., :3 * h], feats)
    with torch.no_grad():
        torch.testing.assert_close(target.lm_head(both[..., 3 * h:]), target(ids).logits, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        x = target.model.embed_tokens(ids)
        pos = torch.arange(7)[None]
        layer0 = target.model.layers[0]
        h1 = layer0(x, position_embeddings=target.model.rotary_emb(x, pos), position_ids=pos,
                    attention_mask=torch.full((7, 7), float("-inf")).triu(1)[None, None])
        h1 = h1[0] if isinstance(h1, tuple) else h1
    torch.testing.assert_close(feats, torch.cat([h1] * 3, dim=-1), rtol=1e-5, atol=1e-5)


def test_train_draft_eagle3_writes_the_draft(tiny_chat, tmp_path):
    out = tmp_path / "e3"
    small = dict(num_prompts=6, max_steps=3, batch_size=2, grad_accum=1, warmup_steps=1, seq_len=96,
                 answer_tokens=12, checkpoint_every=3, eval_every=3, holdout=1, device="cpu", seed=0)
    result = train_draft(DraftConfig(target=str(tiny_chat), out=out, method="eagle3", ttt_steps=2, draft_vocab=64,
                                     **small), log=lambda _: None)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["method"], cfg["draft_vocab_size"], cfg["ttt_steps"], cfg["aux_layers"]) == ("eagle3", 64, 2, [1, 1, 1])
    w = load_file(out / "model.safetensors")
    assert w["fc.weight"].shape == (64, 192) and w["lm_head.weight"].shape == (64, 64)
    assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 128 and w["d2t"].shape == (64,)
    assert w["t2d"].dtype == torch.bool and int(w["t2d"].sum()) == 64
    assert "embed_tokens" not in " ".join(w) and "target_head" not in " ".join(w) and len(result.accuracy) == 2
    assert cfg["labels"] == "soft"  # the default: the target's distribution (the checkpoint records it too)
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["labels"] == "soft"


def test_a_resume_keeps_its_runs_labels(tmp_path):
    """A checkpoint records its run's labels; one from before they were kept trained on hard labels,
    and a resume of it continues so (soft labels would change the loss it continues)."""
    from optllm.speculative.train import _checkpoint_labels

    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "data_position": 4, "holdout": 1}))
    assert _checkpoint_labels(tmp_path) == "hard"
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "holdout": 1, "labels": "soft"}))
    assert _checkpoint_labels(tmp_path) == "soft"
