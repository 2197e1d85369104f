"""The frozen target a draft is trained against: its hidden states (computed online) and
its identity (a hash a served draft is checked against)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import UserError
from ..hub.loader import check_architecture, load_config, parse_dtype, resolve_model


def load_target(model: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"):
    """(transformers causal LM, frozen, in eval mode; its local folder). MODEL as everywhere:
    a folder, a built-in alias (resolved through the hub's cache) or a hub id."""
    from transformers import AutoModelForCausalLM

    folder = resolve_model(model)
    check_architecture(load_config(folder))
    try:
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(dtype))
    except Exception as e:  # corrupt safetensors, missing shards, a quantization transformers cannot read
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


def target_identity(folder: str | Path) -> str:
    """sha256 over the target's config.json bytes and its LM head's stored tensor bytes
    (lm_head.weight, or the token embedding when tied): a draft trained on one target can
    tell, when served, that it was given another."""
    from safetensors import safe_open

    folder = Path(folder)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    names = ["lm_head.weight"] if not cfg.get("tie_word_embeddings") else []
    names += ["model.embed_tokens.weight"]
    for name in names:
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                if name in st.keys():
                    t = st.get_tensor(name).contiguous()
                    h.update(name.encode())
                    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
                    return h.hexdigest()
    raise UserError(f"{folder}: no lm_head.weight or model.embed_tokens.weight in its safetensors files")
