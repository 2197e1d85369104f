import json

import pytest
import torch

from optllm.errors import UserError
from optllm.hub.loader import SUPPORTED_ARCHITECTURES, load_model, resolve_model


def test_loads_a_local_folder(tiny_llama):
    model, tok, folder = load_model(str(tiny_llama))
    assert folder == tiny_llama and type(model).__name__ == "LlamaForCausalLM" and len(tok) > 100


def test_sharded_folder(tiny_llama, tmp_path):
    m, tok, _ = load_model(str(tiny_llama))
    m.save_pretrained(tmp_path, max_shard_size="100KB")
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    m2, _, _ = load_model(str(tmp_path))
    sd, sd2 = m.state_dict(), m2.state_dict()
    assert list(sd) == list(sd2) and len(sd) > 10
    for k, a in sd.items():
        assert a.dtype == sd2[k].dtype and torch.equal(a, sd2[k]), k


def test_missing_model_is_one_clear_line(tmp_path):
    with pytest.raises(UserError, match="not found"):
        resolve_model("no-such-model")
    with pytest.raises(UserError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture_names_the_supported_ones(tiny_llama, tmp_path):
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "m", dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="not supported; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)):
        load_model(str(tmp_path / "m"))


def test_corrupt_safetensors(tiny_llama, tmp_path):
    import shutil

    shutil.copytree(tiny_llama, tmp_path / "m", dirs_exist_ok=True)
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="cannot load the weights"):
        load_model(str(tmp_path / "m"))


def test_builtin_conversion_keeps_a_folder_another_process_finished_first(tiny_llama, tmp_path, monkeypatch):
    """Parallel jobs (quality sweeps) may each convert the built-in model on first use: one that
    finishes second keeps the first one's complete folder, which others may be reading, instead
    of deleting it to put its own copy in place (an H200 sweep lost a job to exactly that)."""
    import shutil

    import safetensors.torch
    import transformers

    from optllm.hub import loader

    monkeypatch.setenv("OPTLLM_CACHE", str(tmp_path / "cache"))
    tiny, tok, _ = load_model(str(tiny_llama))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    monkeypatch.setattr(type(loader.BUILTIN_MODELS["smollm2-135m"]), "gguf_path", lambda self, cache=None:
                        tmp_path / "model.gguf")
    target = tmp_path / "cache" / "models" / "smollm2-135m"
    real_save = safetensors.torch.save_file

    def save_while_another_process_finishes(*args, **kwargs):
        if not target.exists():  # the other process renames its complete folder into place
            shutil.copytree(tiny_llama, target)
            (target / "theirs").write_text("")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_while_another_process_finishes)
    assert loader._builtin_folder("smollm2-135m") == target
    assert (target / "theirs").is_file()  # kept, not replaced
    assert [p.name for p in target.parent.iterdir()] == ["smollm2-135m"]  # our temporary copy is gone
