"""The draft methods train-draft knows, each as the four things its training loop needs:
build the draft for a target, its loss and its held-out top-1 hits on the target's features,
and the sizes its config.json records. Adding a method is adding an entry to DRAFT_METHODS."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .eagle import EagleDraft, eagle_accuracy, eagle_inputs, eagle_loss
from .medusa import MedusaHeads, head_accuracy, medusa_loss
from .target import lm_head_weight


@dataclass(frozen=True)
class Medusa:
    name: str = "medusa"

    def build(self, target, num_heads: int) -> nn.Module:
        w = lm_head_weight(target)
        return MedusaHeads(num_heads, w.shape[1], w.shape[0], w.detach().float().cpu())

    def loss(self, draft: nn.Module, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] the target's last hidden states (fp32); ids, mask [B, T]."""
        return medusa_loss(draft(hidden), ids, mask)[0]

    def accuracy(self, draft: nn.Module, hidden: torch.Tensor, ids: torch.Tensor,
                 mask: torch.Tensor) -> tuple[list[int], list[int]]:
        """Per head (hits, counts): head k predicts the token k + 2 ahead."""
        return head_accuracy(draft(hidden), ids, mask)

    def config(self, draft: MedusaHeads) -> dict:
        return {"num_heads": draft.num_heads, "num_layers": 1, "hidden_size": draft.hidden_size,
                "vocab_size": draft.vocab_size}


@dataclass(frozen=True)
class Eagle:
    name: str = "eagle"

    def build(self, target, num_heads: int) -> nn.Module:
        return EagleDraft.from_target(target)

    def loss(self, draft: nn.Module, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pred, logits = draft(*eagle_inputs(hidden, ids))
        return eagle_loss(pred, logits, hidden, ids, mask)[0]

    def accuracy(self, draft: nn.Module, hidden: torch.Tensor, ids: torch.Tensor,
                 mask: torch.Tensor) -> tuple[list[int], list[int]]:
        """One entry: depth 1, the draft's prediction of the token 2 ahead given the true next one."""
        _, logits = draft(*eagle_inputs(hidden, ids))
        hits, counts = eagle_accuracy(logits, ids, mask)
        return [hits], [counts]

    def config(self, draft: EagleDraft) -> dict:
        return {"num_layers": len(draft.layers), **draft.sizes()}


DRAFT_METHODS = {m.name: m for m in (Medusa(), Eagle())}
