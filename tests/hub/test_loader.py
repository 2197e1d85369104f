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
