"""The Llama family (Llama, Mistral, Qwen2, Qwen3) on the runtime's layers.

One implementation; the architectures differ only in what ArchSpec says: biases on the
QKV / output / MLP projections, Qwen3's per-head RMSNorm of q and k before the rotary, and
sliding-window layers (Mistral, Qwen2/3 with use_sliding_window). The HF module names (blocks,
their linears, the LM head) come from the architecture registry quant/ uses too
(hub/architectures.py). Tied embeddings share the embedding's weight with the LM head.
Sequences travel flattened: hidden states are [T, hidden] for the T tokens of a step, whatever
sequences they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ...hub.architectures import Architecture, get_architecture
from ..layers.activation import SiluAndMul
from ..layers.attention import Attention, AttentionMetadata
from ..layers.embedding import ParallelLMHead, VocabParallelEmbedding
from ..layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ..layers.linear_methods import DenseMethod, QuantSpec, linear_method
from ..layers.norm import RMSNorm
from ..layers.parallel import SINGLE, ParallelContext
from ..layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class BuildOptions:
    """What every layer is built with: compute dtype and device, kernel backend ("triton":
    the Triton kernels; "torch": their references), the tensor-parallel context and the
    checkpoint's quantization (None: dense)."""

    dtype: torch.dtype
    device: torch.device
    backend: str
    ctx: ParallelContext = SINGLE
    quant: QuantSpec | None = None
    max_position: int = 4096

    def linear(self, hf_names: list[str], in_features: int):
        return linear_method(self.quant, hf_names, in_features, self.backend)

    def kw(self) -> dict:
        return dict(ctx=self.ctx, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: Callable = lambda c: bool(getattr(c, "attention_bias", False))
    o_bias: Callable = lambda c: bool(getattr(c, "attention_bias", False))
    mlp_bias: Callable = lambda c: bool(getattr(c, "mlp_bias", False))
    qk_norm: bool = False
    sliding_window: Callable = lambda c, i: 0


def _layer_window(c, i) -> int:
    """Qwen2/Qwen3: a sliding window only on the layers the config marks so (transformers 5:
    layer_types; 4.x: use_sliding_window and layers from max_window_layers on)."""
    if not getattr(c, "use_sliding_window", False) or not getattr(c, "sliding_window", None):
        return 0
    types = getattr(c, "layer_types", None)
    sliding = types[i] == "sliding_attention" if types else i >= getattr(c, "max_window_layers", 0)
    return int(c.sliding_window) if sliding else 0


ARCHS: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(),
    "MistralForCausalLM": ArchSpec(qkv_bias=lambda c: False, o_bias=lambda c: False, mlp_bias=lambda c: False,
                                   sliding_window=lambda c, i: int(getattr(c, "sliding_window", None) or 0)),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=lambda c: True, o_bias=lambda c: False, mlp_bias=lambda c: False,
                                 sliding_window=_layer_window),
    "Qwen3ForCausalLM": ArchSpec(mlp_bias=lambda c: False, qk_norm=True, sliding_window=_layer_window),
}


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, spec: ArchSpec, names: Architecture, index: int, opt: BuildOptions) -> None:
        super().__init__()
        h, d = config.hidden_size, head_dim_of(config)
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        block = names.block_prefix(index)
        qkv = [f"{block}.{n}" for n in names.qkv]
        self.qkv_proj = QKVParallelLinear(h, d, nh, nkv, spec.qkv_bias(config), opt.linear(qkv, h), **opt.kw())
        o_method = opt.linear([f"{block}.{names.o_proj}"], nh * d // opt.ctx.world_size)
        self.o_proj = RowParallelLinear(nh * d, h, spec.o_bias(config), o_method, **opt.kw())
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, opt.dtype, opt.device, opt.backend)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, opt.dtype, opt.device, opt.backend)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = RotaryEmbedding(config, d, opt.max_position, opt.device, opt.backend)
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, d ** -0.5, spec.sliding_window(config, index),
                              opt.backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            t = x.shape[0]
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        attn = self.attn
        if self.rotary_emb.fuses_store(attn.k_cache):  # rotary + KV store in one kernel
            q = self.rotary_emb.rotate_and_store(positions, q, k, v, attn.k_cache, attn.v_cache, meta.slot_mapping)
            return self.o_proj(attn(q, None, None, meta))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config, spec: ArchSpec, names: Architecture, index: int, opt: BuildOptions) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; allowed: silu")
        bias = spec.mlp_bias(config)
        block = names.block_prefix(index)
        self.gate_up_proj = MergedColumnParallelLinear(
            h, [i, i], bias, opt.linear([f"{block}.{n}" for n in names.gate_up], h), **opt.kw())
        self.down_proj = RowParallelLinear(i, h, bias,
                                           opt.linear([f"{block}.{names.down_proj}"], i // opt.ctx.world_size),
                                           **opt.kw())
        self.act_fn = SiluAndMul(opt.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, spec: ArchSpec, names: Architecture, index: int, opt: BuildOptions) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, spec, names, index, opt)
        self.mlp = LlamaMLP(config, spec, names, index, opt)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, opt.dtype, opt.device, opt.backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, opt.dtype, opt.device, opt.backend)

    def forward(self, positions, x, residual, meta, stream_out=None):
        """stream_out: a [T, H] view the residual stream at this layer's input is written into
        (EAGLE-3's aux columns; with a residual, by the fused add itself: no kernel of its own)."""
        if residual is None:
            if stream_out is not None:  # (a copy: the layers may update x in place)
                stream_out.copy_(x)
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual, residual_out=stream_out)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, spec: ArchSpec, names: Architecture, opt: BuildOptions) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, **opt.kw())
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, spec, names, i, opt)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, opt.dtype, opt.device, opt.backend)
        # an EAGLE-3 draft reads the residual stream at the input of these layers (HF's
        # hidden_states[i]); each forward then leaves them, concatenated [T, len * H], in aux_hidden
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        ids = self.aux_layer_ids
        if ids:  # each stream written into its columns of one buffer: no concatenation after
            h = x.shape[-1]
            aux = x.new_empty(x.shape[0], len(ids) * h)
        for i, layer in enumerate(self.layers):
            if not ids or i not in ids:
                x, residual = layer(positions, x, residual, meta)
                continue
            cols = [c for c, j in enumerate(ids) if j == i]  # (a layer named twice: its stream copied)
            first = aux[:, cols[0] * h:(cols[0] + 1) * h]
            x, residual = layer(positions, x, residual, meta, stream_out=first)
            for c in cols[1:]:
                aux[:, c * h:(c + 1) * h].copy_(first)
        if ids:
            self.aux_hidden = aux
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta) -> hidden [T, H];
    compute_logits(hidden [n, H]) -> logits [n, vocab] in the model dtype."""

    def __init__(self, config, opt: BuildOptions) -> None:
        super().__init__()
        arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in ARCHS:
            raise ValueError(f"architecture {arch} is not supported; supported: {', '.join(ARCHS)}")
        self.config = config
        self.arch = names = get_architecture(arch)
        # HF module (its last name) -> (our module, shard id): the fused linears
        self.packed_modules = {n.rpartition(".")[2]: ("qkv_proj", s) for n, s in zip(names.qkv, "qkv")}
        self.packed_modules |= {n.rpartition(".")[2]: ("gate_up_proj", i) for i, n in enumerate(names.gate_up)}
        self.model = LlamaModel(config, ARCHS[arch], names, opt)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        method = DenseMethod() if tied else opt.linear([names.lm_head], config.hidden_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, method, **opt.kw())
        if tied:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
