"""Report files for every command that writes them (parity, rescore, quant): checked before any work, each written
whole or not at all."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from convert import atomic
from convert.errors import NeedleTwinError

# One look for every HTML report (parity, quant); each adds its own rows to it.
CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;color:#1d232a}
h1{font-size:1.4em;margin:0 0 .3em} h2{font-size:1.1em;margin:1.6em 0 .5em}
.verdict{display:inline-block;padding:.25em .7em;border-radius:4px;color:#fff;font-weight:600}
.pass{background:#1a7f37} .fail{background:#cf222e} .info{background:#57606a}
table{border-collapse:collapse;width:100%;font-size:12.5px}
th,td{padding:3px 8px;border-bottom:1px solid #e3e6ea;text-align:right;white-space:nowrap}
th{background:#f4f6f8} td.name,th.name{text-align:left;font-family:ui-monospace,Menlo,Consolas,monospace}
tr.bad td{color:#cf222e} tr.first td,tr.worst td{background:#cf222e;color:#fff;font-weight:600}
dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px} dt{color:#57606a} dd{margin:0}
pre{background:#f4f6f8;padding:8px;overflow:auto;font-size:12px} .muted{color:#57606a}
svg text{font:10px ui-monospace,Menlo,Consolas,monospace;fill:#1d232a}
"""


def finite(value: Any) -> Any:
    """JSON has no NaN/inf: a non-finite figure is written as null (and fails every budget or threshold)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_safe(value: Any) -> Any:
    """Mappings, sequences, numpy scalars and arrays as plain JSON values, non-finite floats as null."""
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy scalar
        value = value.item()
    if hasattr(value, "tolist"):  # numpy array
        return json_safe(value.tolist())
    return finite(value)


class ReportError(NeedleTwinError, ValueError):
    """A saved report cannot be read or re-scored."""


def read_report_object(path: str | Path, command: str) -> dict:
    """The JSON object a report file holds; `command` (e.g. "parity") names what writes such files."""
    p = Path(path)
    hint = f"give the file written by `needle-twin {command} --json`"
    if not p.is_file():
        raise ReportError(f"{p}: no such report; {hint}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ReportError(f"{p} is not valid JSON ({e}); {hint}") from None
    if not isinstance(data, dict):
        raise ReportError(f"{p} holds a JSON {type(data).__name__}, not a report object")
    return data


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
