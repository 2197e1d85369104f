"""Decode under CUDA graphs: one graph per batch-size bucket, captured once at start.

A decode step (one new token per sequence) of batch size b replays the graph of the
smallest bucket >= b. The graphs read static buffers (ids, positions, slots, key counts,
block tables) that each step fills by copy; the rows past b are padding (slot -1: nothing
is stored; key count 1 over block 0: finite, unused output). Logits are computed inside the
graph. Every graph shares one memory pool (captured largest first).

With a draft loaded (speculative decoding), the ordinary decode steps still run here, and each
bucket's hidden rows (and an EAGLE-3 target's auxiliary hidden states) go to ``sink`` -- the
draft's feature cache (runtime/spec_runner.py FeatureStore) -- after the point where the host's
wait for the tokens ends: inside the decode graph behind a ``GraphFence`` mark where
``graph_fence_ok`` (one replay a step), else in a second, small graph replayed after the step's
fence. The host reads the tokens back while the store runs, and its GPU time (EAGLE-3's fc and
scatter, 7-13 µs at batch 8-64 on the H100, ~1% of a plain step) falls in the host's turnaround
between steps instead of before the step's tokens.

``DecodeGraphs(..., eager_stand_in=True)`` records the same static buffers and outputs but
"replays" by running the model again and copying into them: the plumbing on a CPU (tests).
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref

import numpy as np
import torch

from ..kernels.sample import sample_tokens
from .inference import inference
from .layers.attention import AttentionMetadata
from .step_inputs import HostBatch

log = logging.getLogger("optllm.runtime")


def graph_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    out = [b for b in (1, 2, 4, 8) if b <= max_batch]
    out += list(range(16, max_batch + 1, 16))
    if max_batch not in out:
        out.append(max_batch)
    return sorted(set(out))


class _EagerStandIn:
    """A stand-in for a captured graph on a CPU: replay() runs ``run`` and copies its results
    into the outputs the 'capture' returned, as a graph replay refills its static outputs."""

    def __init__(self, run, outputs) -> None:
        self.run, self.outputs = _weakly(run), outputs

    def replay(self) -> None:
        for dst, src in zip(self.outputs, self.run()):
            if dst is not None:
                dst.copy_(src)


def _weakly(run):
    """run, or where it is a partial of a bound method (each graph object's runs are: partial(self._run,
    key)), the same call through a weak reference to the method's object. The stand-ins live in that
    object's own dict of graphs, so a strong one would be a cycle: an engine dropped on a CPU would keep
    its model and KV cache until the cyclic collector ran, which counts objects, not the gigabytes they
    hold. (A captured CUDA graph keeps no Python reference to its run.)"""
    if isinstance(run, functools.partial) and inspect.ismethod(run.func):
        method, args, kwargs = weakref.WeakMethod(run.func), run.args, run.keywords
        return lambda: method()(*args, **kwargs)
    return run


_UPLOAD_CHECKED: set = set()  # devices whose captured uploads were seen to re-read the host buffer


def check_captured_upload(device: torch.device) -> None:
    """Once per device: a captured copy out of a pinned buffer must read the values written after
    the capture (HostStaging relies on it; a copy that replayed the capture's values would make every
    graphed step compute on stale inputs, silently). Raises RuntimeError if it does not."""
    if device.type != "cuda" or device in _UPLOAD_CHECKED:
        return
    st = HostStaging(8, torch.int64, device)
    out = {}
    with torch.inference_mode():
        out["y"] = st.upload(8) + 1  # warm-up
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out["y"] = st.upload(8) + 1
        for k in (3, 11):
            st.np[:] = np.arange(8) * k
            g.replay()
            if out["y"].tolist() != [i * k + 1 for i in range(8)]:
                raise RuntimeError("a CUDA graph's captured host-to-device copy did not read the pinned buffer anew "
                                   "at replay on this torch / driver; the runtime's graphs need it: run with "
                                   "enforce_eager=True (--enforce-eager)")
    _UPLOAD_CHECKED.add(device)


@torch.inference_mode()
def capture_graphs(graphs: dict, runs: dict, device, eager_stand_in: bool, prepare=None) -> dict:
    """Capture runs[key]() (largest first: they share one memory pool) into graphs[key]; returns
    {key: the outputs the graph refills at each replay}. eager_stand_in: _EagerStandIn instead.
    prepare(key), when given, runs before key's first run (host-side inputs of its warm-up)."""
    outputs = {}
    if eager_stand_in:
        for key, run in runs.items():
            if prepare is not None:
                prepare(key)
            outputs[key] = tuple(t.clone() if t is not None else None for t in run())
            graphs[key] = _EagerStandIn(run, outputs[key])
        return outputs
    check_captured_upload(torch.device(device))
    pool = None
    for key, run in runs.items():
        if prepare is not None:
            prepare(key)
        run()  # warm-up: Triton compiles and autotunes outside the capture
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            outputs[key] = run()
        pool = g.pool()
        graphs[key] = g
    torch.cuda.synchronize(device)
    return outputs


