"""Decode and extend graphs (runtime/cuda_graphs.py): inputs through host staging buffers (the host
writes a step's inputs with numpy and the graph copies them in, padding rows included); the graph's
argmax serves all-greedy batches and the sampler everything else; prefills, prompt chunks and
prefills beside decodes replay token-bucketed extend graphs. On the CPU the graphs are stand-ins
(the same buffers, the model run again at each 'replay'); the marked test checks the CUDA part:
a captured host-to-device copy reads the host buffer anew at every replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from optllm import LLM, SamplingParams
from optllm.runtime.cuda_graphs import (
    GraphSampling,
    HostReadback,
    HostStaging,
    HostTokens,
    ReplayFence,
    captured_download_ok,
    check_captured_upload,
)

PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [11, 12, 13], list(range(20, 61)), [300, 1, 300, 2] * 5, [9, 8, 7, 6]]


def _generate(llm: LLM, params, graphs: bool):
    replays: list[int] = []
    if graphs:
        r = llm.engine.runner
        r.make_graphs(8, eager_stand_in=True)  # buckets 1, 2, 4, 8: five sequences pad to 8
        replay = r.graphs.replay

        def counted(hb, *temps):
            replays.append(len(hb.ids))
            return replay(hb, *temps)

        r.graphs.replay = counted
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)], replays, llm.engine.runner


@pytest.mark.parametrize("mix", ["greedy", "mixed"])
def test_graph_steps_equal_eager_steps(tiny_llama, mix):
    """Greedy (the graph's argmax), then greedy rows beside seeded sampled rows, a repetition
    penalty and min_tokens (the sampler on the graph's logits): the same tokens as eager decoding,
    over padded buckets and shrinking batches."""
    if mix == "greedy":
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 10, 16, 5, 20)]
    else:
        params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                  SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=17, ignore_eos=True),
                  SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=20),
                  SamplingParams(temperature=1.0, seed=3, max_tokens=11, min_tokens=9),
                  SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    want, _, _ = _generate(LLM(str(tiny_llama), device="cpu", dtype="float32"), params, graphs=False)
    got, replays, runner = _generate(LLM(str(tiny_llama), device="cpu", dtype="float32"), params, graphs=True)
    assert got == want
    assert 5 in replays and len(set(replays)) > 1, replays  # padded to 8, and smaller batches later
    # the argmax reaches the host through the graphs' own copy (HostTokens), not a device read-back
    assert runner.graphs._views and all(isinstance(v[1], HostTokens) for v in runner.graphs._views.values())


class _FixedLogits(torch.nn.Module):
    """A model stub for DecodeGraphs: every row's logits are ``row``, 8 tokens (a padded LM head of
    10 columns, the last two never to be drawn)."""

    def __init__(self, row: torch.Tensor) -> None:
        super().__init__()
        self.row, self.model = torch.cat([row, torch.full((2,), 50.0, device=row.device)]), None

    def forward(self, ids, positions, meta):
        return torch.zeros(ids.shape[0], 4)

    def compute_logits(self, hidden):
        return self.row.expand(hidden.shape[0], -1).contiguous()


def _one_row_batch(b: int):
    from types import SimpleNamespace

    return SimpleNamespace(ids=np.arange(b), positions=np.zeros(b, np.int64), slots=np.full(b, -1),
                           seq_lens=np.ones(b, np.int32), table=np.zeros((b, 1), np.int32))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_decode_graph_draws_each_row_at_its_temperature(backend):
    """A decode graph's own sampling: rows at temperature 0 keep the argmax (a padded LM head's
    columns excluded), sampled rows draw anew at each replay, the same seed draws the same tokens
    again, and (torch backend; the Triton kernel's draws are checked against their definition in
    tests/kernels/test_sample.py) 2400 draws at 0.7 follow softmax at 0.7: Pearson's chi-square at
    significance 1e-3."""
    from optllm.runtime.cuda_graphs import DecodeGraphs

    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])

    def graphs(seed):
        return DecodeGraphs(_FixedLogits(logits), 16, 1, 8, torch.device("cpu"), lambda b: 1, eager_stand_in=True,
                            seed=seed, backend=backend)

    g = graphs(3)
    hb = _one_row_batch(12)  # bucket 16: four padding rows
    temps = [0.0, 0.7, 0.0] + [0.7] * 9
    runs = []
    for _ in range(4):
        tokens = g.replay(hb, temps)[1]
        runs.append(tokens.tolist())
    assert all(r[0] == 0 and r[2] == 0 for r in runs)  # greedy rows: the argmax, never column 8 or 9
    assert all(0 <= t < 8 for r in runs for t in r)
    assert len({tuple(r) for r in runs}) > 1  # sampled rows drew anew
    g2 = graphs(3)
    assert [g2.replay(hb, temps)[1].tolist() for _ in range(4)] == runs  # the seed fixes the draws
    assert g.replay(hb)[1].tolist() == [0] * 12  # no temperatures: the argmax of every row
    if backend == "torch":
        counts = np.zeros(8)
        for _ in range(200):
            counts += np.bincount(g.replay(hb, temps)[1].tolist()[3:] + [g.replay(hb, temps)[1].tolist()[1]],
                                  minlength=8)
        probs = torch.softmax(logits.double() / 0.7, dim=-1).numpy()
        assert chisquare(counts, probs * counts.sum()).pvalue > 1e-3, (counts, probs * counts.sum())
        assert chisquare(counts, torch.softmax(logits.double(), dim=-1).numpy() * counts.sum()).pvalue < 1e-4


def test_temperature_only_decode_steps_skip_the_sampler(tiny_llama):
    """Decode and prefill steps whose rows all sample at a temperature alone (or are greedy) take
    the graph's tokens: the sampler runs only for steps with a row that needs it (here, a top_p row
    while it runs); the tokens are the same from one seeded engine to the next."""
    params = [SamplingParams(temperature=0.8, max_tokens=m, ignore_eos=True) for m in (12, 9, 14, 6, 10)]
    params[2] = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    params[4] = SamplingParams(temperature=0.9, top_p=0.7, max_tokens=3, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(str(tiny_llama), device="cpu", dtype="float32", seed=11)
        r = llm.engine.runner
        r.make_graphs(8, eager_stand_in=True)
        calls = []
        sampler = r.sampler

        class Spy:
            """The sampler, with its calls on steps where a row samples (all-greedy steps take the
            graph's argmax through it) counted."""

            def __call__(self, logits, seqs, greedy=None):
                if any(q.params.temperature > 0 for q in seqs):
                    calls.append(len(seqs))
                return sampler(logits, seqs, greedy=greedy)

            graph_temperatures = staticmethod(sampler.graph_temperatures)

        r.sampler = Spy()
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        runs.append(out)
        assert [len(t) for t in out] == [12, 9, 14, 6, 3]
        # the prefill's step, then the decode steps while the top_p row runs (2 of them): the rest
        # of the 13 decode steps drew inside the graph
        assert calls == [5, 5, 5], calls
        # without the top_p row, the prefill's first tokens are drawn inside its extend graph too
        calls.clear()
        again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params[:4])]
        assert calls == [] and [len(t) for t in again] == [12, 9, 14, 6]
        runs.append(again)
    assert runs[:2] == runs[2:]


