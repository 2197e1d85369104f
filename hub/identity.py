"""A target model's identity: the hash a draft records when it is trained and the runtime
checks when it serves the draft against a target."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import UserError

# config.json keys that say which program wrote the file, not which model it is: the same model
# converted under transformers 5.17 and 5.25 differs in "transformers_version" alone, and a hash over
# the file's bytes called a draft trained on one machine "trained for another target" on the other
_WRITER_KEYS = ("transformers_version", "_name_or_path", "_model_name_or_path", "_commit_hash")


def target_identity(folder: str | Path) -> str:
    """sha256 over the target's config (config.json's keys and values, sorted, without the keys that
    name the program that wrote it: ``_WRITER_KEYS``) and its LM head's stored tensor bytes
    (lm_head.weight, or the token embedding when tied): a draft trained on one target can tell,
    when served, that it was given another."""
    return target_identities(folder)[0]


def same_target(sha256: str | None, folder: str | Path) -> bool:
    """Whether a draft's recorded identity is this target's (one of ``target_identities``)."""
    return sha256 is not None and sha256 in target_identities(folder)


def target_identities(folder: str | Path) -> tuple[str, str]:
    """(target_identity, the legacy hash over config.json's bytes), the LM head's bytes read once."""
    from safetensors import safe_open

    folder = Path(folder)
    raw = (folder / "config.json").read_bytes()
    cfg = json.loads(raw)
    kept = {k: v for k, v in cfg.items() if k not in _WRITER_KEYS}
    hashes = (hashlib.sha256(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()), hashlib.sha256(raw))
    names = ["lm_head.weight"] if not cfg.get("tie_word_embeddings") else []
    names += ["model.embed_tokens.weight"]
    for name in names:
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                if name in st.keys():
                    data = st.get_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                    for h in hashes:
                        h.update(name.encode())
                        h.update(data)
                    return hashes[0].hexdigest(), hashes[1].hexdigest()
    raise UserError(f"{folder}: no lm_head.weight or model.embed_tokens.weight in its safetensors files")
