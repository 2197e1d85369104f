"""The host time of a whole ``generate`` call outside the model runner -- scheduling, the engine's
bookkeeping, the speculator's plan and policy -- for a plain engine and a draft engine whose
adaptive policy keeps speculation off (a cost table under which no tree can win: the case of
sampled requests with a draft that accepts little, where the draft engine should cost what the
plain one does). The same split as ``optllm eval``'s time table ("host": the call's wall time less
the runner's). Runs on any machine: the runner's graphs are CPU stand-ins, switched off while
timing (on a GPU no model runs on the host either), so "runner" is its host part alone.

    python benchmarks/generate_host.py --model DIR --draft DIR [--batch 1] [--temperature 1]
        [--tokens 128] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tree-ms", type=float, default=100.0,
                    help="every tree's step cost against a plain step's 1 (100: no tree can ever win, the policy "
                         "never explores; 2.5: a tree could win only with most drafts accepted, as sampled "
                         "requests' trees on the H100, so the policy explores now and then)")
    a = ap.parse_args()
    from common import stub_graph_replays

    from optllm import LLM, SamplingParams
    from optllm.runtime.spec.policy import CostTable

    kw = dict(model=a.model, device="cpu", dtype="float32", max_num_seqs=max(a.batch, 2))
    engines = {"plain": LLM(**kw), "draft, speculation off": LLM(**kw, draft=a.draft, spec_policy="adaptive",
                                                                spec_num_draft=20, spec_top_k=8, spec_depth=5)}
    prompts = [[10 + (7 * i + j) % 200 for j in range(20)] for i in range(a.batch)]
    params = SamplingParams(temperature=a.temperature, max_tokens=a.tokens, ignore_eos=True, detokenize=False)
    print(f"batch {a.batch}, temperature {a.temperature:g}, {a.tokens} tokens a request, median of {a.rounds} calls\n")
    print("| engine | generate ms | runner ms | host ms | host µs a step | speculative steps |")
    print("|---|---|---|---|---|---|")
    for name, llm in engines.items():
        r = llm.engine.runner
        r.make_graphs(max(a.batch, 2), eager_stand_in=True)
        if r.spec is not None:
            pol = r.spec.policy
            pol.cost = CostTable(pol.cost.batches, {n: [1.0 if n == 1 else a.tree_ms + 1e-3 * n] * len(pol.cost.batches)
                                                    for n in pol.cost.ms})
            # the CPU stand-ins' step times mean nothing as costs: the ratios learn the table's own
            pol.observe_cost = lambda n, b, ms, f=pol.observe_cost, c=pol.cost: f(n, b, c.cost(n, b))
        llm.generate(prompts, params)  # warm-up, with the stand-ins' real outputs
        stub_graph_replays(llm)
        spec0 = r.spec.stats.steps if r.spec is not None else 0
        total, runner, steps = [], [], 0
        for _ in range(a.rounds):
            ms0, n0 = r.exec_ms, r.exec_steps
            t = time.perf_counter()
            llm.generate(prompts, params)
            total.append((time.perf_counter() - t) * 1e3)
            runner.append(r.exec_ms - ms0)
            steps = r.exec_steps - n0
        gen, run = statistics.median(total), statistics.median(runner)
        spec = (r.spec.stats.steps - spec0) if r.spec is not None else 0
        print(f"| {name} | {gen:.2f} | {run:.2f} | {gen - run:.2f} | {1e3 * (gen - run) / steps:.1f} | {spec} |",
              flush=True)


if __name__ == "__main__":
    main()
