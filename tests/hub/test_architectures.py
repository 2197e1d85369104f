"""The architecture registry: one set of module names for quant/ and runtime/. A family
registered with other names is honoured by the calibration's capture; the runtime's fused
linears and the quantizers' block linears come from the same entry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from optllm.errors import UserError
from optllm.hub.architectures import (
    ARCHITECTURES,
    LLAMA_LIKE,
    Architecture,
    architecture_of,
    get_architecture,
    register_architecture,
    supported_architectures,
)


def test_every_architecture_names_its_linears_once():
    assert supported_architectures() == ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                         "Qwen3ForCausalLM")
    for arch in ARCHITECTURES.values():
        roles = arch.qkv + (arch.o_proj,) + arch.gate_up + (arch.down_proj,)
        assert roles == arch.block.linears and sum(arch.block.sequential, ()) == roles
        assert arch.block_prefix(3) == "model.layers.3" and arch.model == "model"
        for m in arch.block.smooth:
            assert set(m.balance) <= set(roles)


def test_unknown_architecture_lists_the_supported_ones():
    class Cfg:
        architectures = ["GPTNeoXForCausalLM"]

    with pytest.raises(UserError, match="^architecture GPTNeoXForCausalLM is not supported; supported: "
                                        + ", ".join(supported_architectures())):
        architecture_of(Cfg())
    with pytest.raises(UserError, match="^unknown architecture 'gptneox'; allowed: "):
        get_architecture("gptneox")


def test_the_runtime_fuses_the_linears_the_registry_names(tiny_llama):
    from optllm import LLM

    model = LLM(tiny_llama, device="cpu").engine.runner.model
    assert model.arch is get_architecture("LlamaForCausalLM")
    assert model.packed_modules == {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                                    "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                                    "up_proj": ("gate_up_proj", 1)}


def test_a_family_with_other_module_names_is_captured_where_it_says(tiny_llama):
    """A wrapper that holds the Llama under `body`, registered with its own names: the
    calibration finds its blocks and captures exactly the first block's inputs of the plain model."""
    from transformers import AutoModelForCausalLM

    from optllm.quant.sequential import capture_block_inputs, decoder_layers

    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.body = inner
            self.config = inner.config.__class__.from_dict({**inner.config.to_dict(),
                                                            "architectures": ["TestWrappedForCausalLM"]})

    register_architecture(Architecture("TestWrappedForCausalLM", LLAMA_LIKE, layers="body.model.layers",
                                       embed_tokens="body.model.embed_tokens", rotary_emb="body.model.rotary_emb",
                                       lm_head="body.lm_head"))
    try:
        wrapped = Wrapped(plain)
        assert decoder_layers(wrapped) is plain.model.layers
        ids = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
        ours = capture_block_inputs(wrapped, ids, batch_size=2, device=torch.device("cpu"))
        ref = capture_block_inputs(plain, ids, batch_size=2, device=torch.device("cpu"))
        assert len(ours.hidden) == 2 and all(torch.equal(a, b) for a, b in zip(ours.hidden, ref.hidden))
    finally:
        ARCHITECTURES.unregister("TestWrappedForCausalLM")
