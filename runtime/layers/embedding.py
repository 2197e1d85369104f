"""Vocabulary-parallel token embedding and LM head.

Each tensor-parallel rank holds a contiguous slice of the vocabulary rows (the vocabulary
padded to a multiple of the world size); the embedding zeroes the ids outside its slice and
all-reduces, the LM head all-gathers its logits. World size 1 holds everything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear import ColumnParallelLinear
from .linear_methods import DenseMethod
from .parallel import SINGLE, ParallelContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ParallelContext = SINGLE,
                 dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        self.ctx, self.num_embeddings = ctx, num_embeddings
        padded = -(-num_embeddings // ctx.world_size) * ctx.world_size
        self.shard = padded // ctx.world_size
        self.start = ctx.rank * self.shard
        w = torch.empty(self.shard, embedding_dim, dtype=dtype, device=device)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.loaded: set = set()

    def expected_loads(self) -> set:
        return {("weight", None)}

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        if name != "weight" or shard_id is not None:
            raise ValueError(f"embedding has one weight; got {name!r} shard {shard_id!r}")
        if loaded.shape[1:] != self.weight.shape[1:] or loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)} does not match "
                             f"[{self.num_embeddings}, {self.weight.shape[1]}]")
        rows = loaded[self.start:self.start + self.shard]
        self.weight.data[: rows.shape[0]].copy_(rows)
        self.weight.data[rows.shape[0]:].zero_()
        self.loaded.add(("weight", None))

    def process_weights_after_loading(self) -> None:
        pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        out = F.embedding(torch.where(inside, local, 0), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.ctx.all_reduce(out)


class ParallelLMHead(ColumnParallelLinear):
    """hidden [n, H] -> logits [n, vocab] (the padded tail of the vocabulary cut off)."""

    def __init__(self, vocab_size: int, hidden_size: int, method=None, ctx: ParallelContext = SINGLE, **kw) -> None:
        padded = -(-vocab_size // ctx.world_size) * ctx.world_size
        super().__init__(hidden_size, padded, False, method or DenseMethod(), ctx=ctx, **kw)
        self.vocab_size = vocab_size

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.full_output_sizes[0]:  # pad the vocabulary rows to the split
            pad = self.full_output_sizes[0] - loaded.shape[0]
            loaded = torch.cat([loaded, loaded.new_zeros(pad, *loaded.shape[1:])])
        super().weight_loader(name, loaded, shard_id)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): nothing of its own to load."""
        self.weight = embedding.weight
        self.loaded.add(("weight", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.method.apply(self, x, None)
        return self.ctx.all_gather(logits, dim=-1)[..., : self.vocab_size]
