"""The host time of a draft engine's plain decode steps while its adaptive policy keeps speculation
off (a dormant draft), against a draft-less engine's, step by step and split by phase: the H100's
temperature-1 runs measured +21-32 µs a step of host time outside the runner in the draft engine.

Both engines: the tests' tiny random Llama (and an EAGLE-3 draft for it, written once under --root),
on the CPU, with the runner's graphs as CPU stand-ins that are switched off after a warm-up (each
replay does nothing, its outputs keep their last values): what is timed is host code only, the
same in both engines but for what the draft adds. Requests at temperature 1 (EOS ignored, no
detokenizing, generate's non-streamed outputs, as ``optllm eval``'s runs). Engines alternate
round by round; per round, each decode step's wall time is split into the scheduler's schedule()
(the speculator's plan() apart), the runner's execute(), update(), and the rest of engine.step
(the engine's bookkeeping, the draft engine's step timing and observe_step). Reported: per batch
size and engine, the median over rounds of each part's mean µs a decode step, and the difference.

--mode never: a cost table under which no tree can ever win (choose() skips every size);
--mode lose (default): trees could win if every draft token were accepted, the sequences'
estimates say they do not, and exploration is off -- the H100's case (the sums and their
relaxation computed on each scan) without a speculative step.

    python benchmarks/dormant_draft_host.py [--batches 1,8,32,64] [--tokens 256] [--rounds 7]
        [--mode lose|never] [--profile B]     # --profile: cProfile of both engines' decode steps at batch B
        [--continuous]                        # eval's continuous load (the H100: +34% host at batch 64)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import stub_graph_replays  # noqa: E402

from optllm.eval.speculation import spread_lengths  # noqa: E402
from optllm.runtime.sampling_params import SamplingParams  # noqa: E402

PARTS = ("step", "outside", "schedule", "plan", "execute", "update", "rest")


def models(root: Path) -> tuple[Path, Path]:
    target, draft = root / "llama", root / "eagle3"
    if not (draft / "config.json").is_file():
        from conftest import make_tiny_model, write_draft

        root.mkdir(parents=True, exist_ok=True)
        make_tiny_model(target)
        write_draft(draft, target, "eagle3", seed=2, noise=0.3, draft_vocab=150)
    return target, draft


def dormant(llm, mode: str) -> None:
    """The draft engine's adaptive policy made to keep speculation off, its decisions made as in service."""
    from optllm.runtime.spec.policy import CostTable

    pol = llm.engine.runner.spec.policy
    tree_ms = 1e3 if mode == "never" else 3.0  # "lose": a tree of depth 5 could win if all were accepted
    pol.cost = CostTable(pol.cost.batches, {n: [1.0 if n == 1 else tree_ms + 1e-3 * n] * len(pol.cost.batches)
                                            for n in pol.cost.ms})
    # the CPU stand-ins' step times mean nothing as costs: the ratio updates run on the table's own times
    pol.observe_cost = lambda n, b, ms, f=pol.observe_cost, c=pol.cost: f(n, b, c.cost(n, b))
    pol._global = {n: 0.3 for n in pol.sizes}  # far below what a tree needs to win at 3 plain steps' cost
    pol._G[1] = pol._G[0]  # (the sampled class too)
    pol.explore_budget = 1e-12  # never explores: every step a plain one


