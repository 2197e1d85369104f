"""The recoverable replace of a checkpoint folder: a crash injected at each step leaves the old
or the new checkpoint whole at OUT, or a state the next run repairs (and says so)."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from optllm.formats import compressed_tensors, folder_swap
from optllm.formats.compressed_tensors import check_writable, read_state_dict
from optllm.quant.config import QuantizeConfig
from optllm.quant.pipeline import quantize

OLD = QuantizeConfig(group_size=32, num_samples=2, seq_len=16)
NEW = QuantizeConfig(group_size=64, num_samples=2, seq_len=16)


@pytest.fixture(scope="module")
def refs(tiny_llama, tmp_path_factory):
    """(old, new): the checkpoints of OLD and NEW, written once (RTN is deterministic)."""
    root = tmp_path_factory.mktemp("refs")
    quantize(str(tiny_llama), root / "old", OLD, progress=False)
    quantize(str(tiny_llama), root / "new", NEW, progress=False)
    return root / "old", root / "new"


def same_checkpoint(folder: Path, ref: Path) -> bool:
    """Every tensor, config.json and the file list equal (the report's timings differ by run)."""
    if not folder.is_dir() or sorted(p.name for p in folder.iterdir()) != sorted(p.name for p in ref.iterdir()):
        return False
    if json.loads((folder / "config.json").read_text()) != json.loads((ref / "config.json").read_text()):
        return False
    a, b = read_state_dict(folder), read_state_dict(ref)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


class Crash:
    """Raise OSError at one named step of a write of OUT; with `dead`, every later rename or
    removal beside OUT fails too (a killed process does nothing more, not even clean up)."""

    def __init__(self, monkeypatch, out: Path, step: str, dead: bool):
        self.out, self.step, self.dead, self.crashed, self.seen = out, step, dead, False, []
        real_replace, real_rmtree, real_save = os.replace, shutil.rmtree, compressed_tensors.save_file
        monkeypatch.setattr(os, "replace", lambda src, dst: self._do(self._name(src, dst), real_replace, src, dst))
        monkeypatch.setattr(shutil, "rmtree", lambda p, **k: self._do(self._name(p), real_rmtree, p, **k))
        monkeypatch.setattr(compressed_tensors, "save_file",
                            lambda *a, **k: self._do("write", real_save, *a, **k))

    def _name(self, src, dst=None) -> str | None:
        src, dst = Path(src), None if dst is None else Path(dst)
        if src.parent != self.out.parent:
            return None  # not a step of this write
        if dst is None:
            return "remove_old" if ".old-" in src.name else "remove_tmp"
        if src == self.out:
            return "aside"
        return "swap_in" if ".tmp-" in src.name else "restore"

    def _do(self, name, fn, *a, **k):
        if name is not None:
            self.seen.append(name)
            if name == self.step or (self.dead and self.crashed):
                self.crashed = True
                raise OSError(f"injected crash at {name}")
        return fn(*a, **k)


@pytest.mark.parametrize("dead", [False, True], ids=["handled", "killed"])
@pytest.mark.parametrize("step, survivor", [
    ("write", "old"), ("aside", "old"), ("swap_in", "old"), ("remove_old", "new"), (None, "new"),
])
def test_crash_at_each_step_leaves_a_whole_checkpoint_or_the_next_run_repairs_it(
        step, survivor, dead, refs, tiny_llama, tmp_path, monkeypatch):
    old_ref, new_ref = refs
    out = tmp_path / "ckpt"
    shutil.copytree(old_ref, out)
    with monkeypatch.context() as m:
        crash = Crash(m, out, step, dead)
        if step in ("write", "aside", "swap_in"):
            with pytest.raises(OSError, match="injected crash"):
                quantize(str(tiny_llama), out, NEW, overwrite=True, progress=False)
        else:
            quantize(str(tiny_llama), out, NEW, overwrite=True, progress=False)
    assert step is None or step in crash.seen
    if not (dead and step == "swap_in"):  # the one state a killed process leaves without OUT
        assert same_checkpoint(out, new_ref if survivor == "new" else old_ref)
    note = check_writable(out, overwrite=True)  # what the next run does first
    assert same_checkpoint(out, new_ref if survivor == "new" else old_ref)
    assert siblings(out) == []
    left = step == "remove_old" or (dead and step is not None)
    assert (note is not None) == left and (note is None or "\n" not in note)
    if dead and step == "swap_in":
        assert note.startswith(f"restored {out} from .ckpt.old-")


def test_a_killed_swap_is_restored_by_the_next_quantize(refs, tiny_llama, tmp_path, monkeypatch, caplog):
    old_ref, new_ref = refs
    out = tmp_path / "ckpt"
    shutil.copytree(old_ref, out)
    with monkeypatch.context() as m:
        Crash(m, out, "swap_in", dead=True)
        with pytest.raises(OSError):
            quantize(str(tiny_llama), out, NEW, overwrite=True, progress=False)
    assert not out.exists() and len(siblings(out)) == 2  # the old one aside, the new one in TMP
    quantize(str(tiny_llama), out, NEW, overwrite=True, progress=False)
    assert same_checkpoint(out, new_ref) and siblings(out) == []
    assert any(r.getMessage().startswith(f"restored {out}") for r in caplog.records)


def test_recover_restores_the_orphan_the_old_writer_left(tmp_path):
    # before this fix the aside copy was `.OUT.old-PID` and a temp folder `.OUT.tmp-XXXXXXXX`
    out = tmp_path / "ckpt"
    (tmp_path / f".ckpt.old-{os.getpid()}").mkdir()
    (tmp_path / f".ckpt.old-{os.getpid()}" / "config.json").write_text("{}")
    (tmp_path / ".ckpt.tmp-k2_x9a0q").mkdir()
    note = folder_swap.recover(out)
    assert (out / "config.json").read_text() == "{}" and siblings(out) == []
    assert note == (f"restored {out} from .ckpt.old-{os.getpid()}, where an interrupted --overwrite had moved it; "
                    "removed .ckpt.tmp-k2_x9a0q, unfinished output of an interrupted write")


def test_recover_leaves_a_running_writers_folders_and_unrelated_names_alone(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        names = [f".ckpt.tmp-{proc.pid}-0123abcd", f".ckpt.old-{proc.pid}-0123abcd",
                 ".ckpt.tmp-notes", ".ckpt.old-1-2-3", ".ckpt.tmp-1.tmp-2-0123abcd", ".other.tmp-1-0123abcd"]
        for n in names:
            (tmp_path / n).mkdir()
        assert folder_swap.recover(out) is None
        assert siblings(out) == sorted(names)
    finally:
        proc.kill()
        proc.wait()
    assert folder_swap.recover(out) == (
        f"removed .ckpt.old-{proc.pid}-0123abcd, the checkpoint an interrupted --overwrite had replaced; "
        f"removed .ckpt.tmp-{proc.pid}-0123abcd, unfinished output of an interrupted write")


def test_replacing_without_an_old_folder_and_on_error(tmp_path):
    out = tmp_path / "x"
    with folder_swap.replacing(out) as tmp:
        (tmp / "a").write_text("1")
    assert (out / "a").read_text() == "1" and siblings(out) == []
    with pytest.raises(RuntimeError), folder_swap.replacing(out) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError
    assert (out / "a").read_text() == "1" and siblings(out) == []
