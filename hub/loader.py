"""Resolve MODEL (local folder, built-in alias, hub id) and load it as a transformers model.

Built-in aliases are GGUF files; they are converted once to a safetensors folder under the
cache (``$OPTLLM_CACHE`` or ``~/.cache/optllm``) so later loads take seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..errors import UserError
from .architectures import architecture_of, supported_architectures
from .builtin import BUILTIN_MODELS

SUPPORTED_ARCHITECTURES = supported_architectures()
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    return Path(os.environ.get("OPTLLM_CACHE", Path.home() / ".cache" / "optllm"))


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise UserError(f"unknown dtype {name!r}; allowed: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """"auto" (cuda when available), "cpu", "cuda", "cuda:N"; UserError when CUDA is asked for but absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={name!r} was asked for but CUDA is not available; use --device cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; allowed: auto, cpu, cuda, cuda:N") from None


def resolve_model(model: str | os.PathLike) -> Path:
    """Return a local HF folder for MODEL: a folder, a built-in alias, or a hub id (if reachable)."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} is a folder but has no config.json; expected a Hugging Face model folder")
        return path
    key = str(model).lower()
    if key in BUILTIN_MODELS:
        return _builtin_folder(key)
    if path.exists():
        raise UserError(f"{path} is a file; MODEL must be a Hugging Face model folder or a built-in alias")
    if "/" in str(model) and not str(model).startswith((".", "/", "~")):
        return _hub_folder(str(model))
    raise UserError(
        f"model {str(model)!r} not found: not a folder, not a built-in alias ({', '.join(BUILTIN_MODELS)}), "
        "not a hub id"
    )


def _hub_folder(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:  # offline, unknown repo, auth: all the same to the user
        raise UserError(
            f"model {repo_id!r} is not a local folder and could not be fetched from the hub ({type(e).__name__})"
        ) from None


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _builtin_folder(alias: str) -> Path:
    spec = BUILTIN_MODELS[alias]
    target = cache_root() / "models" / alias
    if _complete(target):
        return target
    gguf = spec.gguf_path(cache_root())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    m = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF's Q4_1 weights arrive dequantized; the folder must not claim a GGUF
    # quantization (and transformers refuses to save_pretrained a "gguf-quantized" model).
    config = m.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = spec.name
    config.architectures = [type(m).__name__]
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {k: v.detach().contiguous() for k, v in m.state_dict().items() if not (tied and k == "lm_head.weight")}
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
    try:
        from safetensors.torch import save_file

        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(tmp)
        if m.generation_config is not None:
            m.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "optllm-source.json").write_text(json.dumps({"alias": alias, "name": spec.name, "gguf": str(gguf)}))
        # Several processes may convert at once (parallel quality sweeps): the first rename wins and
        # the others keep it -- never delete a complete folder another process may be reading.
        if not _complete(target):
            if target.exists():  # not one of ours (we rename whole folders): a leftover, replaced
                shutil.rmtree(target, ignore_errors=True)
            try:
                os.replace(tmp, target)
            except OSError:
                if not _complete(target):
                    raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_architecture(config) -> str:
    """The supported architecture name of an HF config (hub/architectures.py); UserError otherwise."""
    return architecture_of(config).name


def load_config(folder: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read the model config in {folder}: {str(e).splitlines()[0]}") from None


def load_model(
    model: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
):
    """Load MODEL as (transformers causal LM in eval mode, tokenizer, local folder).

    A quantized optllm folder is served by the runtime instead (optllm.LLM).
    """
    from transformers import AutoModelForCausalLM

    folder = resolve_model(model)
    config = load_config(folder)
    check_architecture(config)
    if getattr(config, "quantization_config", None):
        raise UserError(f"{folder} is already quantized; serve it with optllm.LLM / `optllm generate`")
    try:
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(dtype))
    except Exception as e:  # corrupt safetensors, missing shards, wrong shapes
        raise UserError(f"cannot load the weights in {folder}: {_first_line(e)}") from None
    m.eval().to(device)
    return m, load_tokenizer(folder), folder


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise UserError(f"cannot load the tokenizer in {folder}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
