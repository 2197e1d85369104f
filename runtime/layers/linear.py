"""Column- and row-parallel linear layers whose weights carry their own loaders.

A linear holds this rank's shard of y = x W^T + b (W is [N, K]): column-parallel layers
split N over the tensor-parallel ranks (QKV and gate/up are column-parallel layers made of
named shards, concatenated along N), row-parallel layers split K and all-reduce their
output. How W is stored and applied (dense, int4 packed, ...) is the layer's LinearMethod
(layers/linear_methods.py), chosen from the checkpoint's scheme.

Loading: the checkpoint loader calls ``layer.weight_loader(name, tensor, shard_id)`` with
the *full* tensor of one HF module (e.g. q_proj's weight); the layer cuts this rank's slice
and copies it into the right rows of its parameter. Each parameter says which of its dims
is N (``out_dim``) and which is K (``in_dim``; group scales have one column per group, so
a row-parallel rank takes its groups' columns).
"""

from __future__ import annotations

import torch
from torch import nn

from .parallel import SINGLE, ParallelContext


class LinearBase(nn.Module):
    """parallel: "column" (split N), "row" (split K, all-reduce), "replicated"."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, method, parallel: str = "column",
                 shard_ids: list | None = None, ctx: ParallelContext = SINGLE, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if parallel not in ("column", "row", "replicated"):
            raise ValueError(f"parallel={parallel!r}; allowed: column, row, replicated")
        self.parallel, self.ctx, self.method = parallel, ctx, method
        self.dtype = dtype
        self.full_output_sizes = list(output_sizes)
        self.input_size = input_size
        split_n = parallel == "column"
        self.output_sizes = [ctx.split(n, "output size") if split_n else n for n in output_sizes]
        self.in_features = ctx.split(input_size, "input size") if parallel == "row" else input_size
        self.out_features = sum(self.output_sizes)
        self.shard_ids = shard_ids if shard_ids is not None else [None]
        if len(self.shard_ids) != len(self.output_sizes):
            raise ValueError(f"{len(self.shard_ids)} shard ids for {len(self.output_sizes)} output shards")
        self.loaded: set[tuple[str, object]] = set()
        method.create_weights(self, device)
        if bias:
            b = torch.empty(self.out_features, dtype=dtype, device=device)
            # a row-parallel bias is added once, after the all-reduce: every rank holds all of it
            self.register_param("bias", b, out_dim=None if parallel == "row" else 0, in_dim=None)
        else:
            self.bias = None

    # ---- weights
    def register_param(self, name: str, tensor: torch.Tensor, out_dim: int | None, in_dim: int | None) -> None:
        p = nn.Parameter(tensor, requires_grad=False)
        p.out_dim, p.in_dim = out_dim, in_dim
        self.register_parameter(name, p)

    def expected_loads(self) -> set[tuple[str, object]]:
        return {(name, sid) for name, _ in self.named_parameters(recurse=False) for sid in self.shard_ids}

    def weight_loader(self, name: str, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's part of ``loaded`` (one HF module's full tensor) into ``name``."""
        param = getattr(self, name, None)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"{type(self).__name__} has no weight {name!r} (a checkpoint of another scheme?)")
        if shard_id not in self.shard_ids:
            raise ValueError(f"shard {shard_id!r} unknown; allowed: {self.shard_ids}")
        i = self.shard_ids.index(shard_id)
        offset, size = sum(self.output_sizes[:i]), self.output_sizes[i]
        split = self.ctx.world_size > 1
        if split and param.out_dim is not None and self.parallel == "column":
            loaded = _narrow(loaded, param.out_dim, self.ctx.rank * size, size, name)
        if split and param.in_dim is not None and self.parallel == "row":
            n = param.shape[param.in_dim]
            loaded = _narrow(loaded, param.in_dim, self.ctx.rank * n, n, name)
        dst = param.data if param.out_dim is None else param.data.narrow(param.out_dim, offset, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match {tuple(dst.shape)}")
        dst.copy_(loaded)
        self.loaded.add((name, shard_id))

    def process_weights_after_loading(self) -> None:
        self.method.process_after_loading(self)

    # ---- compute
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel != "row" or self.ctx.world_size == 1:
            return self.method.apply(self, x, self.bias)
        y = self.ctx.all_reduce(self.method.apply(self, x, None))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}, "
                f"{self.parallel}, {self.method.describe(self)}")


def _narrow(t: torch.Tensor, dim: int, start: int, size: int, name: str) -> torch.Tensor:
    if t.shape[dim] < start + size:
        raise ValueError(f"{name}: checkpoint tensor {tuple(t.shape)} too small along dim {dim} for "
                         f"rows [{start}, {start + size})")
    return t.narrow(dim, start, size)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, method, **kw) -> None:
        super().__init__(input_size, [output_size], bias, method, "column", **kw)


class MergedColumnParallelLinear(LinearBase):
    """Several linears of one input, concatenated along N (gate_proj + up_proj); shard ids 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, method, **kw) -> None:
        super().__init__(input_size, output_sizes, bias, method, "column", shard_ids=list(range(len(output_sizes))),
                         **kw)


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one GEMM; shard ids "q", "k", "v"; output [q | k | v] per rank."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, method,
                 ctx: ParallelContext = SINGLE, **kw) -> None:
        self.num_heads = ctx.split(num_heads, "num_attention_heads")
        self.num_kv_heads = ctx.split(num_kv_heads, "num_key_value_heads")
        self.head_dim = head_dim
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, method, "column", shard_ids=["q", "k", "v"], ctx=ctx, **kw)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, method, **kw) -> None:
        super().__init__(input_size, [output_size], bias, method, "row", **kw)
