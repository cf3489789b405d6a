"""All-or-nothing outputs: write into a hidden temporary next to the target, rename into place at the end."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from convert.errors import NeedleTwinError

# Files a directory must hold for --force to delete it: only our own outputs are ever replaced.
_OUR_DIRECTORY_MARKERS = ("config.json", "model.safetensors", "model.safetensors.index.json", "_CHECKPOINT_METADATA",
                          "_METADATA")


class OutputExistsError(NeedleTwinError):
    """The output path exists and --force was not given."""


def check_target(dst: Path, *, force: bool, directory: bool) -> None:
    """Fail before any work if writing dst would clobber something we may not replace."""
    if not dst.parent.is_dir():
        raise NeedleTwinError(f"{dst.parent} does not exist; create the output folder first")
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
    tmp = dst.parent / f".{dst.name}.needle-tmp-{os.getpid()}-{secrets.token_hex(4)}"
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
        old = dst.parent / f".{dst.name}.needle-old-{secrets.token_hex(4)}"
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


def remove(path: Path) -> None:
    """Delete a file or directory tree if it exists; never raises."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass
