"""The README's performance table, generated from `benchmarks/results/*.json`.

Usage: python benchmarks/table.py            (rewrite the table between the markers in README.md)
       python benchmarks/table.py --check    (exit 1 when README.md's table is not what the results give)

A results file (schema "needle-twin/bench-result", version 1) holds one benchmark command's figures:

    {"schema": "needle-twin/bench-result", "version": 1, "date": "YYYY-MM-DD", "command": "...",
     "machine": {"description": "...", "cpu_flags": ["avx2", ...], "absent_flags": [...]},
     "recorded": "...",                     optional: how the figures came to be written down
     "rows": [{"benchmark": "...", "setting": "...", "<metric>": value or [value per run], ...}]}

Metrics: decode_tok_s, e2e_tok_s, prefill_s, first_call_s, compile_s, wall_s, of_bound (a fraction), x_upstream
(end to end against upstream's loop in the same file); any other key is shown as `key value`. A list gives one
value per run and is shown as its range.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
START, END = "<!-- performance-table:start -->", "<!-- performance-table:end -->"
SCHEMA = "needle-twin/bench-result"
HEAD = ("benchmark", "setting")


def _values(v) -> list[float]:
    return [float(x) for x in (v if isinstance(v, list) else [v])]


def _span(values: Iterable[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"


def _metric(key: str, value) -> str:
    vals = _values(value)
    if key == "decode_tok_s":
        return f"decode {_span(vals, '{:.1f}')} tok/s"
    if key == "e2e_tok_s":
        return f"end to end {_span(vals, '{:.1f}')} tok/s"
    if key in ("prefill_s", "first_call_s", "compile_s", "wall_s"):
        name = {"prefill_s": "prefill ", "first_call_s": "first call ", "compile_s": "compile ", "wall_s": ""}[key]
        if max(vals) < 1:
            return f"{name}{_span([v * 1000 for v in vals], '{:.0f}')} ms"
        return f"{name}{_span(vals, '{:.2f}' if max(vals) < 10 else '{:.1f}' if max(vals) < 100 else '{:.0f}')} s"
    if key == "x_upstream":
        return f"{_span(vals, '{:.1f}')}× upstream's loop"
    if key == "of_bound":
        return f"{_span([v * 100 for v in vals], '{:.0f}')} % of the memory bound"
    return f"{key} {_span(vals, '{:g}')}"


def load(directory: Path = RESULTS) -> list[dict]:
    """Every results file, newest first (then by name); an error naming a file that is not one."""
    out = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise SystemExit(f"{path}: not a {SCHEMA} file (its `schema` must say so)")
        missing = [k for k in ("date", "command", "machine", "rows") if k not in data]
        if missing:
            raise SystemExit(f"{path}: no {', '.join(missing)}; a result states its date, command and machine")
        out.append({**data, "file": path.name})
    out.sort(key=lambda d: d["file"])
    return sorted(out, key=lambda d: d["date"], reverse=True)


def render(results: list[dict]) -> str:
    """The markdown table, then one line per results file: its date, machine, CPU flags and command."""
    lines = ["| benchmark | setting | result | source |", "|---|---|---|---|"]
    sources = []
    for n, data in enumerate(results, 1):
        for row in data["rows"]:
            figures = ", ".join(_metric(k, v) for k, v in row.items() if k not in HEAD)
            lines.append(f"| {row['benchmark']} | {row['setting']} | {figures} | [{n}] |")
        machine = data["machine"]
        flags = ", ".join(machine.get("cpu_flags", [])) or "not recorded"
        absent = machine.get("absent_flags")
        runs = data.get("runs", 1)
        sources.append(f"[{n}] {data['date']}, {machine['description']}; CPU flags: {flags}"
                       + (f" (no {', '.join(absent)})" if absent else "")
                       + f"; `{data['command']}`" + (f", {runs} runs" if runs > 1 else "")
                       + (f"; {data['recorded']}" if data.get("recorded") else "")
                       + f" (`benchmarks/results/{data['file']}`)")
    return "\n".join(lines) + "\n\n" + "\n".join(f"{s}  " if i < len(sources) - 1 else s
                                                for i, s in enumerate(sources)) + "\n"


def with_table(readme: str, table: str) -> str:
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} markers to write the table between")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md's table is out of date")
    args = parser.parse_args(argv)
    readme = README.read_text(encoding="utf-8")
    new = with_table(readme, render(load()))
    if args.check:
        if new != readme:
            print("README.md's performance table is out of date: run python benchmarks/table.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