def test_padding_rows_of_a_bucket_are_written_each_step(tiny_llama):
    """A batch of 3 after a batch of 8 in bucket 4: row 3 must be padding again (slot -1: nothing
    stored; one key over block 0), not the earlier step's row."""
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32")
    r = llm.engine.runner
    r.make_graphs(8, eager_stand_in=True)
    g = r.graphs
    q, i = g.i64.np, g.i32.np
    q[:] = 77
    i[:] = 77
    g._write_padding(4, 3)
    assert q[3] == 0 and q[4 + 3] == 0 and q[8 + 3] == -1 and i[3] == 1
    assert g.temps[4 + 3] == 0.0  # greedy: no noise drawn for a padding row
    assert (i[8 + 3 * g.width:8 + 4 * g.width] == 0).all()
    assert q[2] == 77 and q[4 + 2] == 77 and q[8 + 2] == 77 and i[2] == 77 and i[4 + 2] == 77  # the batch's rows
    assert (i[8 + 2 * g.width:8 + 3 * g.width] == 77).all()  # untouched


def _extend_replays(llm: LLM) -> list[tuple[int, ...]]:
    """Stand-in graphs on the runner; returns the list each extend replay's new-token counts go to."""
    r = llm.engine.runner
    r.make_graphs(4, eager_stand_in=True)
    assert r.extend_graphs is not None
    replays: list[tuple[int, ...]] = []
    replay = r.extend_graphs.replay

    def counted(hb, *temps):
        cu = hb.cu_seqlens
        replays.append(tuple(cu[j + 1] - cu[j] for j in range(len(cu) - 1)))
        return replay(hb, *temps)

    r.extend_graphs.replay = counted
    return replays


