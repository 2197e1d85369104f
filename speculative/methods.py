"""The draft methods train-draft knows, each as what its training loop needs: build the draft
for a target, the target's features it trains on (the last hidden state; EAGLE-3: three
layers), its loss and its held-out top-1 hits on them, and the sizes its config.json records
(``fit``, when a method has it, adapts the draft to the training data first). Adding a method is
adding an entry to DRAFT_METHODS."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .eagle import EagleDraft, eagle_accuracy, eagle_draft_loss, eagle_inputs
from .eagle3 import Eagle3Draft, eagle3_accuracy, eagle3_features, eagle3_loss
from .medusa import MedusaHeads, head_accuracy, medusa_loss
from .target import last_hidden, lm_head_weight


@dataclass(frozen=True)
class Medusa:
    name: str = "medusa"

    def build(self, target, num_heads: int, cfg=None) -> nn.Module:
        w = lm_head_weight(target)
        return MedusaHeads(num_heads, w.shape[1], w.shape[0], w.detach().float().cpu())

    def features(self, draft: nn.Module, target, ids: torch.Tensor, attn: torch.Tensor | None) -> torch.Tensor:
        return last_hidden(target, ids, attn)

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

    def build(self, target, num_heads: int, cfg=None) -> nn.Module:
        draft = EagleDraft.from_target(target)
        draft.soft_labels = getattr(cfg, "labels", "hard") == "soft"
        return draft

    def features(self, draft: nn.Module, target, ids: torch.Tensor, attn: torch.Tensor | None) -> torch.Tensor:
        return last_hidden(target, ids, attn)

    def loss(self, draft: nn.Module, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return eagle_draft_loss(draft, hidden, ids, mask, soft=getattr(getattr(draft, "module", draft),
                                                                       "soft_labels", False))[0]

    def accuracy(self, draft: nn.Module, hidden: torch.Tensor, ids: torch.Tensor,
                 mask: torch.Tensor) -> tuple[list[int], list[int]]:
        """One entry: depth 1, the draft's prediction of the token 2 ahead given the true next one."""
        _, logits = draft(*eagle_inputs(hidden, ids))
        hits, counts = eagle_accuracy(logits, ids, mask)
        return [hits], [counts]

    def config(self, draft: EagleDraft) -> dict:
        return {"num_layers": len(draft.layers), **draft.sizes(),
                "labels": "soft" if getattr(draft, "soft_labels", False) else "hard"}


@dataclass(frozen=True)
class Eagle3:
    name: str = "eagle3"

    def build(self, target, num_heads: int, cfg=None) -> nn.Module:
        draft = Eagle3Draft.from_target(target)
        draft.ttt_steps = getattr(cfg, "ttt_steps", 3)
        draft.soft_labels = getattr(cfg, "labels", "hard") == "soft"
        draft.wanted_vocab = getattr(cfg, "draft_vocab", None)
        return draft

    def fit(self, draft: Eagle3Draft, seqs) -> None:
        """A reduced vocabulary (``draft_vocab`` ids): the answer tokens the training data uses most
        (ties: lower id first), every id the data uses when fewer."""
        want = getattr(draft, "wanted_vocab", None)
        if not want or want >= draft.vocab_size:
            return
        counts = torch.zeros(draft.vocab_size, dtype=torch.int64)
        for s in seqs:
            ids = torch.tensor(s.token_ids[s.num_prompt_tokens:], dtype=torch.int64)
            counts += torch.bincount(ids, minlength=draft.vocab_size)
        order = torch.sort(-counts, stable=True).indices
        draft.set_vocab(order[:want])

    def features(self, draft: nn.Module, target, ids: torch.Tensor, attn: torch.Tensor | None) -> torch.Tensor:
        base = getattr(draft, "module", draft)
        return eagle3_features(target, ids, attn, base.aux_layers, with_last=base.soft_labels)

    def loss(self, draft: nn.Module, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return eagle3_loss(draft, hidden, ids, mask)[0]

    def accuracy(self, draft: nn.Module, hidden: torch.Tensor, ids: torch.Tensor,
                 mask: torch.Tensor) -> tuple[list[int], list[int]]:
        """Per training-time-test step: its top-1 hits on the token it drafts (depth 1, 2, ...)."""
        return eagle3_accuracy(draft, hidden, ids, mask)

    def config(self, draft: Eagle3Draft) -> dict:
        return {"num_layers": 1, **draft.sizes(), "ttt_steps": draft.ttt_steps,
                "labels": "soft" if draft.soft_labels else "hard"}


DRAFT_METHODS = {m.name: m for m in (Medusa(), Eagle(), Eagle3())}