class HostStaging:
    """A step's inputs as the host writes them and a captured graph reads them: a host buffer
    (pinned on CUDA) and its device twin. A graph captures the copy of its span (``upload``), and
    a captured host-to-device copy reads the host memory anew at every replay: a step writes its
    inputs through the numpy view ``np`` and replays, with no torch op between (each costs the
    H200's host ~10-20 µs, and a step made about ten). The writer must know that the last replay
    has read the buffer (``ReplayFence``)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.host = torch.zeros(size, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.host.numpy()
        self.dev = torch.zeros(size, dtype=dtype, device=device)

    def upload(self, n: int) -> torch.Tensor:
        """Inside a capture: the copy of the first n elements; returns their device view."""
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


class HostReadback:
    """The other direction: a captured graph's last node copies its results into a host buffer
    (pinned on CUDA), so that after the replay's fence the host reads them through the numpy view
    ``np`` with no torch op (the read-back of a speculative step made ten: the output's slices, the
    copy, numpy's conversions). The reader must wait for the replay (``ReplayFence``) and be done
    reading before the next one."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.host.numpy()

    def download(self, t: torch.Tensor) -> None:
        """Inside a capture (or the eager stand-in's run): the copy of t into the host buffer."""
        self.host.copy_(t, non_blocking=True)


def download_into(table: dict, key, t: torch.Tensor, device: torch.device) -> None:
    """A graph's last node: t copied into table[key]'s HostReadback, which its warm-up run (outside
    the capture) makes."""
    rb = table.get(key)
    if rb is None:
        rb = table[key] = HostReadback(tuple(t.shape), t.dtype, device)
    rb.download(t)


class HostTokens:
    """A decode graph's argmax as the graph itself copied it to the host (``HostReadback``), in the
    place of the device tensor: ``tolist()`` waits for the replay (its fence) and reads the numpy
    view, with no torch op (a device tensor's read-back makes 4-6: the copy, numpy's conversions)."""

    __slots__ = ("fence", "np")

    def __init__(self, fence: ReplayFence, view: np.ndarray) -> None:
        self.fence, self.np = fence, view

    def tolist(self) -> list[int]:
        self.fence.wait()
        return self.np.tolist()


_DOWNLOAD_OK: dict = {}  # device -> whether a captured device-to-host copy lands at each replay


def captured_download_ok(device: torch.device) -> bool:
    """Once per device: whether a captured copy into a pinned buffer writes the replay's values
    there (HostReadback relies on it); False sends the callers back to reading the graph's device
    outputs. A CPU (the eager stand-ins: every copy runs) is True."""
    if device.type != "cuda":
        return True
    if device not in _DOWNLOAD_OK:
        st, rb = HostStaging(8, torch.int64, device), HostReadback((8,), torch.int64, device)
        with torch.inference_mode():
            rb.download(st.upload(8) + 1)  # warm-up
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g):
                    rb.download(st.upload(8) + 1)
                ok = True
                for k in (3, 11):
                    st.np[:] = np.arange(8) * k
                    g.replay()
                    torch.cuda.synchronize(device)
                    ok = ok and rb.np.tolist() == [i * k + 1 for i in range(8)]
            except RuntimeError:
                ok = False
        _DOWNLOAD_OK[device] = ok
    return _DOWNLOAD_OK[device]


_SAMPLE_OK: dict = {}  # device -> whether kernels/sample.py's kernels gave the reference's tokens there


