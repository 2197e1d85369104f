"""Does a CUDA graph's launch get dearer when the process holds more captured graphs? (issue 15:
with a draft loaded and speculation off, the H200 profile showed the same decode graph -- 316
kernels against 312 -- costing 0.65 ms of host time in cudaGraphLaunch against 0.41 ms without
the draft, whose engine also captures one speculative-step graph per batch bucket and tree size.)

One graph of CHAIN small kernels is timed (host time of replay(), and replay + synchronize) alone,
then again after capturing EXTRA more graphs of the same shape, from one shared memory pool as
the runtime's graphs are, and after capturing them each from a pool of its own.

    python benchmarks/graph_launch_cost.py [--chain 312] [--extra 0,16,64,256] [--extra-chain 1000]
"""

from __future__ import annotations

import argparse

import torch

from optllm.benchmarks.common import replay_us


def capture(chain: int, pool=None):
    x = torch.zeros(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm up outside the graph
            y = x
            for _ in range(chain):
                y = y + 1.0
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g, pool=pool):
        y = x
        for _ in range(chain):
            y = y + 1.0
    return g, (x, y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chain", type=int, default=312, help="kernels in each graph (a plain decode step: 312)")
    ap.add_argument("--extra", default="0,16,64,256", help="more graphs captured before each measurement")
    ap.add_argument("--extra-chain", type=int, default=1000,
                    help="kernels in each of the other graphs (a speculative step: ~1000)")
    a = ap.parse_args()
    rows = []
    for shared in (True, False):
        pool = torch.cuda.graph_pool_handle() if shared else None
        g, keep = capture(a.chain, pool)
        held = []
        have = 0
        for extra in [int(e) for e in a.extra.split(",")]:
            while have < extra:
                held.append(capture(a.extra_chain, pool if shared else None))
                have += 1
            replay_us(g, 20)
            host, full = replay_us(g)
            rows.append((shared, extra, host, full))
            print(f"shared pool {shared}, {extra} more graphs: replay host {host:.1f} us, with sync {full:.1f} us",
                  flush=True)
        del held, g, keep
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print(f"| pools | graphs besides it | replay() host µs | replay + sync µs | "
          f"({a.chain} kernels in the timed graph, "
          f"{a.extra_chain} in each other)")
    print("|---|---|---|---|")
    for shared, extra, host, full in rows:
        print(f"| {'one shared' if shared else 'one each'} | {extra} | {host:.1f} | {full:.1f} |")


if __name__ == "__main__":
    main()
