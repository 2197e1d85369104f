import json
import os
import shutil
import stat

import pytest
import torch
from hf_reference import load_quantized
from safetensors.torch import load_file

from optllm.errors import UserError
from optllm.formats import compressed_tensors
from optllm.formats.compressed_tensors import load_quantized_weights
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import quantize


@pytest.fixture(scope="module", params=[(4, True), (4, False), (3, True), (8, False)],
                ids=["w4-sym", "w4-asym", "w3-sym", "w8-asym"])
def quantized(request, tiny_llama, tmp_path_factory):
    bits, sym = request.param
    out = tmp_path_factory.mktemp("ckpt") / f"w{bits}-{'sym' if sym else 'asym'}"
    cfg = QuantizeConfig(scheme=f"w{bits}a16-rtn", group_size=32, symmetric=sym, num_samples=4, seq_len=32)
    quantize(str(tiny_llama), out, cfg, progress=False)
    return out, bits, sym


def test_folder_contents(quantized):
    out, bits, sym = quantized
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["symmetric"], w["strategy"], w["group_size"]) == (bits, sym, "group", 32)
    assert "lm_head" in qc["ignore"]
    assert (out / "tokenizer.json").is_file() and (out / "optllm-report.json").is_file()
    report = json.loads((out / "optllm-report.json").read_text())
    assert len(report["layers"]) == 14 and report["calibration"]["sha256"]
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_export_import_dequantize_exact(quantized):
    out, bits, sym = quantized
    qweights, rest, _ = load_quantized_weights(out)
    assert len(qweights) == 14
    model, _, _ = load_quantized(out, dtype="bfloat16")
    for name, qw in qweights.items():
        assert int(qw.q.min()) >= -(1 << (bits - 1)) and int(qw.q.max()) <= (1 << (bits - 1)) - 1
        assert (qw.zero is None) == sym
        assert torch.equal(model.get_submodule(name).weight, qw.dequantize().to(torch.bfloat16))


def test_transformers_and_compressed_tensors_read_the_same_weights(quantized):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out, _, _ = quantized
    ours, _, qweights = load_quantized(out, dtype="bfloat16")
    try:
        cfg = CompressedTensorsConfig(dequantize=True)
    except TypeError:  # older transformers name the same switch run_compressed=False
        cfg = CompressedTensorsConfig(run_compressed=False)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, quantization_config=cfg)
    for name in qweights:
        assert torch.equal(hf.get_submodule(name).weight, ours.get_submodule(name).weight), name
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ours(ids).logits)


def test_compressed_tensors_compressor_decompresses_to_our_values(quantized):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    out, _, _ = quantized
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme(targets=["Linear"], weights=qc["config_groups"]["group_0"]["weights"])
    sd = compressed_tensors.read_state_dict(out)
    qweights, _, _ = load_quantized_weights(out)
    for name, qw in qweights.items():
        local = {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}
        theirs = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        assert torch.equal(theirs, qw.dequantize()), name