def sampling_kernels_ok(device: torch.device) -> bool:
    """Once per device: whether the Triton sampling kernels compile and give torch's argmax for
    greedy rows (ties and a padded LM head included) and advance a sampled row's counter; False
    (with a warning) sends the decode graphs to the torch sampling path, so a kernel that fails
    on some GPU costs speed, not the engine's start or its tokens. A CPU without the interpreter: False."""
    if device.type != "cuda":
        return False
    if device not in _SAMPLE_OK:
        try:
            g = torch.Generator(device="cpu").manual_seed(0)
            x = (torch.randn(4, 1030, generator=g) * 3).to(torch.bfloat16).round().to(device)
            x[:, 1000:] = 1e4  # padded columns: never taken
            temps = torch.tensor([0.0, 0.0, 0.0, 1.0], device=device)
            steps = torch.zeros(4, dtype=torch.int64, device=device)
            tok = sample_tokens(x, temps, steps, 0, 1000, backend="triton")
            want = x[:3, :1000].float().argmax(dim=-1)
            ok = tok[:3].tolist() == want.tolist() and 0 <= int(tok[3]) < 1000 and steps.tolist() == [0, 0, 0, 1]
        except Exception as e:  # a compile or launch failure: the torch path serves
            ok, why = False, f"{type(e).__name__}: {e}"
        else:
            why = "its tokens differ from torch's argmax"
        if not ok:
            log.warning("the decode graphs' sampling kernels failed their start-up check on %s (%s); sampling "
                        "there runs torch's ops inside the graphs instead", device, why)
        _SAMPLE_OK[device] = ok
    return _SAMPLE_OK[device]


