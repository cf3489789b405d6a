"""All-or-nothing outputs: write into a hidden temporary next to the target, rename into place at the end."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from convert.errors import NeedleTwinError

# Files a directory must hold for --force to delete it: only our own outputs are ever replaced.
_OUR_DIRECTORY_MARKERS = ("config.json", "model.safetensors", "model.safetensors.index.json", "_CHECKPOINT_METADATA",
                          "_METADATA", "adapter_config.json")


class OutputExistsError(NeedleTwinError):
    """The output path exists and --force was not given."""


def check_target(dst: Path, *, force: bool, directory: bool) -> None:
    """Fail before any work if writing dst would clobber something we may not replace (a killed writer's
    leftovers are settled first: a previous output it had moved aside counts as dst when it comes back)."""
    if not dst.parent.is_dir():
        raise NeedleTwinError(f"{dst.parent} does not exist; create the output folder first")
    clean_leftovers(dst)
    if not (dst.exists() or dst.is_symlink()):
        return
    if not force:
        raise OutputExistsError(f"{dst} already exists; pass --force to replace it")
    if dst.is_dir() and not directory:
        raise NeedleTwinError(f"{dst} is a directory; give a file name (or remove the directory yourself)")
    if dst.is_dir() and not _replaceable_directory(dst):
        raise NeedleTwinError(f"{dst} is a directory that is not a needle-twin checkpoint; refusing to delete it "
                              "with --force, remove it yourself or pick another name")


def _replaceable_directory(path: Path) -> bool:
    names = {p.name for p in path.iterdir()}
    return not names or any(marker in names for marker in _OUR_DIRECTORY_MARKERS)


@contextlib.contextmanager
def atomic_output(dst: Path, *, force: bool, directory: bool = False) -> Iterator[Path]:
    """Yield a not-yet-existing temporary path beside dst; on success it replaces dst, on any failure it vanishes."""
    dst = Path(dst)
    check_target(dst, force=force, directory=directory)
    tmp = _aside(dst, "tmp")
    try:
        yield tmp
        if not tmp.exists():
            raise AssertionError(f"writer did not create {tmp}")
        _commit(tmp, dst, force=force)
    except BaseException:
        remove(tmp)
        raise


def _commit(tmp: Path, dst: Path, *, force: bool) -> None:
    # Re-check: dst may have appeared while we were writing.
    check_target(dst, force=force, directory=tmp.is_dir())
    if tmp.is_dir() and dst.is_dir():
        old = _aside(dst, "old")
        os.rename(dst, old)
        try:
            os.rename(tmp, dst)
        except BaseException:
            os.rename(old, dst)
            raise
        remove(old)
        return
    if tmp.is_dir() and dst.exists():
        os.unlink(dst)  # a file or symlink replaced by a directory (--force checked above)
    os.replace(tmp, dst)


def clean_leftovers(dst: Path) -> None:
    """Delete what a killed writer of dst left beside it (or put back the previous output it had moved aside)."""
    # SIGTERM/Ctrl-C/errors clean up after themselves; only SIGKILL, OOM kills and power loss leave these behind.
    # Only names our writers make for this exact dst, with a pid that no longer exists, are touched.
    if os.name != "posix":  # os.kill(pid, 0) is a liveness probe only on POSIX (on Windows it kills)
        return
    try:
        with os.scandir(dst.parent) as entries:  # one listdir, whatever else the folder holds
            names = [entry.name for entry in entries]
    except OSError:
        return  # unreadable folder: nothing we may clean
    dead: dict[str, dict[Path, int]] = {"tmp": {}, "old": {}}
    for name in names:
        m = _ASIDE.fullmatch(name)
        if m is not None and m["name"] == dst.name and _writer_gone(int(m["pid"])):
            dead[m["kind"]][dst.parent / name] = int(m["pid"])
    dead_tmps, dead_olds = dead["tmp"], dead["old"]
    kept = _settle_moved_aside(dst, dead_olds, set(dead_tmps.values()))
    for path, pid in dead_tmps.items():
        if pid not in kept:  # a kept copy's tmp stays too: it is what marks that swap as cut short
            remove(path)  # remove() unlinks a symlink itself, never what it points to


def _aside(dst: Path, kind: str) -> Path:
    """A hidden name beside dst for a temporary output ("tmp") or a moved-aside previous one ("old"); the pid
    lets a later run tell a killed writer's leftover from one in progress (see clean_leftovers)."""
    return dst.parent / f".{dst.name}.needle-{kind}-{os.getpid()}-{secrets.token_hex(4)}"


_ASIDE = re.compile(r"\.(?P<name>.+)\.needle-(?P<kind>tmp|old)-(?P<pid>[1-9][0-9]{0,9})-[0-9a-f]{8}")  # _aside's names


def _writer_gone(pid: int) -> bool:
    """True only when no process has this pid; every doubt (no permission, odd pid) answers "alive"."""
    # A reused pid reads as alive and its leftover stays until a later run: the safe way to be wrong.
    # Pids are per host and per pid namespace: a writer on another machine (shared folder) or in another
    # container writing the same name would look gone; don't aim two hosts at one output name at once.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # PermissionError: it exists, it's someone else's
        return False
    return False


def _settle_moved_aside(dst: Path, olds: dict[Path, int], tmp_pids: set[int]) -> set[int]:
    """A dead writer's moved-aside previous output of dst: put it back if its swap was cut short, else delete it.
    Returns the pids of the copies left in place."""
    # _commit (one pid) renames dst -> old, then tmp -> dst, then deletes old. Killed between the two renames,
    # dst is missing and that pid's tmp is still there: old is the user's complete previous output, so it goes
    # back (the unfinished run is undone, all or nothing; the caller needs --force again, as before it). In any
    # other case (dst there, or no tmp of that pid: the swap was done) old is a superseded copy, perhaps half
    # deleted, that the user asked to replace: it goes. A symlinked dst was moved aside as the link: same rules.
    missing = not (dst.exists() or dst.is_symlink())
    cut_short = [path for path, pid in olds.items() if pid in tmp_pids] if missing else []
    keep = set(cut_short)  # several cut-short swaps: we can't tell which is the user's latest, so keep them all
    if len(cut_short) == 1:
        try:
            os.rename(cut_short[0], dst)  # dst checked absent just above; same folder, so atomic
        except OSError:
            pass  # e.g. another writer created dst meanwhile: keep the copy rather than guess
    for path in olds:
        if path not in keep:
            remove(path)
    return {olds[path] for path in keep if path.exists() or path.is_symlink()}


def remove(path: Path) -> None:
    """Delete a file or directory tree if it exists; never raises."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass
