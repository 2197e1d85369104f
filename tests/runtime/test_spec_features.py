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
