"""Per-architecture structure of a decoder block: its linears and AWQ's smoothing pairs.

Llama, Mistral, Qwen2 and Qwen3 share module names, so one mapping serves all four; a new
family with other names adds an entry to ARCH_MAPPINGS.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class SmoothMapping:
    """AWQ pair: `smooth` (a norm or linear) feeds `balance` (linears sharing one input);
    `inspect` is the smallest submodule whose output shows the effect of the balance layers'
    quantization (it is run on the captured input of the balance layers)."""

    smooth: str
    balance: tuple[str, ...]
    inspect: str
    needs_block_kwargs: bool = False


@dataclass(frozen=True)
class BlockMapping:
    linears: tuple[str, ...]
    smooth: tuple[SmoothMapping, ...]
    no_clip: tuple[str, ...]  # linears whose clipping AWQ skips (q/k: attention logits are fragile)
    # GPTQ's "true sequential" order: each group's Hessians are taken with the groups before
    # it already quantized, so later layers see (and compensate) the earlier layers' error
    sequential: tuple[tuple[str, ...], ...] = ()


LLAMA_LIKE = BlockMapping(
    linears=(
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
    ),
    smooth=(
        SmoothMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                      "self_attn", needs_block_kwargs=True),
        SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        SmoothMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        SmoothMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    no_clip=("self_attn.q_proj", "self_attn.k_proj"),
    sequential=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
)

ARCH_MAPPINGS: dict[str, BlockMapping] = {
    "LlamaForCausalLM": LLAMA_LIKE,
    "MistralForCausalLM": LLAMA_LIKE,
    "Qwen2ForCausalLM": LLAMA_LIKE,
    "Qwen3ForCausalLM": LLAMA_LIKE,
}


def block_mapping(architecture: str) -> BlockMapping:
    if architecture not in ARCH_MAPPINGS:
        raise ValueError(f"no block mapping for {architecture}; supported: {', '.join(ARCH_MAPPINGS)}")
    return ARCH_MAPPINGS[architecture]


def block_linears(layer: nn.Module, mapping: BlockMapping) -> dict[str, nn.Linear]:
    out = {}
    for name in mapping.linears:
        mod = layer.get_submodule(name)
        if not isinstance(mod, nn.Linear):
            raise ValueError(f"{name} is a {type(mod).__name__}, expected nn.Linear")
        out[name] = mod
    return out
