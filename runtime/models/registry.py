"""Architecture name (config.json ``architectures``) -> the runtime's model class."""

from __future__ import annotations

from ...errors import UserError
from .llama import ARCHS, LlamaForCausalLM

MODELS = {arch: LlamaForCausalLM for arch in ARCHS}


def model_class(config):
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODELS:
            return MODELS[arch]
    raise UserError(f"architecture {', '.join(getattr(config, 'architectures', None) or ['?'])} is not "
                    f"supported by the runtime; supported: {', '.join(MODELS)}")
