"""The draft's inputs as the target's forward leaves them: EAGLE-3's auxiliary hidden states (the
residual stream at the input of chosen layers, written into one buffer's columns) and the feature
store's rows (slot -1: the dump row)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import hf_float32, make_tiny_model

from optllm.kernels.common import interpreting
from optllm.runtime.llm import LLM
from optllm.runtime.sampling_params import SamplingParams
from optllm.runtime.spec_runner import FeatureStore


@pytest.mark.parametrize("ids,kernels", [((0, 2, 3), "auto"), ((3, 1), "auto"), ((1, 1), "auto"), ((0, 2, 3), "triton"),
                                         ((1, 1), "triton")])
def test_aux_hidden_states_are_the_residual_stream_at_the_layer_inputs(tmp_path, ids, kernels):
    """aux_hidden [T, len(ids) * H] = HF's hidden_states[i] for i in ids, in that order (layer 0's
    input: the embeddings, before any residual exists; a layer named twice fills two blocks); the
    fused add of the layer's input norm writes them (kernels="triton": its Triton kernel, rows of
    stride len(ids) * H; on the CPU, so under TRITON_INTERPRET=1 only)."""
    if kernels == "triton" and not interpreting():
        pytest.skip("kernels='triton' on CPU tensors needs TRITON_INTERPRET=1")
    folder = make_tiny_model(tmp_path / "m", layers=4)
    llm = LLM(str(folder), device="cpu", dtype="float32", enable_prefix_caching=False, kernels=kernels)
    model = llm.engine.runner.model.model
    model.aux_layer_ids = ids
    prompt = [5, 17, 33, 2, 90, 41, 7]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, detokenize=False))
    got = model.aux_hidden
    hf = hf_float32(folder)
    with torch.no_grad():
        want = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    h = hf.config.hidden_size
    assert got.shape == (len(prompt), len(ids) * h)
    for c, i in enumerate(ids):
        torch.testing.assert_close(got[:, c * h:(c + 1) * h], want[i][0], rtol=1e-5, atol=1e-5)


def test_the_store_puts_each_row_at_its_slot_and_padding_in_the_dump_row():
    """store(hidden, None, slots): features[slot] = that row; rows of slot -1 go to the dump row
    (the last, index num_slots); no other row changes. int32 and int64 slots alike."""
    torch.manual_seed(0)
    draft = SimpleNamespace(method="medusa", hidden_size=8)  # not fused: the feature is the hidden state
    for dtype in (torch.int32, torch.int64):
        fs = FeatureStore(draft, num_slots=10, dtype=torch.float32, device=torch.device("cpu"))
        before = torch.randn(11, 8)
        fs.features.copy_(before)
        hidden = torch.randn(5, 8)
        slots = torch.tensor([3, -1, 9, 0, -1], dtype=dtype)
        fs.store(hidden, None, slots)
        want = before.clone()
        for row, s in zip(hidden, slots.tolist()):
            if s >= 0:
                want[s] = row
        got = fs.features
        assert torch.equal(got[:10], want[:10])
        assert any(torch.equal(got[10], hidden[i]) for i in (1, 4))  # the dump row: one padding row
        assert torch.equal(fs[torch.tensor([9, 3])], torch.stack([hidden[2], hidden[0]]))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_feature_store_writes_fc_of_the_aux_states_at_the_slots(kernels, monkeypatch):
    """EAGLE-3's store: features[slot] = fc(aux) for each row, slot -1 into the dump row (the last),
    nothing else written. kernels="triton" (the interpreter here) with FUSED_STORE takes the fused
    launch (kernels/fc_scatter.py); "torch", or FUSED_STORE off (the default), fc then index_put.
    float32: within 1e-5 of fc in float64."""
    from optllm.runtime import spec_runner

    if kernels == "triton" and not interpreting():
        pytest.skip("kernels='triton' on CPU tensors needs TRITON_INTERPRET=1")

    class _Draft:
        method, hidden_size, backend = "eagle3", 24, kernels

        def __init__(self):
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(72, 24, bias=False)

        def context_features(self, hidden, aux):
            return self.fc(aux)

    d = _Draft()
    monkeypatch.setattr(spec_runner, "FUSED_STORE", True)  # (opt-in: OPTLLM_FUSED_STORE=1)
    store = spec_runner.FeatureStore(d, 12, torch.float32, torch.device("cpu"))
    assert (store.fc_weight is not None) == (kernels == "triton")
    aux = torch.randn(5, 72)
    slots = torch.tensor([4, -1, 0, 11, 7], dtype=torch.int32)
    store.store(torch.randn(5, 24), aux, slots)
    want = (aux.double() @ d.fc.weight.double().t())
    for i, s in enumerate(slots.tolist()):
        torch.testing.assert_close(store.features[s].double(), want[i], rtol=1e-5, atol=1e-5)
    others = [r for r in range(12) if r not in (4, 0, 11, 7)]
    assert not store.features[others].any()
    monkeypatch.setattr(spec_runner, "FUSED_STORE", False)  # the switch: fc + index_put
    assert spec_runner.FeatureStore(d, 12, torch.float32, torch.device("cpu")).fc_weight is None
