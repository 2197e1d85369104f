"""Speculation under CUDA graphs, on a CPU through the graphs' eager stand-ins (the same static
buffers and outputs, refilled at every "replay"): ordinary decode steps through the decode graphs
with a draft loaded (their feature sink), the greedy speculative step whole through
SpecStepGraphs (catch-up window, proposal, verify, acceptance, KV move; padding rows in the pad
block) and the verify forward of the other steps through VerifyGraphs. A feature stored at the
wrong slot, a padding row writing a live block, a stale static input or the wrong bucket's
outputs would change the tokens: greedy speculative tokens must equal plain greedy decoding for
Medusa, EAGLE and EAGLE-3 drafts."""

from __future__ import annotations

import pytest
import torch
from conftest import write_draft

from optllm.runtime.llm import LLM
from optllm.runtime.sampling_params import SamplingParams
from optllm.runtime.spec.policy import CostTable

PROMPTS = ["The interpreter reads", "def main():\n    return", "In the beginning of the module the", "x = 1\ny",
           "a b c d e"]
GREEDY = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)


def _with_stand_in_graphs(llm: LLM, max_batch: int, step_graphs: bool = True) -> list[int]:
    """The runner's graphs as CPU stand-ins; returns the list the decode replays' batch sizes go to."""
    r = llm.engine.runner
    r.make_graphs(max_batch, eager_stand_in=True, step_graphs=step_graphs)
    replays: list[int] = []
    replay = r.graphs.replay

    def counted(hb, *temps):
        replays.append(len(hb.ids))
        return replay(hb, *temps)

    r.graphs.replay = counted
    return replays


def _plain_then_speculative(tiny_llama, tmp_path, method: str):
    """(plain greedy tokens of PROMPTS, an LLM with a draft of METHOD under the fixed policy)."""
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), device="cpu", dtype="float32").generate(PROMPTS,
                                                                                                        GREEDY)]
    kw = dict(seed=2, noise=0.3, draft_vocab=150) if method == "eagle3" else {}
    draft = write_draft(tmp_path / method, tiny_llama, method, **kw)
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(draft), spec_top_k=3, spec_depth=4,
              spec_num_draft=10, spec_policy="fixed", max_num_seqs=8)
    return want, llm


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
def test_plain_steps_replay_graphs_and_speculation_stays_exact(tiny_llama, tmp_path, method):
    want, llm = _plain_then_speculative(tiny_llama, tmp_path, method)
    replays = _with_stand_in_graphs(llm, 8)  # buckets 1, 2, 4, 8: the batch of 5 pads to 8
    spec = llm.engine.runner.spec
    plans: list[int] = []
    plan = spec.plan

    def every_other(running, draining=False):  # a speculative step, then an ordinary one through the graphs, ...
        plans.append(len(running))
        return plan(running, draining) if len(plans) % 2 else 0

    spec.plan = every_other
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    assert len(replays) >= 5 and max(replays) == 5, replays  # both paths ran, several times
    assert llm.engine.stats().speculation["seq_steps"] > 0


@pytest.mark.parametrize("in_graph", [False, True])
@pytest.mark.parametrize("method", ["medusa", "eagle3"])
def test_plain_decode_steps_store_the_features_after_the_fence(tiny_llama, tmp_path, method, in_graph, monkeypatch):
    """The decode graphs' store runs after the step's fence: a graph of its own, replayed after the
    host's fence, or (in_graph) inside the decode graph after its fence's mark. Plain decode steps
    through the graphs (stand-ins) leave the same draft inputs at every slot as the eager engine's
    store; each replay runs the decode graph, the fence, then the store's graph, or (in_graph) the
    one graph, whose run marks the fence before the store."""
    from optllm.runtime.cuda_graphs import DecodeGraphs

    monkeypatch.setattr(DecodeGraphs, "store_in_graph", in_graph)
    kw = dict(seed=2, noise=0.3, draft_vocab=150) if method == "eagle3" else {}
    draft = write_draft(tmp_path / method, tiny_llama, method, **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.2)  # (never speculates)
    stores = []
    for graphs in (False, True):
        llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(draft), spec_policy="fixed", max_num_seqs=8)
        order: list[str] = []
        if graphs:
            replays = _with_stand_in_graphs(llm, 8)
            g = llm.engine.runner.graphs
            assert g.in_graph == in_graph and set(g.stores) == (set() if in_graph else set(g.buckets))
            for key, tag in ((g.graphs, "decode"), (g.stores, "store")):
                for b, graph in key.items():
                    graph.replay = lambda f=graph.replay, tag=tag: order.append(tag) or f()
            for name in ("replayed", "mark") if in_graph else ("replayed",):
                was = getattr(g.fence, name)
                setattr(g.fence, name, lambda was=was, name=name: order.append(name) or was())
            sink = g.sink
            g.sink = lambda *a: order.append("sink") or sink(*a)
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        r = llm.engine.runner  # the scheduler's blocks (not the speculative graphs' pad block, nor the dump row)
        stores.append((outs, r.spec.store.features[:r.num_blocks * r.block_size].clone()))
        if graphs:
            one = ["decode", "mark", "sink", "replayed"] if in_graph else ["decode", "replayed", "store", "sink"]
            assert len(replays) >= 10 and order == one * len(replays)
    (eager_out, eager), (graph_out, graphed) = stores
    assert graph_out == eager_out
    used = eager.abs().sum(1) > 0
    assert used.sum() >= len(PROMPTS) * 12  # every prompt and decode row of the five sequences stored
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)


