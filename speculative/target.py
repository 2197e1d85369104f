"""The frozen target a draft is trained against: its hidden states (computed online) and
its identity (a hash a served draft is checked against)."""

from __future__ import annotations

import torch

from ..errors import UserError
from ..hub.identity import same_target, target_identity
from ..hub.loader import check_architecture, load_config, parse_dtype, resolve_model

__all__ = ["last_hidden", "lm_head_weight", "load_target", "same_target", "target_identity"]


def load_target(model: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"):
    """(transformers causal LM, frozen, in eval mode; its local folder). MODEL as everywhere:
    a folder, a built-in alias (resolved through the hub's cache) or a hub id. A quantized
    checkpoint (``optllm quantize``) is read through formats/ with its weights dequantized
    (runtime/loader.py's transformers_model): a draft for the AWQ target learns the AWQ target's
    hidden states, with no compressed-tensors package needed."""
    from ..runtime.loader import transformers_model

    folder = resolve_model(model)
    check_architecture(load_config(folder))
    try:
        m = transformers_model(folder, parse_dtype(dtype))
    except UserError:
        raise
    except Exception as e:  # corrupt safetensors, missing shards
        raise UserError(f"cannot load the target in {folder}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    m.eval().requires_grad_(False).to(device)
    return m, folder


@torch.no_grad()
def last_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The target's final hidden state (after its last norm, what its LM head reads):
    [B, T, hidden_size] for input_ids [B, T]."""
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state


def lm_head_weight(model) -> torch.Tensor:
    """[vocab_size, hidden_size]: the LM head's weight (the embedding when tied)."""
    return model.get_output_embeddings().weight
