"""Tensor-parallel context: which shard of each weight this process holds.

World size 1 today; the linears and the embedding already shard their weights by it, so
tensor parallelism over torch.distributed slots in without touching the models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelContext:
    """rank / world_size of the tensor-parallel group; group: its torch.distributed group."""

    rank: int = 0
    world_size: int = 1
    group: object = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank}, world_size={self.world_size}: allowed 0 <= rank < world_size")

    def split(self, size: int, what: str) -> int:
        """This rank's share of a dimension of ``size`` (it must divide evenly)."""
        if size % self.world_size:
            raise ValueError(f"{what}={size} does not divide over {self.world_size} tensor-parallel ranks")
        return size // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = ParallelContext()
