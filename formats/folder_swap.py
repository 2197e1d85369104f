"""Replace a folder so that a crash at any step leaves a whole folder or a repairable state.

A write of OUT goes through folders beside it (same filesystem, so each rename is atomic):

  1. write everything into TMP = `.OUT.tmp-PID-XXXXXXXX`
  2. rename OUT -> ASIDE = `.OUT.old-PID-XXXXXXXX`   (only when OUT exists)
  3. rename TMP -> OUT
  4. remove ASIDE

A crash in 1 or 2 leaves the old OUT (and maybe TMP); in 3, no OUT but the whole old one at
ASIDE (the writer renames it back; a killed process cannot); in 4, the new OUT and what is left
of ASIDE. `recover` repairs each case before the next write: it renames ASIDE back when OUT is
missing, and removes ASIDE when OUT is there and every TMP. Leftovers of a process that is
still running (another write in progress) are left alone.

Folders are made with os.mkdir, so they get the mode the user's umask gives any folder
(tempfile.mkdtemp's 0700 would hide a checkpoint from a server running as another user), and
files the mode a new file gets there (safetensors writes its files 0600).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("optllm.formats")

TMP_TAG = "tmp"
OLD_TAG = "old"
# PID-8 hex digits; also the names optllm used before this file existed (mkdtemp's 8 random
# characters for TMP, `.OUT.old-PID` for ASIDE), so their leftovers are repaired too
_SUFFIX = re.compile(r"^(?:(?P<pid>\d+)(?:-[0-9a-f]{8})?|[a-z0-9_]{8})$")


def leftovers(out: Path, tag: str) -> list[Path]:
    """Folders beside OUT named `.OUT.<tag>-...` whose writing process is not running."""
    out = Path(out)
    prefix = f".{out.name}.{tag}-"
    try:
        names = os.listdir(out.parent if str(out.parent) else ".")
    except OSError:
        return []
    found = []
    for name in sorted(names):
        m = _SUFFIX.match(name[len(prefix):]) if name.startswith(prefix) else None
        if m and not (m["pid"] and _running_elsewhere(int(m["pid"]))):
            found.append(out.with_name(name))
    return found


def recover(out: Path) -> str | None:
    """Repair what an interrupted write of OUT left beside it; one line saying what was done,
    or None when there was nothing to repair."""
    out = Path(out)
    done = []
    asides = leftovers(out, OLD_TAG)
    if asides and not os.path.lexists(out):
        keep = max(asides, key=lambda p: p.lstat().st_mtime)
        os.replace(keep, out)
        asides.remove(keep)
        done.append(f"restored {out} from {keep.name}, where an interrupted --overwrite had moved it")
    if asides:
        for p in asides:
            shutil.rmtree(p)
        done.append(f"removed {_names(asides)}, the checkpoint an interrupted --overwrite had replaced")
    temps = leftovers(out, TMP_TAG)
    if temps:
        for p in temps:
            shutil.rmtree(p)
        done.append(f"removed {_names(temps)}, unfinished output of an interrupted write")
    return "; ".join(done) or None


def temp_folder(out: Path) -> Path:
    """A new empty folder beside OUT (mode from the umask) named for this process."""
    out = Path(out)
    while True:
        tmp = out.with_name(f".{out.name}.{TMP_TAG}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


@contextmanager
def replacing(out: Path) -> Iterator[Path]:
    """Yield an empty temp folder beside OUT; when the block ends without an error the folder
    replaces OUT (steps 2-4 above), else it is removed and OUT stays as it was."""
    out = Path(out)
    tmp = temp_folder(out)
    try:
        yield tmp
        _give_umask_modes(tmp)
        _swap(tmp, out)
    finally:
        if os.path.lexists(tmp):
            try:
                shutil.rmtree(tmp)
            except OSError:
                pass  # recover() removes it before the next write


def _give_umask_modes(folder: Path) -> None:
    """Files under FOLDER get the mode open() gives a new file there: the folder's own mode
    (os.mkdir: 0777 less the umask) without the execute bits. Read from the folder rather than
    by setting os.umask, which would race with other threads creating files."""
    mode = stat.S_IMODE(folder.stat().st_mode) & 0o666
    for root, _dirs, files in os.walk(folder):
        for f in files:
            os.chmod(os.path.join(root, f), mode)


def _swap(tmp: Path, out: Path) -> None:
    if not os.path.lexists(out):
        os.replace(tmp, out)
        return
    aside = out.with_name(f".{out.name}.{OLD_TAG}-{os.getpid()}-{secrets.token_hex(4)}")
    os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except BaseException:
        try:
            os.replace(aside, out)
        except OSError:
            pass  # recover() renames it back before the next write
        raise
    try:
        shutil.rmtree(aside)
    except OSError as e:
        # the new folder is in place; the old one is garbage the next write removes
        log.warning("could not remove %s (the replaced folder): %s; the next write removes it", aside, e)


def _running_elsewhere(pid: int) -> bool:
    """Whether PID is a live process other than this one (this one's leftovers are from a
    write that already failed: writes of one OUT do not overlap within a process)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    except (OSError, OverflowError):
        return False
    return True


def _names(paths: list[Path]) -> str:
    return ", ".join(p.name for p in paths)