def test_prefills_chunks_and_mixed_steps_replay_extend_graphs(tiny_llama):
    """Prompts chunked by a 40-token budget, admitted while others decode (at most 3 running), then
    the same prompts again (prefix-cache hits: prefills over cached context), one request with
    prompt log-probs (its steps run eager): the same tokens and log-probs as eager steps, with
    extend graphs replayed for whole prefills, chunks and steps mixing a chunk with decodes."""
    prompts = [list(range(20, 61)), [5, 17, 250, 3, 99, 42, 7], [300, 1, 300, 2] * 5, [11, 12, 13],
               list(range(100, 133))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 20, 7, 15, 9)]
    params[3] = SamplingParams(temperature=0.7, seed=4, max_tokens=15, ignore_eos=True)
    lp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    kw = dict(device="cpu", dtype="float32", max_num_seqs=3, max_num_batched_tokens=40)
    runs = []
    for graphs in (False, True):
        llm = LLM(str(tiny_llama), **kw)
        replays = _extend_replays(llm) if graphs else None
        if not graphs:
            llm.engine.runner.make_graphs(4, eager_stand_in=True)
            llm.engine.runner.extend_graphs = None
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params[::-1])]
        scored = llm.generate([prompts[0]], lp)[0]
        runs.append((out, again, scored.outputs[0].token_ids, scored.prompt_logprobs, replays))
    (want, want2, want_lp_ids, want_lp, _), (got, got2, got_lp_ids, got_lp, replays) = runs
    assert got == want and got2 == want2 and got_lp_ids == want_lp_ids
    assert got_lp == want_lp
    assert any(len(c) == 1 and c[0] > 1 for c in replays)  # a whole prefill or a chunk alone
    assert any(1 in c and max(c) > 1 for c in replays), replays  # a chunk beside decodes
    assert sum(sum(c) for c in replays) >= sum(len(p) for p in prompts)  # the first pass: every prompt token


def test_extend_padding_leaves_no_sequence_behind(tiny_llama):
    """Key (64, 4) after a step of 10 tokens over 2 sequences with 1 logits row: tokens 10 .. 64
    are padding (slot -1), sequences 2 and 3 have no tokens (cu_seqlens stays at 10), logits rows
    1 .. 4 are greedy."""
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_num_seqs=4)
    llm.engine.runner.make_graphs(4, eager_stand_in=True)
    g = llm.engine.runner.extend_graphs
    assert (64, 4) in g.keys and g.bucket(10, 2) == (16, 4) and g.bucket(17, 1) == (32, 1)
    q, i, w = g.i64.np, g.i32.np, g.width
    q[:], i[:] = 77, 77
    g._write_padding(64, 4, 10, 2, 1)
    assert (q[10:64] == 0).all() and (q[64 + 10:128] == 0).all() and (q[128 + 10:192] == -1).all()
    assert (q[192 + 1:196] == 0).all() and q[192] == 77
    assert (i[2:4] == 1).all() and (i[4 + 3:9] == 10).all() and (i[4:4 + 3] == 77).all()
    assert (i[9 + 2 * w:9 + 4 * w] == 0).all() and (i[9:9 + 2 * w] == 77).all()
    # the logits rows' temperatures past the step's 1: greedy padding (row 0 again, no noise drawn)
    at = 9 + 4 * w
    assert (g.temps[at + 1:at + 4] == 0.0).all() and i[at] == 77


def _replays_see_each_new_input(st: HostStaging, fence: ReplayFence, run, read) -> None:
    """Capture run (after a warm-up), then replay it over fresh values written into st's host
    buffer: read() must give each replay's (values[:16] * 3 + 1)."""
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for k in range(5):
        fence.wait()
        vals = np.random.default_rng(k).integers(-1000, 1000, 64)
        st.np[:] = vals
        g.replay()
        fence.replayed()
        assert read() == (vals[:16] * 3 + 1).tolist()


@pytest.mark.gpu
def test_a_captured_upload_reads_the_host_buffer_at_every_replay():
    """The mechanism the decode and speculative step graphs rely on: the captured copy out of the
    pinned buffer re-reads it at each replay (values written after the capture arrive), and the
    fence waits for the replay."""
    dev = torch.device("cuda")
    st = HostStaging(64, torch.int64, dev)
    assert st.host.is_pinned()
    out = {}

    def run():
        out["y"] = st.upload(16) * 3 + 1

    _replays_see_each_new_input(st, ReplayFence(dev), run, lambda: out["y"].tolist())
    check_captured_upload(dev)  # the runtime's own start-up check passes


@pytest.mark.gpu
def test_a_graphs_own_fence_ends_the_wait_at_its_mark():
    """GraphFence: the external event a graph records at its mark ends the host's wait there: the
    copy before the mark (fed by ~1 ms of work) is in the host buffer, each replay's values, while
    the work after the mark still runs. The runtime's start-up check passes (the decode graphs store
    a draft's features after the mark)."""
    from optllm.runtime.cuda_graphs import GraphFence, graph_fence_ok

    dev = torch.device("cuda")
    st, rb = HostStaging(64, torch.int64, dev), HostReadback((4, 4), torch.int64, dev)
    fence, w = GraphFence(dev), torch.randn(2048, 2048, device=dev)
    tail = []

    def run():
        y = w
        for _ in range(8):
            y = torch.tanh(y @ w)
        rb.download((st.upload(16) * 3 + 1 + (y[0, 0] * 0).long()).view(4, 4))
        fence.mark()
        for _ in range(16):
            y = torch.tanh(y @ w)

    def read():
        fence.wait()
        tail.append(torch.cuda.current_stream().query())
        return rb.np.reshape(-1).tolist()

    _replays_see_each_new_input(st, fence, run, read)
    assert tail == [False] * 5  # every wait ended before the graph did
    assert graph_fence_ok(dev)


