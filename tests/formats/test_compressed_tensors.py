import json

import pytest
import torch
from hf_reference import load_quantized

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
    import shutil

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
