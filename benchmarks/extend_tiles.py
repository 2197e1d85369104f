"""The extend-attention kernel's tiles at token-tree verification sizes (issue 15: the 41-node
speculative step profiled 0.42 ms over the 20-node one at batch 1 on the H100, all of it in
`_extend_kernel`: 17.7 µs a call against 5.8).

A tree of n nodes over a context of C keys, B sequences, SmolLM2's heads (9 query, 3 kv, d 64) by
default. Each cell: median µs of a CUDA-graph replay (graph_us) of `paged_extend_attention` with
the tree mask, at the tile config (BLOCK_M rows, BLOCK_N keys, warps, stages) of its column;
"rule" is what `extend_tiles` and `extend_num_splits` pick; the kS columns (--splits) time the rule's tiles with
the key range cut into S runs (merged by the combine kernel). Every config's output is checked against the rule's (max
relative error, printed per row) so that a config that computes wrong is not timed as a win.

    python benchmarks/extend_tiles.py [--trees 5,10,20,25,41,61,81] [--batches 1,8,64] [--ctx 256]
        [--tiles 128x128w8s3,64x64w4s2,...] [--splits 1,4,16] [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_us, provenance, write_results  # noqa: E402

from optllm.kernels import extend_attention as ea  # noqa: E402
from optllm.runtime.spec.tree import TokenTree  # noqa: E402

TILES = "128x128w8s3,128x64w8s2,64x64w4s2,64x64w4s3,32x64w4s2,64x32w4s2,32x32w2s2"


def parse_tiles(csv: str) -> list[tuple[int, int, int, int]]:
    """'128x128w8s3,...' -> [(128, 128, 8, 3), ...]; one clear error for anything else."""
    out = []
    for t in csv.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", t.strip())
        if not m:
            raise SystemExit(f"--tiles: {t!r} is not MxNwWsS (e.g. 64x64w4s2: 64 rows, 64 keys, 4 warps, 2 stages)")
        bm, bn, w, s = map(int, m.groups())
        if bm & (bm - 1) or bn & (bn - 1) or bm < 16 or bn < 16 or w not in (1, 2, 4, 8) or s < 1:
            raise SystemExit(f"--tiles: {t!r}: rows and keys powers of two >= 16, warps 1/2/4/8, stages >= 1")
        out.append((bm, bn, w, s))
    return out


def tile_name(t) -> str:
    """(BLOCK_M, BLOCK_N, warps, stages) -> the MxNwWsS spec parse_tiles reads."""
    return "%dx%dw%ds%d" % tuple(t)


def ancestor_mask(n: int, g: torch.Generator) -> torch.Tensor:
    """[n, n] bool: node i sees itself and its ancestors (a random tree: each node's parent before it)."""
    return TokenTree(tuple([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])).attention_mask()


def case(bsz: int, n: int, ctx: int, hkv: int, group: int, d: int, bs: int, width: int, seed: int):
    """Inputs of one verify forward: B sequences of ctx cached keys plus an n-node tree each."""
    g = torch.Generator().manual_seed(seed)
    blocks = bsz * width + 1
    kc = torch.randn(blocks, hkv, bs, d, generator=g).to("cuda", torch.bfloat16)
    vc = torch.randn(blocks, hkv, bs, d, generator=g).to("cuda", torch.bfloat16)
    bt = torch.randperm(blocks - 1, generator=g)[:bsz * width].view(bsz, width).int().cuda()
    seq_lens = torch.full((bsz,), ctx + n, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, (bsz + 1) * n, n, dtype=torch.int32, device="cuda")
    q = torch.randn(bsz * n, hkv * group, d, generator=g).to("cuda", torch.bfloat16)
    mask = torch.cat([ancestor_mask(n, g).flatten() for _ in range(bsz)]).cuda()
    offsets = torch.arange(0, bsz * n * n, n * n, dtype=torch.int64, device="cuda")
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, seq_lens=seq_lens, cu_seqlens_q=cu,
                max_seqlen_q=n, scale=d ** -0.5, mask=mask, mask_offsets=offsets)


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run(c: dict, out: torch.Tensor, splits=None) -> torch.Tensor:
    return ea.paged_extend_attention(c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["seq_lens"],
                                     c["cu_seqlens_q"], c["max_seqlen_q"], c["scale"], mask=c["mask"],
                                     mask_offsets=c["mask_offsets"], num_splits=splits, out=out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="5,10,20,25,41,61,81")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--ctx", type=int, default=256, help="cached keys before the tree")
    ap.add_argument("--heads", default="3x3x64", help="kv heads x group x head_dim (SmolLM2: 3x3x64)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--width", type=int, default=128, help="block-table columns (max_model_len / block size)")
    ap.add_argument("--tiles", default=TILES)
    ap.add_argument("--splits", default="1", help="key splits to time at the rule's tiles (none: '')")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    tiles = parse_tiles(a.tiles)
    try:
        trees = [int(t) for t in a.trees.split(",")]
        batches = [int(b) for b in a.batches.split(",")]
        hkv, group, d = (int(x) for x in a.heads.split("x"))
        splits = [int(v) for v in a.splits.split(",") if v]
    except ValueError:
        raise SystemExit("--trees, --batches, --splits: comma-separated integers; --heads: KVxGROUPxDIM (e.g. 3x3x64)")
    if any(v < 1 for v in splits):
        raise SystemExit(f"--splits {a.splits}: each split count must be >= 1")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/extend_tiles.py needs a CUDA GPU")
    if (a.ctx + max(trees)) > a.width * a.block_size:
        raise SystemExit(f"--ctx {a.ctx} + tree {max(trees)} keys do not fit --width {a.width} x --block-size "
                         f"{a.block_size}")
    rule = ea.extend_tiles
    rows = []
    for bsz in batches:
        for n in trees:
            c = case(bsz, n, a.ctx, hkv, group, d, a.block_size, a.width, seed=1000 * bsz + n)
            ref_out = torch.zeros_like(c["q"])
            run(c, ref_out)
            picked = rule(n, group, d, 2)
            rule_us = round(graph_us(lambda: run(c, ref_out)), 2)
            row = dict(batch=bsz, tree=n, ctx=a.ctx, rule=list(picked), rule_us=rule_us, tiles={}, splits={},
                       rule_splits=ea.extend_num_splits(-(-n // (picked[0] // group)), bsz, hkv, n * group,
                                                        a.width * a.block_size, picked[1],
                                                        ea.sm_count(c["q"].device)))
            for sp in splits:
                o = torch.zeros_like(c["q"])
                run(c, o, sp)
                us = graph_us(lambda: run(c, o, sp))
                row["splits"][f"k{sp}"] = dict(us=round(us, 2), err=max_rel_err(o, ref_out))
            for t in tiles:
                if t[0] < group:
                    continue
                ea.extend_tiles = lambda *args, t=t: t
                try:  # one split: the tiles alone
                    o = torch.zeros_like(c["q"])
                    run(c, o, 1)
                    err = max_rel_err(o, ref_out)
                    us = graph_us(lambda: run(c, o, 1))
                finally:
                    ea.extend_tiles = rule
                row["tiles"][tile_name(t)] = dict(us=round(us, 2), err=err)
            rows.append(row)
            cells = {**row["tiles"], **row["splits"]}
            best = min(cells.items(), key=lambda kv: kv[1]["us"])
            print(f"batch {bsz} tree {n}: rule {picked} k{row['rule_splits']} {row['rule_us']} us; best {best[0]} "
                  f"{best[1]['us']} us; max err {max(v['err'] for v in cells.values()):.1e}", flush=True)
    names = [f"k{sp}" for sp in splits] + [tile_name(t) for t in tiles]
    md = ["| batch | tree | rule (tiles, splits) | rule µs | " + " | ".join(names) + " |",
          "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = {**r["splits"], **r["tiles"]}
        md.append(f"| {r['batch']} | {r['tree']} | {tile_name(r['rule'])} k{r['rule_splits']} | **{r['rule_us']}** | "
                  + " | ".join(str(cells.get(k, {}).get("us", "–")) for k in names) + " |")
    table = "\n".join(md)
    print(table)
    write_results(a.out, "extend_tiles", table, dict(provenance=provenance(), heads=a.heads, ctx=a.ctx, rows=rows))


if __name__ == "__main__":
    main()
