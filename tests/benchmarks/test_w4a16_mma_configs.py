"""benchmarks/w4a16_mma.py's config names: each name the sweeps use parses to the config it says and
prints back as itself; a name the kernel would refuse exits with the kernel's reason."""

from __future__ import annotations

import pytest

from optllm.benchmarks.w4a16_mma import cname, parse_config
from optllm.kernels import w4a16_mma as mk


@pytest.mark.parametrize("name,cfg", [
    ("8x2s", mk.MmaConfig(8, 2, offset_mma=False)),
    ("8x2sp", mk.MmaConfig(8, 2, offset_mma=False, xpre=True)),
    ("4x2s", mk.MmaConfig(4, 2, offset_mma=False)),
    ("8x2st2", mk.MmaConfig(8, 2, offset_mma=False, tiles=2)),
    ("4x2sar16t4", mk.MmaConfig(4, 2, offset_mma=False, ablate=True, ring=16, tiles=4)),
    ("8x2sc3", mk.MmaConfig(8, 2, offset_mma=False, persist=3)),
    ("8x2spk2", mk.MmaConfig(8, 2, offset_mma=False, xpre=True, split_k=2)),
    ("8x4", mk.MmaConfig(8, 4)),
])
def test_names_round_trip(name, cfg):
    assert parse_config(name) == cfg
    assert cname(cfg) == name


@pytest.mark.parametrize("name,why", [("8x2st3", "tiles=3"), ("8x2sk2t2", "tiles=2"), ("8x2x", "is not"),
                                      ("4x2sr16t8", "tiles=8")])
def test_bad_names_exit_with_the_reason(name, why):
    with pytest.raises(SystemExit, match=why):
        parse_config(name)