def test_crash_leaves_no_half_checkpoint(tiny_llama, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(compressed_tensors, "save_file", boom)
    out = tmp_path / "ckpt"
    with pytest.raises(OSError):
        quantize(str(tiny_llama), out, QuantizeConfig(num_samples=2, seq_len=16, group_size=32), progress=False)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_corrupt_safetensors_is_one_clear_error(quantized, tmp_path):
    out, _, _ = quantized
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(UserError, match="not a valid safetensors file"):
        load_quantized(bad)


def test_existing_output_needs_overwrite(quantized, tiny_llama):
    out, _, _ = quantized
    with pytest.raises(UserError, match="already exists"):
        quantize(str(tiny_llama), out, QuantizeConfig(num_samples=2, seq_len=16, group_size=32), progress=False)


def test_report_says_whether_vllm_loads_it(quantized):
    out, bits, sym = quantized
    report = json.loads((out / "optllm-report.json").read_text())
    loadable = bits == 4  # group 32; w3 has too few bits, w8-asym has zero points vLLM takes only at 4 bits
    assert report["vllm_loadable"] is loadable
    assert (report["vllm_note"] is None) == loadable


# --- what OUT may be ------------------------------------------------------------------------

SMALL = QuantizeConfig(group_size=32, num_samples=2, seq_len=16)


def test_overwrite_refuses_a_folder_that_is_not_a_checkpoint(tiny_llama, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(UserError, match=r"mine holds files and is not a checkpoint .*--overwrite$"):
        quantize(str(tiny_llama), out, SMALL, overwrite=True, progress=False)
    assert [p.name for p in out.iterdir()] == ["thesis.tex"] and len(list(tmp_path.iterdir())) == 1


def test_overwrite_refuses_a_file_and_a_link(tiny_llama, tmp_path):
    f = tmp_path / "f"
    f.write_text("data")
    with pytest.raises(UserError, match="is a file, not a folder"):
        quantize(str(tiny_llama), f, SMALL, overwrite=True, progress=False)
    link = tmp_path / "link"
    link.symlink_to(tiny_llama)  # even to a checkpoint: replacing would drop the link, not the folder
    with pytest.raises(UserError, match="is a symbolic link"):
        quantize(str(tiny_llama), link, SMALL, overwrite=True, progress=False)
    assert f.read_text() == "data" and link.is_symlink()


def test_an_empty_folder_is_written_without_overwrite(tiny_llama, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    quantize(str(tiny_llama), out, SMALL, progress=False)
    assert compressed_tensors.is_quantized_folder(out) and [p.name for p in tmp_path.iterdir()] == ["empty"]


def test_overwrite_replaces_an_hf_model_folder_but_not_the_model_being_quantized(tiny_models, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_models["qwen2"], hf)
    assert compressed_tensors.is_checkpoint_folder(hf) and not compressed_tensors.is_quantized_folder(hf)
    with pytest.raises(UserError, match="is the model being quantized"):
        quantize(str(hf), hf, SMALL, overwrite=True, progress=False)
    assert not compressed_tensors.is_quantized_folder(hf) and [p.name for p in tmp_path.iterdir()] == ["hf"]
    out = tmp_path / "out"
    shutil.copytree(tiny_models["qwen2"], out)
    quantize(str(hf), out, SMALL, overwrite=True, progress=False)
    assert compressed_tensors.is_quantized_folder(out) and sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]


@pytest.mark.parametrize("umask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o002, 0o775, 0o664)])
def test_folders_and_files_get_the_umask_modes(umask, dir_mode, file_mode, tiny_llama, tmp_path):
    os.chmod(tiny_llama / "tokenizer.json", 0o600)  # a copied side file must not keep its source's mode
    old = os.umask(umask)
    try:
        out = tmp_path / "ckpt"
        quantize(str(tiny_llama), out, SMALL, progress=False)
        quantize(str(tiny_llama), out, SMALL, overwrite=True, progress=False)  # the swap path too
    finally:
        os.umask(old)
        os.chmod(tiny_llama / "tokenizer.json", 0o644)
    assert stat.S_IMODE(out.stat().st_mode) == dir_mode
    files = list(out.iterdir())
    assert len(files) >= 4 and {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {
        p.name: file_mode for p in files}


# --- transformers + compressed-tensors read back exactly our weights -------------------------

def hf_dequantized(out):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    try:
        cfg = CompressedTensorsConfig(dequantize=True)
    except TypeError:  # older transformers name the same switch run_compressed=False
        cfg = CompressedTensorsConfig(run_compressed=False)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, quantization_config=cfg)


def assert_same_model(hf, ours, qweights):
    assert not hf.config.tie_word_embeddings
    hf_sd, our_sd = hf.state_dict(), ours.state_dict()
    biases = [k for k in our_sd if k.endswith(".bias")]
    assert len(biases) == 2 * 3  # q, k, v of both layers
    for name in list(qweights) + biases + ["lm_head.weight", "model.embed_tokens.weight"]:
        key = name if name in our_sd else f"{name}.weight"
        assert torch.equal(hf_sd[key], our_sd[key]), key
    ids = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ours(ids).logits)


@pytest.mark.parametrize("scheme, sym, actorder", [
    ("w4a16-awq", True, None), ("w4a16-awq", False, None),
    ("w4a16-gptq", True, "static"), ("w4a16-gptq", False, "static"),
], ids=["awq", "awq-asym", "gptq-actorder", "gptq-actorder-asym"])
def test_transformers_reads_awq_gptq_and_asymmetric_qwen2_exactly(scheme, sym, actorder, tiny_models, tmp_path):
    out = tmp_path / "q"
    cfg = QuantizeConfig(scheme=scheme, group_size=32, symmetric=sym, actorder=actorder or "none",
                         num_samples=4, seq_len=32)
    quantize(str(tiny_models["qwen2"]), out, cfg, progress=False)
    w = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (w["symmetric"], w["actorder"]) == (sym, "weight" if actorder else None)
    ours, _, qweights = load_quantized(out, dtype="bfloat16")
    assert len(qweights) == 14 and all((qw.zero is None) == sym for qw in qweights.values())
    assert_same_model(hf_dequantized(out), ours, qweights)


def test_sharded_checkpoint_reads_back_every_tensor(tiny_models, tmp_path, monkeypatch):
    cfg = QuantizeConfig(group_size=32, num_samples=2, seq_len=16)
    quantize(str(tiny_models["qwen2"]), tmp_path / "one", cfg, progress=False)
    monkeypatch.setattr(compressed_tensors, "SHARD_BYTES", 48 * 1024)
    out = tmp_path / "sharded"
    quantize(str(tiny_models["qwen2"]), out, cfg, progress=False)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    n = len(shards)
    assert [p.name for p in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    whole = compressed_tensors.read_state_dict(tmp_path / "one")
    sharded = compressed_tensors.read_state_dict(out)
    assert index["weight_map"].keys() == sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[k], whole[k]) for k in whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    for shard in shards:  # every shard holds what the index says, within the limit (or one big tensor)
        names = load_file(shard).keys()
        assert {k for k, f in index["weight_map"].items() if f == shard.name} == set(names)
        assert len(names) == 1 or sum(whole[k].numel() * whole[k].element_size() for k in names) <= 48 * 1024
    ours, _, qweights = load_quantized(out, dtype="bfloat16")
    assert_same_model(hf_dequantized(out), ours, qweights)


@pytest.mark.parametrize("given, ours", [(None, None), ("weight", "static"), ("static", "static")])
def test_actorder_names_of_compressed_tensors_read_as_theirs(given, ours):
    """compressed-tensors' ActivationOrdering: "static" is "weight" (columns by Hessian order,
    groups in place), "dynamic" is "group" (needs g_idx, which we do not write)."""
    from optllm.formats.args import QuantArgs

    d = dict(num_bits=4, group_size=32, symmetric=True, strategy="group", type="int", actorder=given)
    args = QuantArgs.from_compressed_tensors(d)
    assert args.actorder == ours
    assert args.to_compressed_tensors()["actorder"] == ("weight" if ours else None)


@pytest.mark.parametrize("given", ["group", "dynamic", "sideways"])
def test_actorder_with_g_idx_or_unknown_is_refused(given):
    from optllm.formats.args import QuantArgs

    d = dict(num_bits=4, group_size=32, symmetric=True, strategy="group", type="int", actorder=given)
    with pytest.raises(ValueError, match="actorder"):
        QuantArgs.from_compressed_tensors(d)
