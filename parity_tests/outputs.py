"""Report files for every command that writes them (parity, rescore, quant): checked before any work, each written
whole or not at all."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from convert import atomic
from convert.errors import NeedleTwinError


def check_outputs(paths: Sequence[str | None], force: bool) -> None:
    """Refuse to clobber (without --force), and two outputs at one path, before any work is done."""
    given = [Path(p) for p in paths if p]
    for path in given:
        atomic.check_target(path, force=force, directory=False)
    if len({p.resolve() for p in given}) < len(given):
        raise NeedleTwinError("--json and --html name the same file; give two paths")


def write_outputs(report: Any, renders: Sequence[tuple[str | None, Callable[[Any], str]]], force: bool) -> None:
    """Each (path, render) file whole or not at all (written beside the target, renamed into place)."""
    for path, render in renders:
        if path:
            with atomic.atomic_output(Path(path), force=force) as tmp:
                tmp.write_text(render(report), encoding="utf-8")