class Timer:
    """Wraps an engine's step, schedule, plan, execute and update with perf_counter brackets (the same
    wrappers in both engines); ``steps`` collects each decode step's parts in µs."""

    def __init__(self, llm, every: bool = False) -> None:
        eng = self.eng = llm.engine
        self.steps: list[dict] = []
        self.cur: dict = {}
        self.on = False
        pc = time.perf_counter

        def wrap(obj, name, key):
            f = getattr(obj, name)

            def timed(*a, _f=f, _key=key):
                t = pc()
                out = _f(*a)
                self.cur[_key] = self.cur.get(_key, 0.0) + pc() - t
                return out
            setattr(obj, name, timed)

        wrap(eng.scheduler, "schedule", "schedule")
        wrap(eng.runner, "execute", "execute")
        wrap(eng.scheduler, "update", "update")
        if eng.runner.spec is not None:
            wrap(eng.runner.spec, "plan", "plan")
        ex = eng.runner.execute

        def tag(batch, _ex=ex):  # every: all steps timed (a continuous load's admissions too)
            self.cur["decode"] = every or batch.decode_only
            return _ex(batch)
        eng.runner.execute = tag
        step = eng.step

        def timed_step(_step=step):
            self.cur = {}
            t = pc()
            out = _step()
            t = pc() - t
            c = self.cur
            if self.on and c.get("decode"):
                s = {k: 1e6 * c.get(k, 0.0) for k in ("schedule", "plan", "execute", "update")}
                s["step"] = 1e6 * t
                s["outside"] = s["step"] - s["execute"]
                s["schedule"] -= s["plan"]
                s["rest"] = s["outside"] - s["schedule"] - s["plan"] - s["update"]
                self.steps.append(s)
            return out
        eng.step = timed_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/dormant_draft_models"))
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--tokens", type=int, default=256)  # the tiny model: 1.5x + 84 within its 512 positions
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--mode", choices=["lose", "never"], default="lose")
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--control", action="store_true", help="a second plain engine in the draft engine's place "
                    "(an A/A run: the measurement's own noise and order effects)")
    ap.add_argument("--continuous", action="store_true", help="as eval's continuous load: 3 x batch requests of "
                    "lengths spread over 0.5-1.5x --tokens, at most batch running, admitted in groups of 8; every "
                    "step timed (admissions too), engines built per batch size")
    a = ap.parse_args()
    from optllm import LLM

    target, draft = models(a.root)
    batches = [int(b) for b in a.batches.split(",")]
    most = max(batches + [a.profile])
    kw = dict(model=str(target), device="cpu", dtype="float32", max_num_seqs=most,
              max_model_len=max(spread_lengths(2, a.tokens)) + 84, enable_prefix_caching=False)

    def build(most: int, **extra) -> tuple[dict, dict]:
        args = kw | {"max_num_seqs": most} | extra
        engines = {"plain": LLM(**args), "draft": LLM(**args) if a.control else LLM(**args, draft=str(draft),
                                                                                     spec_policy="adaptive")}
        if not a.control:
            dormant(engines["draft"], a.mode)
        timers = {}
        for name, llm in engines.items():
            llm.engine.runner.make_graphs(most, eager_stand_in=True)
            timers[name] = Timer(llm, every=a.continuous)
            llm.generate([[10 + j for j in range(20)]] * 2, SamplingParams(temperature=1.0, max_tokens=4))  # warm-up
            stub_graph_replays(llm)
        return engines, timers

    params = SamplingParams(temperature=1.0, max_tokens=a.tokens, ignore_eos=True, detokenize=False)
    if a.profile:
        profile(build(most)[0], a.profile, params, a.continuous)
        return
    print(f"mode {a.mode}, temperature 1, {a.tokens} tokens a request"
          + (" (continuous: 3 x batch requests, 0.5-1.5x that)" if a.continuous else "")
          + f", median over {a.rounds} rounds of each part's mean µs a {'' if a.continuous else 'decode '}step\n")
    print("| batch | engine | " + " | ".join(PARTS) + " | steps | spec steps | gc runs |")
    print("|---|---|" + "---|" * len(PARTS) + "---|---|---|")
    engines, timers = (None, None) if a.continuous else build(most)
    for bs in batches:
        if a.continuous:
            engines, timers = build(bs, admit_group=8)
        prompts, params = load(bs, a.tokens, a.continuous)
        per: dict[str, dict[str, list[float]]] = {n: {p: [] for p in PARTS} for n in engines}
        counts = {n: [0, 0, 0] for n in engines}
        for llm in engines.values():
            llm.generate(prompts, params)  # warm-up at this batch
        for _ in range(a.rounds):
            for name, llm in engines.items():
                t, spec = timers[name], llm.engine.runner.spec
                t.steps.clear()
                s0 = spec.stats.steps if spec is not None else 0
                g0 = sum(s["collections"] for s in gc.get_stats())
                t.on = True
                llm.generate(prompts, params)
                t.on = False
                counts[name][0] = len(t.steps)
                counts[name][1] += (spec.stats.steps - s0) if spec is not None else 0
                counts[name][2] += sum(s["collections"] for s in gc.get_stats()) - g0
                for p in PARTS:
                    per[name][p].append(statistics.fmean(s[p] for s in t.steps))
        med = {n: {p: statistics.median(v) for p, v in d.items()} for n, d in per.items()}
        for name in engines:
            print(f"| {bs} | {name} | " + " | ".join(f"{med[name][p]:.1f}" for p in PARTS)
                  + f" | {counts[name][0]} | {counts[name][1]} | {counts[name][2]} |")
        print(f"| {bs} | **draft - plain** | " + " | ".join(f"{med['draft'][p] - med['plain'][p]:+.1f}" for p in PARTS)
              + " | | | |", flush=True)


def load(bs: int, tokens: int, continuous: bool) -> tuple[list, object]:
    """A round's requests at batch bs: bs prompts of `tokens` tokens each, or (continuous) 3 x bs
    prompts whose lengths spread over 0.5-1.5x tokens (eval's continuous load)."""
    n = 3 * bs if continuous else bs
    prompts = [[10 + (7 * i + j) % 200 for j in range(20)] for i in range(n)]
    base = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    if not continuous:
        return prompts, base
    return prompts, [dataclasses.replace(base, max_tokens=m) for m in spread_lengths(n, tokens)]


def profile(engines, bs: int, params, continuous: bool = False) -> None:
    """cProfile of each engine's decode steps at batch bs: the functions whose own time differs most."""
    import cProfile
    import pstats

    prompts, params = load(bs, params.max_tokens, continuous)
    own = {}
    for name, llm in engines.items():
        llm.generate(prompts, params)
        prof = cProfile.Profile()
        steps0 = llm.engine.runner.exec_steps
        prof.enable()
        for _ in range(3):
            llm.generate(prompts, params)
        prof.disable()
        steps = llm.engine.runner.exec_steps - steps0
        st = pstats.Stats(prof).stats
        own[name] = {f"{Path(f).name}:{ln}({fn})": (1e6 * tt / steps, nc / steps)
                     for (f, ln, fn), (_cc, nc, tt, _ct, _c) in st.items()}
    keys = set(own["plain"]) | set(own["draft"])
    diff = sorted(keys, key=lambda k: -abs(own["draft"].get(k, (0, 0))[0] - own["plain"].get(k, (0, 0))[0]))
    print(f"batch {bs}: own µs a step (calls a step), draft vs plain, largest differences\n")
    for k in diff[:30]:
        d, p = own["draft"].get(k, (0.0, 0.0)), own["plain"].get(k, (0.0, 0.0))
        print(f"{d[0] - p[0]:+8.2f}  draft {d[0]:7.2f} ({d[1]:.2f})  plain {p[0]:7.2f} ({p[1]:.2f})  {k}")


if __name__ == "__main__":
    main()
