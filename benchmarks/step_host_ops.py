"""What a graphed decode step costs the host, around its graph replay: the torch operations it makes
(each a dispatcher call, and on a GPU a kernel launch or a copy, ~10-20 µs of the H200 host's time
apiece, docs/BENCHMARKS.md) and the host time of a whole engine step (scheduling, inputs, the
read-back's bookkeeping, the outputs) with the replay's own time taken out. Runs on any machine: the
runner's graphs are CPU stand-ins whose replays are timed and subtracted (and switched off while
the ops are counted). Uses only the public engine API and the graphs' ``replay``, so the same
script measures two code trees (run it with each on PYTHONPATH).

    python benchmarks/step_host_ops.py --model DIR --draft DIR [--batches 1,8,64] [--tree 5]
        [--policy fixed|adaptive|adaptive-plain] [--top-k 2 --depth 3] [--host-only] [--temperature T]

Per batch, for a plain engine and for a draft engine whose every step speculates (trees of --tree
nodes), greedy (--temperature T: every request sampled at T alone), EOS ignored: aten ops a decode
step, median and mean (the mean takes in the catch-up steps after a prefill, eager), the most
frequent, and the median host µs of an engine step whose batch is all decodes (and how many steps
were timed, how many of them speculative).
--policy fixed: the fixed policy's trees. --policy adaptive: the adaptive policy runs as in
service (its choice, its per-size observations, its cost ratios, fed the table's own times: the
stand-ins' step times mean nothing) on a cost table that makes the largest tree win every step,
so its host work is in each step.
--policy adaptive-plain: the adaptive policy on a cost table under which no tree can win, so every
step is a plain one as the policy runs it (a busy server's case: the draft engine's plain steps
beside the plain engine's).
--host-only: the host µs with the replays switched off during the timed rounds (no stand-in model
runs between the host's parts, as on a GPU none runs on the host), median of 3 rounds' steps.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Replays:
    """Wraps each stand-in graph's replay: its time is summed into ``seconds``; ``on`` False makes it
    do nothing (its outputs keep their last values)."""

    def __init__(self) -> None:
        self.seconds, self.on = 0.0, True

    def wrap(self, graphs: dict) -> None:
        for g in graphs.values():
            def replay(run=g.replay):
                if self.on:
                    t = time.perf_counter()
                    run()
                    self.seconds += time.perf_counter() - t
            g.replay = replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--tree", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--policy", choices=["fixed", "adaptive", "adaptive-plain"], default="fixed")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--host-only", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (0: greedy)")
    ap.add_argument("--profile", action="store_true", help="with --host-only: cProfile of the timed rounds, "
                    "per engine and batch, the functions by own time and ours by cumulative time, µs a step")
    a = ap.parse_args()
    from optllm import LLM, SamplingParams
    from optllm.runtime.spec.policy import CostTable

    batches = [int(b) for b in a.batches.split(",")]
    params = SamplingParams(temperature=a.temperature, max_tokens=a.tokens, ignore_eos=True, detokenize=False)
    kw = dict(model=a.model, device="cpu", dtype="float32", max_num_seqs=max(batches))
    spec_name = f"trees of {a.tree}" + ("" if a.policy == "fixed" else f", {a.policy}")
    engines = {"plain": LLM(**kw),
               spec_name: LLM(**kw, draft=a.draft, spec_policy=a.policy.split("-")[0], spec_num_draft=a.tree,
                              spec_top_k=a.top_k, spec_depth=a.depth)}
    print("| batch | engine | aten ops a decode step: median (mean) | host µs a decode step | steps timed "
          "| most frequent ops |\n|---|---|---|---|---|---|")
    for name, llm in engines.items():
        r, eng = llm.engine.runner, llm.engine
        r.make_graphs(max(batches), eager_stand_in=True)
        replays = Replays()
        replays.wrap(r.graphs.graphs)
        if r.spec is not None and r.spec.graphs is not None:
            replays.wrap(r.spec.graphs.graphs)
        if r.spec is not None and r.spec.policy is not None:
            pol, big = r.spec.policy, max(r.spec.sizes)
            # adaptive: every tree cheaper than a plain step, the policy picks the largest at each step;
            # adaptive-plain: every tree 100 plain steps
            plain_ms, tree_ms = (10.0, 1.0) if a.policy == "adaptive" else (1.0, 100.0)
            pol.cost = CostTable(pol.cost.batches, {n: [plain_ms if n == 1 else tree_ms + 1e-3 * n]
                                                    * len(pol.cost.batches) for n in pol.cost.ms})
            # the engine's measured step times here are the CPU stand-ins' (meaningless as costs):
            # the policy's ratio updates still run, on the table's own times
            pol.observe_cost = lambda n, b, ms, f=pol.observe_cost, c=pol.cost: f(n, b, c.cost(n, b))
            pol._global = {n: float(n - 1) for n in pol._global}
            assert big in pol.sizes
        for bs in batches:
            prompts = [[10 + (7 * i + j) % 200 for j in range(20)] for i in range(bs)]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
            decode = []  # whether the runner's last batch was all decodes
            execute = r.execute

            def tagged(batch, execute=execute, decode=decode):
                decode.append(batch.decode_only)
                return execute(batch)

            r.execute = tagged
            step = eng.step
            host: list[float] = []

            def timed(step=step, host=host, decode=decode):
                replays.seconds = 0.0
                t = time.perf_counter()
                out = step()
                t = time.perf_counter() - t
                if decode and decode[-1]:
                    host.append(1e6 * (t - replays.seconds))
                decode.clear()
                return out

            eng.step = timed
            if a.host_only:
                llm.generate(prompts, params)  # the stand-in outputs of real steps
                host.clear()
                replays.on = False
                spec0 = r.spec.stats.steps if r.spec is not None else 0
                prof = _profiler(a.profile)
                for _ in range(3):
                    llm.generate(prompts, params)
                replays.on = True
                if prof is not None:
                    prof.disable()
                    _report(prof, f"{name}, batch {bs}", len(host))
                spec_steps = r.spec.stats.steps - spec0 if r.spec is not None else 0
            else:
                spec0 = r.spec.stats.steps if r.spec is not None else 0
                llm.generate(prompts, params)
                spec_steps = r.spec.stats.steps - spec0 if r.spec is not None else 0
            # the ops, with the replays off (the tokens are then nonsense: the count does not depend on them)
            seen = []

            def counted(batch, execute=execute, seen=seen):
                if not batch.decode_only:
                    return execute(batch)
                with Count() as c:
                    out = execute(batch)
                seen.append(c.ops)
                return out

            r.execute, replays.on = counted, False
            llm.generate(prompts, params)
            r.execute, replays.on, eng.step = execute, True, step
            total = collections.Counter()
            for c in seen:
                total.update(c)
            top = ", ".join(f"{k} {v / len(seen):.1f}" for k, v in total.most_common(5))
            ops = statistics.median(sum(c.values()) for c in seen)
            mean = sum(total.values()) / len(seen)
            print(f"| {bs} | {name} | {ops:.0f} ({mean:.1f}) | {statistics.median(host):.0f} | {len(host)} "
                  f"({spec_steps} speculative) | {top} |", flush=True)


def _profiler(on: bool):
    if not on:
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _report(prof, title: str, steps: int, top: int = 25) -> None:
    import pstats

    st = pstats.Stats(prof).stats
    rows = [(f"{Path(f).name}:{ln}({fn})", 1e6 * tt / steps, 1e6 * ct / steps, nc / steps)
            for (f, ln, fn), (_cc, nc, tt, ct, _c) in st.items()]
    print(f"\n{title}: own µs a step (calls a step)")
    for k, own, _cum, n in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"{own:8.2f} ({n:6.2f})  {k}")
    print(f"\n{title}: ours by cumulative µs a step")
    ours = [r for r in rows if "/optllm/" in r[0] or not r[0].startswith("~")]
    for k, _own, cum, n in sorted(ours, key=lambda r: -r[2])[:top]:
        print(f"{cum:8.2f} ({n:6.2f})  {k}")
    print(flush=True)


if __name__ == "__main__":
    main()