class GraphSampling:
    """What a graph needs to draw its rows' tokens itself (kernels/sample.py): a noise counter per
    row on the device (``steps``, advanced by the launches), the Philox key, the backend (Triton's
    kernels unless they failed ``sampling_kernels_ok`` on this GPU: then torch's ops) and, off CUDA,
    the torch path's own generator (on CUDA the default one, which a graph may draw from)."""

    def __init__(self, rows: int, seed: int, backend: str, device: torch.device) -> None:
        self.steps = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seed = seed
        self.backend = "torch" if backend == "triton" and device.type == "cuda" and not sampling_kernels_ok(device) \
            else backend
        self.generator = None if device.type == "cuda" else torch.Generator(device).manual_seed(seed)
        self.zero_temps = torch.zeros(rows, dtype=torch.float32, device=device)

    def draw(self, logits: torch.Tensor, temps: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """int64 [R]: a token per row of logits [R, >= vocab_size] at temps float32 [R] (0: the argmax)."""
        return sample_tokens(logits, temps, self.steps[:logits.shape[0]], self.seed, vocab_size, backend=self.backend,
                             generator=self.generator)

    def argmax(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """int64 [R]: each row's argmax over its first vocab_size columns (ties: the lower), as the decode
        graphs' greedy rows take it (two launches; torch's argmax over a tree's [N, V] logits is one
        reduction of 13 µs, the H100's 20-node step profile); torch's where the sampling kernels failed
        their check (no noise drawn for nothing)."""
        if self.backend == "torch":
            return logits[:, :vocab_size].argmax(dim=-1)
        return self.draw(logits, self.zero_temps[:logits.shape[0]], vocab_size)


class ReplayFence:
    """An event recorded after each replay: ``wait`` returns once the last replay (and so its
    copies out of the staging buffers) is done. Steps read their results back before the next
    one writes, so the wait is almost always free; it keeps a step that does not from racing."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event() if device.type == "cuda" else None

    def replayed(self) -> None:
        if self.event is not None:
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class GraphFence(ReplayFence):
    """A fence the graphs record themselves, at a point inside them: ``mark()``, called inside the
    run being captured, records an external event (a record node of the graph). ``wait`` returns
    once the last replay has passed that point, while the work captured after it may still run;
    ``replayed`` does nothing. On the GPU only where ``graph_fence_ok``; a CPU's (the eager stand-ins)
    does nothing."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event(external=True) if device.type == "cuda" else None

    def mark(self) -> None:
        if self.event is not None:
            self.event.record()

    def replayed(self) -> None:
        pass


_FENCE_OK: dict = {}  # device -> whether a graph's own event record ends the host's wait mid-graph


def graph_fence_ok(device: torch.device) -> bool:
    """Once per device: whether an external event recorded inside a captured graph (``GraphFence``)
    works as the decode graphs need it: after its ``wait`` the host reads what the graph copied out
    before the mark (slow work feeds the copy: a wait that returned early reads stale values), while
    the work captured after the mark is still running (else the mark brings nothing). False (torch
    without external events, a driver that records at the graph's end) keeps the feature store a graph
    of its own, replayed after a fence recorded by the host."""
    if device.type != "cuda":
        return False
    if device not in _FENCE_OK:
        ok = False
        try:
            st, rb = HostStaging(8, torch.int64, device), HostReadback((8,), torch.int64, device)
            fence, w = GraphFence(device), torch.randn(2048, 2048, device=device)

            def run():
                y = w
                for _ in range(8):  # ~1 ms of work that the copy waits for
                    y = torch.tanh(y @ w)
                rb.download(st.upload(8) + 1 + (y[0, 0] * 0).long())
                fence.mark()
                for _ in range(16):  # and more after the mark
                    y = torch.tanh(y @ w)

            with torch.inference_mode():
                run()
                torch.cuda.synchronize(device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run()
                ok = True
                for k in (3, 11):
                    st.np[:] = np.arange(8) * k
                    g.replay()
                    fence.wait()
                    ok = ok and rb.np.tolist() == [i * k + 1 for i in range(8)]
                    ok = ok and not torch.cuda.current_stream(device).query()  # the tail still runs
                    torch.cuda.synchronize(device)
        except (TypeError, RuntimeError):  # (no ``external`` events in this torch; a capture that refuses it)
            ok = False
        _FENCE_OK[device] = ok
    return _FENCE_OK[device]


class DecodeGraphs:
    """Per bucket b the graph reads its inputs from two staging buffers laid out for b rows,
    int64 [ids b | positions b | slots b] and int32 [key counts b | temperatures b (float32 bits)
    | block tables b x width], and outputs the logits and each row's token: the argmax where the
    row's temperature is 0 (a greedy step's tokens: the sampler's all-greedy case), else drawn at
    that temperature (kernels/sample.py: a temperature-only sampled step needs no sampler call and
    no torch op on the host; ``GraphSampling``). seed: the noise's Philox key; backend: the
    sampling kernels' ("triton" | "torch").
    With a sink (a draft engine's feature store), the store runs after the tokens' read-back point:
    inside each graph, after a ``GraphFence`` mark, where ``graph_fence_ok`` (one replay a step);
    else as a graph of its own per bucket (``stores``), replayed after the host's fence. Either way
    the host waits for the tokens only, and the store's GPU time overlaps its turnaround.
    ``store_in_graph`` (None: as ``graph_fence_ok`` says) pins the choice (tests)."""

    store_in_graph: bool | None = None

    def __init__(self, model, max_batch: int, max_blocks_per_seq: int, vocab_size: int, device: torch.device,
                 num_splits_for, eager_stand_in: bool = False, sink=None, seed: int = 0,
                 backend: str = "torch") -> None:
        self.model, self.sink, self.vocab_size = model, sink, vocab_size
        self.eager_stand_in = eager_stand_in
        self.buckets = graph_buckets(max_batch)
        self.max_batch, self.width = self.buckets[-1], max_blocks_per_seq
        n = self.max_batch
        self.i64 = HostStaging(3 * n, torch.int64, device)
        self.i32 = HostStaging(n * (2 + self.width), torch.int32, device)
        self.temps = self.i32.np.view(np.float32)  # the temperatures' float32 view of the int32 staging
        self.sampling = GraphSampling(n, seed, backend, device)
        pin = self.store_in_graph
        self.in_graph = sink is not None and (graph_fence_ok(device) if pin is None else pin)
        self.fence = GraphFence(device) if self.in_graph else ReplayFence(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple] = {}  # bucket -> (logits, tokens[, hidden, aux]), refilled by each replay
        self.stores: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> the sink's graph (a draft, not in_graph)
        # the tokens also copied to the host by the graph (a buffer a bucket, made at its warm-up run)
        self.device = device
        self.readback: dict | None = {} if captured_download_ok(device) else None
        self._views: dict = {}  # (bucket, rows) -> what replay() returns: views of the static outputs
        self.num_splits_for = num_splits_for
        self._capture(device)

    def _run(self, b: int) -> tuple:
        """(logits, tokens) of bucket b; with a sink in the graph, the fence's mark, then the store;
        with a sink in a graph of its own, also the hidden rows and aux states it stores (outputs of
        the graph, so that no other graph of the pool reuses their memory before the store's graph
        has read them)."""
        i64, i32 = self.i64.upload(3 * b), self.i32.upload(b * (2 + self.width))
        ids, positions, slots = i64[:b], i64[b:2 * b], i64[2 * b:]
        meta = AttentionMetadata(slot_mapping=slots, block_tables=i32[2 * b:].view(b, self.width), seq_lens=i32[:b],
                                 decode=True, num_splits=self.num_splits_for(b))
        hidden = self.model(ids, positions, meta)
        logits = self.model.compute_logits(hidden)
        # (a padded LM head's columns excluded)
        tokens = self.sampling.draw(logits, i32[b:2 * b].view(torch.float32), self.vocab_size)
        if self.readback is not None:
            download_into(self.readback, b, tokens, self.device)
        if self.sink is None:
            return logits, tokens
        aux = getattr(self.model.model, "aux_hidden", None)
        if self.in_graph:  # the host's wait ends here; the store runs while it reads the tokens
            self.fence.mark()
            self.sink(hidden, aux, slots)
            return logits, tokens
        return logits, tokens, hidden, aux

    def _store(self, b: int) -> tuple:
        """The sink over bucket b's last replay: its hidden rows (and aux states) at its slots (the
        device staging the replay uploaded, unchanged until the next replay's upload)."""
        _logits, _tokens, hidden, aux = self.outputs[b]
        self.sink(hidden, aux, self.i64.dev[2 * b:3 * b])
        return ()

    def _capture(self, device) -> None:
        # the warm-up runs' batch: all padding (slot -1: nothing stored; one key)
        self.outputs = capture_graphs(self.graphs, {b: functools.partial(self._run, b) for b in reversed(self.buckets)},
                                      device, self.eager_stand_in, prepare=lambda b: self._write_padding(b, 0))
        if self.sink is not None and not self.in_graph:  # (its warm-up and capture store nothing: slots -1)
            capture_graphs(self.stores, {b: functools.partial(self._store, b) for b in reversed(self.buckets)},
                           device, self.eager_stand_in, prepare=lambda b: self.i64.dev[2 * b:3 * b].fill_(-1))

    def bucket(self, b: int) -> int | None:
        for size in self.buckets:
            if size >= b:
                return size
        return None

    def _write_padding(self, size: int, b: int) -> None:
        """Rows b .. size of bucket size's layout: token 0 at position 0, slot -1, one key over block 0,
        greedy."""
        q, i = self.i64.np, self.i32.np
        q[b:size] = 0
        q[size + b:2 * size] = 0
        q[2 * size + b:3 * size] = -1
        i[b:size] = 1
        i[size + b:2 * size] = 0  # (float32 0.0: greedy, no noise drawn)
        i[2 * size + b * self.width:2 * size + size * self.width] = 0

    @inference
    def replay(self, hb: HostBatch, temps: list[float] | None = None) -> tuple:
        """(logits [b, vocab], tokens) of a decode batch (b <= max_batch): the graph's outputs, valid
        until its next replay; the tokens as ``HostTokens`` (the graph's own host copy) where the
        captured download works, else int64 [b] on the device. temps: each row's temperature (the
        tokens drawn at it; 0: the argmax); None: all 0, the argmax of every row."""
        b = len(hb.ids)
        size = self.bucket(b)
        width = hb.table.shape[1]
        self.fence.wait()
        q, i = self.i64.np, self.i32.np
        q[:b] = hb.ids
        q[size:size + b] = hb.positions
        q[2 * size:2 * size + b] = hb.slots
        i[:b] = hb.seq_lens
        if temps is None:
            i[size:size + b] = 0
        else:
            self.temps[size:size + b] = temps
        i[2 * size:2 * size + size * self.width].reshape(size, self.width)[:b, :width] = hb.table
        if size > b:
            self._write_padding(size, b)
        self.graphs[size].replay()
        self.fence.replayed()
        if self.stores:  # after the fence: the tokens' read-back does not wait for the store
            self.stores[size].replay()
        views = self._views.get((size, b))
        if views is None:  # (made once: a slice is a torch op, ~2-4 us of the host's time at each step)
            logits, greedy = self.outputs[size][:2]
            views = self._views[(size, b)] = (logits[:b], greedy[:b] if self.readback is None
                                              else HostTokens(self.fence, self.readback[size].np[:b]))
        return views


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, ... up to max_tokens (and max_tokens itself)."""
    out, t = [], 16
    while t < max_tokens:
        out.append(t)
        t *= 2
    return out + [max_tokens] if max_tokens > 0 else []


def seq_buckets(max_seqs: int) -> list[int]:
    """1, 4, 16, 64, ... up to max_seqs (and max_seqs itself): coarse, since a padding sequence (no
    new tokens) only costs the extend kernel a few programs that exit at once."""
    out, b = [], 1
    while b < max_seqs:
        out.append(b)
        b *= 4
    return out + [max_seqs]


class ExtendGraphs:
    """Steps whose rows run through the extend kernel -- prefills, prompt chunks, prefills beside
    decodes -- under CUDA graphs: one graph per (token bucket T, sequence bucket B), B <= T, captured
    once at start. Eager, such a step launched ~280 kernels from the host (a 30-layer model), 12 ms
    on the H200 where its GPU work is ~1-2 ms (docs/BENCHMARKS.md, nineteenth and twenty-second
    sessions). A step of t tokens over b sequences replays the smallest T >= t, B >= b: the padding
    tokens (t .. T) belong to no sequence (token 0, position 0, slot -1: nothing stored; zeros out
    of attention; their rows are computed and never read), the padding sequences (b .. B) have no
    new tokens (cu_seqlens stays at t; one key over block 0). The extend kernel's grid and tiles
    follow T (max_seqlen_q).
    Inputs through host staging (HostStaging), laid out per key: int64 [ids T | positions T | slots T |
    logits rows B] and int32 [key counts B | cu_seqlens B + 1 | tables B x width | temperatures B
    (float32 bits)]; outputs the logits of B rows (the sampling rows, then row 0 again) and their
    tokens, drawn as DecodeGraphs' are (greedy rows: the argmax), copied to the host by the graph.
    Steps with prompt log-probs run eager. ``sink``, ``eager_stand_in``, ``seed``, ``backend``: as
    DecodeGraphs'."""

    def __init__(self, model, max_seqs: int, max_tokens: int, max_blocks_per_seq: int, vocab_size: int,
                 device: torch.device, eager_stand_in: bool = False, sink=None, seed: int = 0,
                 backend: str = "torch") -> None:
        self.model, self.sink, self.vocab_size, self.width = model, sink, vocab_size, max_blocks_per_seq
        self.t_buckets, self.b_buckets = token_buckets(max_tokens), seq_buckets(max_seqs)
        self.keys = [(t, b) for t in self.t_buckets for b in self.b_buckets if b <= t]
        big_t, big_b = max(self.t_buckets), max(self.b_buckets)
        self.i64 = HostStaging(3 * big_t + big_b, torch.int64, device)
        self.i32 = HostStaging(big_b * (3 + self.width) + 1, torch.int32, device)
        self.temps = self.i32.np.view(np.float32)
        # a noise counter a logits row, keyed apart from the decode graphs': no row of each draws the other's noise
        self.sampling = GraphSampling(big_b, (seed * 0x9E3779B97F4A7C15 + 1) & 0x7FFFFFFFFFFFFFFF, backend, device)
        self.device = device
        self.readback: dict | None = {} if captured_download_ok(device) else None
        self._views: dict = {}
        self.fence = ReplayFence(device)
        self.graphs: dict = {}
        runs = {k: functools.partial(self._run, *k) for k in sorted(self.keys, key=lambda k: (-k[0], -k[1]))}
        # the warm-up runs' batch: all padding (no sequence has a token)
        self.outputs = capture_graphs(self.graphs, runs, device, eager_stand_in,
                                      prepare=lambda k: self._write_padding(*k, 0, 0, 0))

    def _run(self, t: int, b: int):
        i64, i32 = self.i64.upload(3 * t + b), self.i32.upload(b * (3 + self.width) + 1)
        slots = i64[2 * t:3 * t]
        tables = 2 * b + 1
        width = b * self.width
        meta = AttentionMetadata(slot_mapping=slots, block_tables=i32[tables:tables + width].view(b, self.width),
                                 seq_lens=i32[:b], decode=False, cu_seqlens_q=i32[b:2 * b + 1], max_seqlen_q=t,
                                 padded=True)
        hidden = self.model(i64[:t], i64[t:2 * t], meta)
        if self.sink is not None:
            self.sink(hidden, getattr(self.model.model, "aux_hidden", None), slots)
        logits = self.model.compute_logits(hidden[i64[3 * t:]])
        tokens = self.sampling.draw(logits, i32[tables + width:].view(torch.float32), self.vocab_size)
        if self.readback is not None:
            download_into(self.readback, (t, b), tokens, self.device)
        return logits, tokens

    def bucket(self, t: int, b: int) -> tuple[int, int] | None:
        """The key a step of t tokens over b sequences replays (None: none is large enough)."""
        tb = next((x for x in self.t_buckets if x >= t), None)
        bb = next((x for x in self.b_buckets if x >= b), None)
        return None if tb is None or bb is None or bb > tb else (tb, bb)

    def fits(self, hb: HostBatch) -> bool:
        return not hb.prompt_lp and self.bucket(len(hb.ids), len(hb.seq_lens)) is not None

    def _write_padding(self, tb: int, bb: int, t: int, b: int, r: int) -> None:
        """Key (tb, bb)'s layout past a step of t tokens, b sequences and r logits rows."""
        q, i, w = self.i64.np, self.i32.np, self.width
        q[t:tb] = 0
        q[tb + t:2 * tb] = 0
        q[2 * tb + t:3 * tb] = -1
        q[3 * tb + r:3 * tb + bb] = 0
        i[b:bb] = 1
        i[bb + b + 1:2 * bb + 1] = t
        i[2 * bb + 1 + b * w:2 * bb + 1 + bb * w] = 0
        i[2 * bb + 1 + bb * w + r:2 * bb + 1 + bb * w + bb] = 0  # padding logits rows: greedy, no noise
        if not b:
            i[bb] = 0

    @inference
    def replay(self, hb: HostBatch, temps: list[float] | None = None) -> tuple:
        """(logits [R, vocab], tokens) of the step's R logits rows (hb.logits_rows, which are its
        sampling rows: ``fits`` holds): the graph's outputs, valid until its next replay; the tokens
        as ``HostTokens`` where the captured download works, else int64 [R] on the device. temps:
        each logits row's temperature (0: the argmax); None: the argmax of every row."""
        t, b, r = len(hb.ids), len(hb.seq_lens), len(hb.logits_rows)
        tb, bb = self.bucket(t, b)
        self.fence.wait()
        q, i, w = self.i64.np, self.i32.np, self.width
        q[:t] = hb.ids
        q[tb:tb + t] = hb.positions
        q[2 * tb:2 * tb + t] = hb.slots
        q[3 * tb:3 * tb + r] = hb.logits_rows
        i[:b] = hb.seq_lens
        i[bb:bb + b + 1] = hb.cu_seqlens
        i[2 * bb + 1:2 * bb + 1 + bb * w].reshape(bb, w)[:b, :hb.table.shape[1]] = hb.table
        at = 2 * bb + 1 + bb * w
        if temps is None:
            i[at:at + r] = 0
        else:
            self.temps[at:at + r] = temps
        self._write_padding(tb, bb, t, b, r)
        self.graphs[(tb, bb)].replay()
        self.fence.replayed()
        views = self._views.get((tb, bb, r))
        if views is None:  # (made once: a slice is a torch op)
            logits, tokens = self.outputs[(tb, bb)]
            views = self._views[(tb, bb, r)] = (logits[:r], tokens[:r] if self.readback is None
                                                else HostTokens(self.fence, self.readback[(tb, bb)].np[:r]))
        return views


class VerifyGraphs:
    """The speculative step's verify forward (the target over B token trees of n nodes, under
    the tree mask, over the paged KV) under CUDA graphs: one graph per (batch bucket b, tree
    size n) with b * n <= max_tokens, captured once at start. The graphs output the hidden rows
    (and an EAGLE-3 target's auxiliary states) only; the caller computes the logits (one GEMM),
    so the graphs' memory stays b * n * hidden. Padding trees (rows past B): token 0, slot -1
    (nothing stored), n keys over block 0 (finite, unused), an identity mask.
    ``eager_stand_in``: as DecodeGraphs' (the plumbing on a CPU)."""

    def __init__(self, model, max_batch: int, sizes, max_tokens: int, max_blocks_per_seq: int,
                 device: torch.device, eager_stand_in: bool = False) -> None:
        self.model, self.eager_stand_in = model, eager_stand_in
        self.keys = sorted({(b, n) for n in sizes for b in graph_buckets(max_batch) if b * n <= max_tokens})
        big_b = max((b for b, _ in self.keys), default=0)
        big_t = max((b * n for b, n in self.keys), default=0)
        big_m = max((b * n * n for b, n in self.keys), default=0)
        self.ids = torch.zeros(big_t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(big_t, dtype=torch.int64, device=device)
        self.slots = torch.full((big_t,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(big_b, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(big_b, dtype=torch.int32, device=device)
        self.mask = torch.zeros(big_m, dtype=torch.bool, device=device)
        self.cu = {k: (torch.arange(k[0] + 1, device=device) * k[1]).to(torch.int32) for k in self.keys}
        self.offsets = {k: torch.arange(k[0], device=device) * (k[1] * k[1]) for k in self.keys}
        self.eye = {n: torch.eye(n, dtype=torch.bool, device=device) for _, n in self.keys}
        self.graphs: dict = {}
        self.outputs: dict[tuple[int, int], tuple] = {}  # (b, n) -> (hidden, aux or None), refilled by each replay
        self._capture(device)

    def _meta(self, b: int, n: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slots[:b * n], block_tables=self.tables[:b],
                                 seq_lens=self.seq_lens[:b], decode=False, cu_seqlens_q=self.cu[(b, n)], max_seqlen_q=n,
                                 mask=self.mask[:b * n * n], mask_offsets=self.offsets[(b, n)])

    def _run(self, b: int, n: int):
        hidden = self.model(self.ids[:b * n], self.positions[:b * n], self._meta(b, n))
        return hidden, getattr(self.model.model, "aux_hidden", None)

    def _capture(self, device) -> None:
        for b, n in self.keys:  # a valid tree for the warm-up runs: each padding tree's identity mask
            self.mask[:b * n * n].copy_(self.eye[n].expand(b, n, n).reshape(-1))
        self.seq_lens.fill_(max((n for _, n in self.keys), default=1))
        runs = {k: functools.partial(self._run, *k) for k in sorted(self.keys, key=lambda k: -k[0] * k[1])}
        self.outputs = capture_graphs(self.graphs, runs, device, self.eager_stand_in)

    def bucket(self, bsz: int, n: int) -> int | None:
        return next((b for b, m in self.keys if m == n and b >= bsz), None)

    @inference
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
            seq_lens: torch.Tensor, mask: torch.Tensor):
        """hidden [B * n, H] of B trees: tokens / positions int64 [B, n], slots int64 [B * n], tables
        int32 [B, width], seq_lens int32 [B] (keys including the tree), mask bool [B, n, n]; None
        when no graph has this n and a bucket >= B. The target's auxiliary hidden states (EAGLE-3)
        go where an eager forward leaves them, model.model.aux_hidden. The outputs are the
        graph's own: valid until the next run."""
        bsz, n = tokens.shape
        b = self.bucket(bsz, n)
        if b is None:
            return None
        t, width = bsz * n, tables.shape[1]
        self.ids[:t].copy_(tokens.reshape(-1))
        self.positions[:t].copy_(positions.reshape(-1))
        self.slots[:t].copy_(slots)
        self.tables[:bsz, :width].copy_(tables)
        self.seq_lens[:bsz].copy_(seq_lens)
        self.mask[:t * n].copy_(mask.reshape(-1))
        if b > bsz:  # padding trees
            self.ids[t:b * n].zero_()
            self.positions[t:b * n].zero_()
            self.slots[t:b * n].fill_(-1)
            self.tables[bsz:b].zero_()
            self.seq_lens[bsz:b].fill_(n)
            self.mask[t * n:b * n * n].copy_(self.eye[n].expand(b - bsz, n, n).reshape(-1))
        self.graphs[(b, n)].replay()
        hidden, aux = self.outputs[(b, n)]
        self.model.model.aux_hidden = None if aux is None else aux[:t]
        return hidden[:t]