def test_cost_profile_times_the_graph_replay(tiny_llama, tmp_path, monkeypatch):
    """The plain step's profile replays the decode graph for the batches that fit one (8 runs eager),
    its inputs made once per batch size, outside the timed calls (a warm-up and 3 timed replays each)."""
    from optllm.runtime import spec_runner

    draft = write_draft(tmp_path / "eagle", tiny_llama, "eagle")
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(draft), spec_top_k=3, spec_depth=4,
              spec_num_draft=10, spec_policy="fixed", max_num_seqs=8)
    replays = _with_stand_in_graphs(llm, 4)
    made: list[int] = []
    host_batch = spec_runner.HostBatch
    monkeypatch.setattr(spec_runner, "HostBatch", lambda *a: made.append(len(a[0])) or host_batch(*a))
    table = llm.engine.runner.spec.measure(batches=[1, 2, 8], repeats=3)
    assert sorted(replays) == [1] * 4 + [2] * 4  # batches that fit a graph replay it; 8 runs eager
    assert made == [1, 2]
    assert set(table.ms) == {1, *llm.engine.runner.spec.sizes} and all(v > 0 for v in table.ms[1])


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_speculative_steps_replay_graphs_and_stay_exact(tiny_llama, tmp_path, method, policy):
    """Greedy steps through SpecStepGraphs (batch 5 pads to bucket 8; the adaptive policy's smaller
    trees have their own graphs), ordinary steps through the decode graphs."""
    want, llm = _plain_then_speculative(tiny_llama, tmp_path, method)
    r = llm.engine.runner
    if policy == "adaptive":  # a menu of smaller trees (each its own graphs, which count acceptance per size)
        r.spec.sizes = [2, 4, 6, r.spec.num_nodes]
        r.spec.adaptive = True
    replays = _with_stand_in_graphs(llm, 8)
    if policy == "adaptive":  # the cost profile through the graphs; then costs under which trees pay
        r.spec.start()
        pol = r.spec.policy
        pol.cost = CostTable(pol.cost.batches, {n: [1.0 if n == 1 else 0.6 + 0.05 * n] * len(pol.cost.batches)
                                                for n in pol.cost.ms})
        # in those units only: the CPU's measured step and catch-up times would not be
        pol.catch_up = None
        pol.observe_cost = lambda n, batch, ms: None
    runs: list[tuple[int, int]] = []
    run = r.spec.graphs.run

    def counted(ids, ctx, tables, n, temps=None):
        assert temps is None  # greedy rows take the greedy graphs
        runs.append((ids.shape[0], n))
        return run(ids, ctx, tables, n, temps)

    r.spec.graphs.run = counted
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    assert runs and llm.engine.stats().speculation["seq_steps"] > 0
    assert replays or policy == "fixed"
    if policy == "fixed":
        assert any(b == 5 for b, _ in runs)  # a batch that pads to its bucket
    else:
        assert len({n for _, n in runs}) > 1, runs  # several tree sizes


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_verify_forward_replays_graphs_and_speculation_stays_exact(tiny_llama, tmp_path, method):
    """Without the step graphs (as sampling steps run): the verify forward through VerifyGraphs."""
    want, llm = _plain_then_speculative(tiny_llama, tmp_path, method)
    r = llm.engine.runner
    _with_stand_in_graphs(llm, 8, step_graphs=False)
    runs: list[tuple[int, int]] = []
    run = r.verify_graphs.run

    def counted(tokens, *args):
        out = run(tokens, *args)
        if out is not None:  # a graph took it (None: no graph of that tree size and bucket -> eager)
            runs.append(tuple(tokens.shape))
        return out

    r.verify_graphs.run = counted
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    assert any(b == 5 for b, _ in runs)  # a batch that pads to its bucket


