"""Architectures: the module names of each supported decoder-only family, registered by the
class name its config.json gives (``architectures``).

Both sides of a checkpoint use these names: quant/ to find the blocks, the linears it
quantizes and the groups its algorithms work on (AWQ's and SmoothQuant's smoothing pairs,
GPTQ's sequential order), runtime/ to map a checkpoint's tensors onto its layers and to know
which linears a quantization config covers. Names are the HF ones: block i is
``{layers}.{i}``, its linears are relative to the block.

Llama, Mistral, Qwen2 and Qwen3 share module names, so one BlockMapping serves all four; a
family with other names registers an Architecture of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from ..registry import Registry


@dataclass(frozen=True)
class SmoothMapping:
    """A smoothing pair (AWQ, SmoothQuant): `smooth` (a norm or linear) feeds `balance`
    (linears sharing one input); `inspect` is the smallest submodule whose output shows the
    effect of the balance layers' quantization (it is run on the captured input of the
    balance layers)."""

    smooth: str
    balance: tuple[str, ...]
    inspect: str
    needs_block_kwargs: bool = False


@dataclass(frozen=True)
class BlockMapping:
    """A decoder block's structure, names relative to the block."""

    linears: tuple[str, ...]
    smooth: tuple[SmoothMapping, ...]
    no_clip: tuple[str, ...]  # linears whose clipping AWQ skips (q/k: attention logits are fragile)
    # GPTQ's "true sequential" order: each group's Hessians are taken with the groups before
    # it already quantized, so later layers see (and compensate) the earlier layers' error
    sequential: tuple[tuple[str, ...], ...] = ()
    # SmoothQuant's pairs (a subset of `smooth`): the norms feeding the attention and MLP input
    # linears, as the paper and llm-compressor's default mappings smooth them
    smoothquant: tuple[SmoothMapping, ...] = ()
    # pairs whose smooth layer is a linear (up_proj -> down_proj), folded only when asked
    smoothquant_linear: tuple[SmoothMapping, ...] = ()
    # the value -> attention output pair (v_proj -> o_proj; under grouped-query attention one
    # factor per v_proj channel, shared by the o_proj inputs it feeds), folded only when asked
    smoothquant_value: tuple[SmoothMapping, ...] = ()


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_O = ("self_attn.o_proj",)
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
_DOWN = ("mlp.down_proj",)


@dataclass(frozen=True)
class Architecture:
    """One family's module names (HF's). The block's linears by role (attention q/k/v/o, MLP
    gate/up/down) are what the runtime's Llama-family model builds; `block` is the same
    linears as the quantization algorithms see them."""

    name: str  # config.json `architectures` entry
    block: BlockMapping
    layers: str = "model.layers"  # the ModuleList of decoder blocks: block i is f"{layers}.{i}"
    embed_tokens: str = "model.embed_tokens"
    rotary_emb: str = "model.rotary_emb"  # run before the first block too (absent in some versions)
    lm_head: str = "lm_head"
    qkv: tuple[str, ...] = _QKV
    o_proj: str = _O[0]
    gate_up: tuple[str, ...] = _GATE_UP
    down_proj: str = _DOWN[0]

    def block_prefix(self, index: int) -> str:
        """The name of decoder block INDEX ("model.layers.3")."""
        return f"{self.layers}.{index}"

    @property
    def model(self) -> str:
        """The module that holds the blocks and runs them (HF's inner ``model``)."""
        return self.layers.rpartition(".")[0]


_ATTN_IN = SmoothMapping("input_layernorm", _QKV, "self_attn", needs_block_kwargs=True)
_MLP_IN = SmoothMapping("post_attention_layernorm", _GATE_UP, "mlp")
_UP_DOWN = SmoothMapping("mlp.up_proj", _DOWN, "mlp.down_proj")
_V_O = SmoothMapping("self_attn.v_proj", _O, "self_attn.o_proj")

LLAMA_LIKE = BlockMapping(
    linears=_QKV + _O + _GATE_UP + _DOWN,
    smooth=(
        _ATTN_IN,
        _V_O,
        _MLP_IN,
        _UP_DOWN,
    ),
    no_clip=_QKV[:2],
    sequential=(_QKV, _O, _GATE_UP, _DOWN),
    smoothquant=(_ATTN_IN, _MLP_IN),
    smoothquant_linear=(_UP_DOWN,),
    smoothquant_value=(_V_O,),
)

ARCHITECTURES: Registry[Architecture] = Registry("architecture")


def register_architecture(arch: Architecture, replace: bool = False) -> Architecture:
    return ARCHITECTURES.register(arch.name, arch, replace=replace)


for _name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    register_architecture(Architecture(_name, LLAMA_LIKE))


def supported_architectures() -> tuple[str, ...]:
    return tuple(a.name for a in ARCHITECTURES.values())


def get_architecture(name: str) -> Architecture:
    return ARCHITECTURES.get(name)


def architecture_of(config) -> Architecture:
    """The registered architecture of an HF config (the first of its `architectures` we
    know); UserError naming the supported ones otherwise."""
    archs = list(getattr(config, "architectures", None) or [])
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES.get(a)
    raise UserError(
        f"architecture {', '.join(archs) or getattr(config, 'model_type', '?')} is not supported; "
        f"supported: {', '.join(supported_architectures())}"
    )
