"""The torch operations a graphed decode step makes on the host, around its graph replay: each one is a
dispatcher call, and on a GPU a kernel launch or a copy, ~10-20 µs of the H200 host's time apiece
(docs/BENCHMARKS.md). Runs on any machine: the runner's graphs are CPU stand-ins whose replay is
switched off while counting, so only what the host does around the replay is counted (the tokens are
then nonsense; the count does not depend on them). Uses only the public engine API and the graphs'
``replay``, so the same script counts two code trees (run it with each on PYTHONPATH).

    python benchmarks/step_host_ops.py --model DIR --draft DIR [--batches 1,8] [--tree 5]

Per batch: aten ops a step for a plain engine and for a draft engine with every step a speculative
one (the fixed policy), greedy; the most frequent ops.
"""

from __future__ import annotations

import argparse
import collections

from torch.utils._python_dispatch import TorchDispatchMode


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _silence(graphs: dict) -> None:
    """Stand-in graphs whose replay does nothing (their outputs keep the capture's values)."""
    for g in graphs.values():
        g.replay = lambda: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tree", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    from optllm import LLM, SamplingParams

    batches = [int(b) for b in a.batches.split(",")]
    params = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True, detokenize=False)
    kw = dict(model=a.model, device="cpu", dtype="float32", max_num_seqs=max(batches))
    engines = {"plain": LLM(**kw),
               f"trees of {a.tree}": LLM(**kw, draft=a.draft, spec_policy="fixed", spec_num_draft=a.tree,
                                         spec_top_k=2, spec_depth=3)}
    print("| batch | engine | aten ops a step | steps | most frequent |\n|---|---|---|---|---|")
    for name, llm in engines.items():
        r = llm.engine.runner
        r.make_graphs(max(batches), eager_stand_in=True)
        _silence(r.graphs.graphs)
        if r.spec is not None and r.spec.graphs is not None:
            _silence(r.spec.graphs.graphs)
        for bs in batches:
            prompts = [[10 + (7 * i + j) % 200 for j in range(20)] for i in range(bs)]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
            # count the decode steps only: the prompts are prefilled in the first step
            seen = []
            execute = r.execute

            def counted(batch, seen=seen, execute=execute):
                if batch.decode_only:
                    with Count() as c:
                        out = execute(batch)
                    seen.append(c.ops)
                    return out
                return execute(batch)

            r.execute = counted
            llm.generate(prompts, params)
            r.execute = execute
            total = collections.Counter()
            for c in seen:
                total.update(c)
            steps = len(seen)
            top = ", ".join(f"{k} {v / steps:.1f}" for k, v in total.most_common(6))
            print(f"| {bs} | {name} | {sum(total.values()) / steps:.1f} | {steps} | {top} |", flush=True)


if __name__ == "__main__":
    main()