@pytest.mark.gpu
def test_a_captured_download_writes_the_host_buffer_at_every_replay():
    """The graphs' read-back: a captured copy into a pinned buffer lands each replay's values there
    once the fence has passed, read through the numpy view without a torch op."""
    dev = torch.device("cuda")
    st, rb = HostStaging(64, torch.int64, dev), HostReadback((4, 4), torch.int64, dev)
    fence = ReplayFence(dev)
    assert rb.host.is_pinned()

    def read():
        fence.wait()
        return rb.np.reshape(-1).tolist()

    _replays_see_each_new_input(st, fence, lambda: rb.download((st.upload(16) * 3 + 1).view(4, 4)), read)
    assert captured_download_ok(dev)  # the runtime's own start-up check passes


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_captured_decode_graph_draws_anew_at_every_replay(backend):
    """On CUDA, captured: the decode graph's sampling draws fresh noise at each replay (the Triton
    kernel's row counters advance inside the graph; torch's default generator moves its offset),
    greedy rows keep the argmax, and a padded LM head's columns are never drawn."""
    from optllm.runtime.cuda_graphs import DecodeGraphs

    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])

    class Fixed(_FixedLogits):
        def forward(self, ids, positions, meta):
            return torch.zeros(ids.shape[0], 4, device="cuda")

    model = Fixed(logits.cuda())
    g = DecodeGraphs(model, 16, 1, 8, torch.device("cuda"), lambda b: 1, seed=5, backend=backend)
    hb = _one_row_batch(12)
    temps = [0.0] + [1.0] * 11
    runs = [g.replay(hb, temps)[1].tolist() for _ in range(40)]
    assert all(r[0] == 0 for r in runs) and all(0 <= t < 8 for r in runs for t in r)
    draws = np.array([r[1:] for r in runs]).reshape(-1)
    assert len({tuple(r) for r in runs}) == 40  # 11 sampled rows: a repeat would mean replayed noise
    counts = np.bincount(draws, minlength=8)
    probs = torch.softmax(logits.double(), dim=-1).numpy()
    assert chisquare(counts, probs * counts.sum()).pvalue > 1e-3  # 440 draws at temperature 1
    if backend == "triton":
        from optllm.runtime.cuda_graphs import sampling_kernels_ok

        assert sampling_kernels_ok(torch.device("cuda")) and g.sampling.backend == "triton"  # no fallback to torch
        assert g.sampling.steps[1:12].tolist() == [40] * 11  # (the warm-up runs wrote greedy padding: no draws)


def test_sampling_kernels_that_fail_their_check_leave_the_torch_path(monkeypatch, caplog):
    """A GPU where the sampling kernels fail (here: a CUDA device this machine lacks, so the check's
    first copy raises) gets a warning and the torch sampling path, not a failed start."""
    from optllm.runtime import cuda_graphs

    dev = torch.device("cuda", 7)
    monkeypatch.setattr(cuda_graphs, "_SAMPLE_OK", {})
    if torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a GPU 7")
    with caplog.at_level("WARNING", logger="optllm.runtime"):
        assert cuda_graphs.sampling_kernels_ok(dev) is False
    assert "failed their start-up check" in caplog.text
    assert cuda_graphs.sampling_kernels_ok(torch.device("cpu")) is False


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_graph_sampling_argmax_is_the_greedy_token(backend):
    # a greedy tree's target tokens (spec_runner): each row's argmax over its first vocab_size columns, ties to the
    # lower id, a padded LM head's columns excluded; the Triton path (the sampling kernels) under the interpreter here
    from optllm.kernels.common import interpreting

    if backend == "triton" and not interpreting():
        pytest.skip("the sampling kernels on CPU tensors need TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g).to(torch.bfloat16)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: 7 wins
    logits[2, 290:] = 100.0  # padding past the vocabulary
    sampling = GraphSampling(8, 11, backend, torch.device("cpu"))
    got = sampling.argmax(logits, 280)
    assert got.tolist() == logits[:, :280].float().argmax(dim=-1).tolist() and got[1] == 7
    assert int(sampling.steps.abs().sum()) == 0  # greedy rows draw no noise
