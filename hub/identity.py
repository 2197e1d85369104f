"""A target model's identity: the hash a draft records when it is trained and the runtime
checks when it serves the draft against a target."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import UserError


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
