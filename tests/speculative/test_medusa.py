"""Medusa heads: zero-initialised residual (heads start as the target's LM head), the
shifted, masked, decaying-weight loss against a hand computation, and learning."""

from __future__ import annotations

import math

import torch

from optllm.speculative.medusa import MedusaHeads, head_accuracy, loss_weights, medusa_loss
from optllm.speculative.target import last_hidden, lm_head_weight, load_target


def test_heads_start_as_the_target_lm_head(tiny_llama):
    target, _ = load_target(str(tiny_llama))
    w = lm_head_weight(target)
    heads = MedusaHeads(3, w.shape[1], w.shape[0], w.detach())
    ids = torch.randint(0, w.shape[0], (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = target(input_ids=ids).logits
        got = heads(last_hidden(target, ids))
    assert got.shape == (3, 2, 11, w.shape[0])
    for k in range(3):
        torch.testing.assert_close(got[k], expected, rtol=0, atol=1e-5)
    # the residual is what trains: it is exactly zero at first, not merely small
    assert all(float(h[0].linear.weight.detach().abs().max()) == 0.0 for h in heads.medusa_head)


def test_loss_weights_decay():
    assert loss_weights(4) == [1.0, 0.8, 0.8**2, 0.8**3]


def _hand_loss(logits, ids, mask, decay=0.8):
    """Loops over heads and positions: head k at t predicts ids[t + k + 2]."""
    k_heads, _, t_len, _ = logits.shape
    total, per = 0.0, []
    for k in range(k_heads):
        terms = []
        for b in range(ids.shape[0]):
            for t in range(t_len):
                j = t + k + 2
                if j < t_len and mask[b, j]:
                    p = torch.softmax(logits[k, b, t].double(), -1)[ids[b, j]]
                    terms.append(-math.log(float(p)))
        per.append(sum(terms) / len(terms) if terms else 0.0)
        total += decay**k * per[-1]
    return total, per


def test_loss_matches_hand_computation():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2, 7, 5, generator=g)
    ids = torch.randint(0, 5, (2, 7), generator=g)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    loss, per_head = medusa_loss(logits, ids, mask)
    want, want_per = _hand_loss(logits, ids, mask)
    assert abs(float(loss) - want) < 1e-5
    torch.testing.assert_close(per_head, torch.tensor(want_per, dtype=torch.float32), rtol=0, atol=1e-5)


def test_prompt_tokens_do_not_count():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 1, 8, 6, generator=g)
    ids = torch.randint(0, 6, (1, 8), generator=g)
    mask = torch.zeros(1, 8, dtype=torch.bool)
    mask[0, 5:] = True  # tokens 0..4 are the prompt
    loss, _ = medusa_loss(logits, ids, mask)
    # change every prompt token's label and every logit row whose target is a prompt token
    ids2, logits2 = ids.clone(), logits.clone()
    ids2[0, :5] = (ids2[0, :5] + 1) % 6
    for k in range(2):
        logits2[k, 0, : 5 - (k + 2)] = torch.randn(max(0, 5 - (k + 2)), 6, generator=g) * 10
    loss2, _ = medusa_loss(logits2, ids2, mask)
    assert float(loss) == float(loss2)
    # and an answer token does count
    ids3 = ids.clone()
    ids3[0, 6] = (ids3[0, 6] + 1) % 6
    assert float(medusa_loss(logits, ids3, mask)[0]) != float(loss)
    # nothing to learn: zero, not NaN
    assert float(medusa_loss(logits, ids, torch.zeros_like(mask))[0]) == 0.0


def test_head_accuracy_counts_shifted_targets():
    ids = torch.tensor([[1, 2, 3, 4, 0]])
    logits = torch.full((2, 1, 5, 5), -1.0)
    for t in range(5):  # head 0 right everywhere, head 1 always predicts token 0
        if t + 2 < 5:
            logits[0, 0, t, ids[0, t + 2]] = 1.0
        logits[1, 0, t, 0] = 1.0
    mask = torch.tensor([[False, False, True, True, True]])
    hits, counts = head_accuracy(logits, ids, mask)
    assert counts == [3, 2] and hits == [3, 1]  # head 1: targets ids[3:]=[4, 0] -> one hit


def test_training_lowers_the_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    hidden_size, vocab = 16, 12
    lm = torch.randn(vocab, hidden_size)
    heads = MedusaHeads(2, hidden_size, vocab, lm)
    hidden = torch.randn(4, 10, hidden_size)
    ids = torch.randint(0, vocab, (4, 10))
    mask = torch.ones(4, 10, dtype=torch.bool)
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss, _ = medusa_loss(heads(hidden), ids, mask)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert float(medusa_loss(heads(hidden), ids, mask)[0]) < 0.5 * first
