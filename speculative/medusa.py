"""Medusa heads and their loss (Cai et al., 2024).

Head k (0-based) reads the target's last hidden state at position t and predicts the token
at t + k + 2 (the target's own LM head predicts t + 1). Each head is a residual block
h + SiLU(W h + b) with W, b zero-initialised, followed by an LM head initialised from the
target's: at initialisation every head's logits are exactly the target's.

Parameter names follow the Medusa reference checkpoints: ``medusa_head.{k}.0.linear.{weight,bias}``
(the residual block) and ``medusa_head.{k}.1.weight`` (the LM head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LOSS_DECAY = 0.8  # head k's loss weight is LOSS_DECAY ** k, as in Medusa


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """num_heads heads over hidden states [..., hidden_size] -> logits [num_heads, ..., vocab_size]."""

    def __init__(self, num_heads: int, hidden_size: int, vocab_size: int, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads={num_heads!r} is not allowed; allowed: an integer >= 1")
        self.num_heads, self.hidden_size, self.vocab_size = num_heads, hidden_size, vocab_size
        self.medusa_head = nn.ModuleList(
            nn.Sequential(ResBlock(hidden_size), nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads)
        )
        if lm_head_weight is not None:
            if tuple(lm_head_weight.shape) != (vocab_size, hidden_size):
                raise ValueError(f"lm_head_weight has shape {tuple(lm_head_weight.shape)}; "
                                 f"allowed: ({vocab_size}, {hidden_size})")
            with torch.no_grad():
                for head in self.medusa_head:
                    head[1].weight.copy_(lm_head_weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(hidden) for head in self.medusa_head])


def loss_weights(num_heads: int, decay: float = LOSS_DECAY) -> list[float]:
    return [decay**k for k in range(num_heads)]


def medusa_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                decay: float = LOSS_DECAY) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted Medusa loss.

    logits [K, B, T, V] (head k at position t predicts input_ids[:, t + k + 2]); input_ids
    [B, T]; loss_mask [B, T] bool, True on the tokens to learn (answer tokens, not padding).
    Returns (sum_k decay**k * CE_k, per-head CE [K]), each CE_k the mean over the positions
    whose target token is in the mask (0 where a head has none).
    """
    num_heads = logits.shape[0]
    per_head = []
    for k in range(num_heads):
        shift = k + 2
        if input_ids.shape[1] <= shift:
            per_head.append(logits.new_zeros(()).float())
            continue
        lg = logits[k, :, :-shift].float()
        labels = input_ids[:, shift:]
        mask = loss_mask[:, shift:]
        ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels.reshape(-1), reduction="none")
        n = mask.sum()
        per_head.append((ce * mask.reshape(-1)).sum() / n.clamp(min=1))
    per_head_t = torch.stack(per_head)
    w = torch.tensor(loss_weights(num_heads, decay), dtype=per_head_t.dtype, device=per_head_t.device)
    return (w * per_head_t).sum(), per_head_t


@torch.no_grad()
def head_accuracy(logits: torch.Tensor, input_ids: torch.Tensor,
                  loss_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per head, (top-1 hits, counted positions) over the masked target tokens: the
    acceptance proxy (shapes as in medusa_loss)."""
    hits, counts = [], []
    for k in range(logits.shape[0]):
        shift = k + 2
        if input_ids.shape[1] <= shift:
            hits.append(0)
            counts.append(0)
            continue
        pred = logits[k, :, :-shift].argmax(-1)
        mask = loss_mask[:, shift:]
        hits.append(int(((pred == input_ids[:, shift:]) & mask).sum()))
        counts.append(int(mask.sum()))
    return hits, counts