@pytest.mark.parametrize("after_mark", [False, True])
@pytest.mark.parametrize(("method", "noise"), [("eagle", 0.1), ("medusa", 0.02)])
def test_step_graphs_accept_what_the_eager_step_accepts(tiny_llama, tmp_path, method, noise, after_mark,
                                                        monkeypatch):
    """Greedy tokens would match even with a broken draft (the target decides them); the accepted
    drafts would not: the graphed step (its fixed catch-up window recomputing rows the draft has
    seen, its own proposal and acceptance) must accept exactly what the eager step accepts, at a
    batch that fills its bucket (no padding: the same shapes, float32, so the same values). The
    EAGLE draft's attention and MLP carry noise, so its own KV cache shapes its proposals.
    after_mark: the step graphs store the accepted rows' features after their fence's mark (the
    results' copy first): each step graph's run marks, then stores; else it stores and never marks."""
    from optllm.runtime.spec_runner import SpecStepGraphs

    monkeypatch.setattr(SpecStepGraphs, "store_after_mark", after_mark)
    draft = write_draft(tmp_path / method, tiny_llama, method, seed=3, noise=noise)
    prompts, params = PROMPTS[:4], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = []
    # the graphs read their results back through the host copy they make themselves, and (the
    # fallback where a captured download fails its start-up check) from their device outputs
    for graphs in (False, True, "device read-back"):
        llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(draft), spec_top_k=3, spec_depth=4,
                  spec_num_draft=10, spec_policy="fixed", max_num_seqs=4)
        events: list[str] = []
        if graphs:
            _with_stand_in_graphs(llm, 4)
            sg = llm.engine.runner.spec.graphs
            assert sg.readback and set(sg.readback) == set(sg.keys)
            assert sg.after_mark == after_mark
            if graphs == "device read-back":
                sg.readback = None
            for k in sg.keys:
                sg.graphs[k].replay = lambda f=sg.graphs[k].replay: events.append("step") or f()
            if after_mark:
                mark = sg.fence.mark
                sg.fence.mark = lambda: events.append("mark") or mark()
            store = llm.engine.runner.spec.store
            stored = store.store
            store.store = lambda *a: events.append("store") or stored(*a)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        steps = [i for i, e in enumerate(events) if e == "step"]
        assert len(steps) >= 5 or not graphs
        want = ["mark", "store"] if after_mark else ["store"]
        for i in steps:  # each step graph's run: (its mark, then) its store, nothing else before them
            assert events[i + 1:i + 1 + len(want)] == want, events[i:i + 4]
        if graphs is True:  # each key's host copy holds what its last replay output
            assert all((rb.np == sg.outputs[k][0].numpy()).all() for k, rb in sg.readback.items())
        runs.append((out, llm.engine.stats().speculation))
    (want, eager), *graphed = runs
    for got, stats in graphed:
        assert got == want
        assert stats["histogram"] == eager["histogram"] and eager["accepted"] > eager["seq_steps"] // 4, (eager, stats)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_sampled_steps_replay_their_graphs(tiny_llama, tmp_path, method):
    """Rows that ask only for a temperature speculate through the sampled graphs: the
    temperatures a static input, rejection sampling inside. In a batch mixing temperature 0 and
    1, the greedy rows' tokens must equal plain greedy decoding (the point mass on the argmax
    makes the rejection rule the greedy one), the sampled rows must differ from greedy somewhere
    and the graphs must have run with those temperatures; a row with top_p runs eager."""
    want, llm = _plain_then_speculative(tiny_llama, tmp_path, method)
    r = llm.engine.runner
    _with_stand_in_graphs(llm, 8)
    runs: list[list[float]] = []
    run = r.spec.graphs.run

    def counted(ids, ctx, tables, n, temps=None):
        runs.append(None if temps is None else temps.tolist())
        return run(ids, ctx, tables, n, temps)

    r.spec.graphs.run = counted
    hot = SamplingParams(temperature=1.0, max_tokens=36, ignore_eos=True)
    params = [GREEDY, hot, GREEDY, hot, GREEDY]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    for i in (0, 2, 4):
        assert got[i] == want[i]
    assert got[1] != want[1] or got[3] != want[3]
    sampled = [t for t in runs if t is not None]
    assert sampled and any(0.0 in t and 1.0 in t for t in sampled), runs
    assert llm.engine.stats().speculation["seq_steps"] > 0
    runs.clear()  # top_p is not a temperature-only row: the eager step (no graph run)
    llm.generate(PROMPTS[:2], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True))
    assert runs == []


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("method", ["medusa", "eagle3"])
def test_a_dropped_draft_engine_frees_its_kv_cache_without_the_cyclic_collector(tiny_llama, tmp_path, method, graphs):
    """An engine with a draft, after generating (through the CPU stand-ins of the decode and step
    graphs, or eager), is freed by reference counting once its LLM is dropped: its KV cache and the
    draft's go with it. The runner and its speculative decoder, the decoder and its step graphs, and
    each graph object and its stand-ins' runs referred to each other, so every engine waited for the
    cyclic collector, which counts objects, not the gigabytes a KV cache holds (a CI run grew to 24 GiB)."""
    import gc
    import weakref

    kw = dict(seed=2, noise=0.3, draft_vocab=150) if method == "eagle3" else {}
    draft = write_draft(tmp_path / method, tiny_llama, method, **kw)
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", draft=str(draft), spec_top_k=3, spec_depth=4,
              spec_num_draft=10, spec_policy="fixed", max_num_seqs=8)
    if graphs:
        llm.engine.runner.make_graphs(8, eager_stand_in=True, step_graphs=True)
        assert llm.engine.runner.spec.graphs is not None
    llm.generate(PROMPTS, GREEDY)
    assert llm.engine.stats().speculation["seq_steps"] > 0
    spec = llm.engine.runner.spec
    caches = [weakref.ref(llm.engine.runner.kv_cache.k)]
    if spec.eagle:
        caches.append(weakref.ref(spec.draft_kv.k))
    del spec
    gc.collect()
    gc.disable()
    try:
        del llm
        assert all(c() is None for c in caches)
    finally:
        gc.enable()
