"""benchmarks/extend_tiles.py's own parts on the CPU: the tile specs it accepts and refuses in one line, and the
trees it times (each node sees itself and its ancestors only)."""

from __future__ import annotations

import pytest
import torch

from optllm.benchmarks import extend_tiles


def test_tile_specs_parse_and_bad_ones_are_one_line():
    assert extend_tiles.parse_tiles("128x128w8s3, 64x32w4s2") == [(128, 128, 8, 3), (64, 32, 4, 2)]
    tiles = extend_tiles.parse_tiles(extend_tiles.TILES)
    assert len(tiles) == 7 and ",".join(map(extend_tiles.tile_name, tiles)) == extend_tiles.TILES
    for bad in ("64x64", "64x64w4", "48x64w4s2", "64x64w3s2", "64x8w4s2", "64x64w4s0"):
        with pytest.raises(SystemExit) as e:
            extend_tiles.parse_tiles(bad)
        assert str(e.value).startswith("--tiles:") and "\n" not in str(e.value)


def test_trees_are_ancestor_masks():
    g = torch.Generator().manual_seed(3)
    m = extend_tiles.ancestor_mask(30, g)
    assert m.shape == (30, 30) and m.diagonal().all() and m[:, 0].all()  # the root: every node's ancestor
    assert not m.triu(1).any()  # parents come before their children
    for i in range(1, 30):  # a node's ancestors are its parent's plus the parent itself
        parent = max(j for j in range(i) if m[i, j])
        assert torch.equal(m[i, :i], m[parent, :i] | (torch.arange(i) == parent))
