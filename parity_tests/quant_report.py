"""The quantization-parity report: data, judging against thresholds, JSON round trip, re-scoring, terminal and HTML.

`parity_tests.v2.quant` and `parity_tests.v3.quant` compute it; this module only holds, judges and
renders it, so a fresh run and a re-scored JSON are judged by one rule (`score`). The JSON schema is
documented in parity_tests/QUANT_SCHEMA.md; `SCHEMA_VERSION` changes when it does.

The verdict: passed unless a given threshold fails (`max_kld` on one KL statistic, by default
the mean; `min_top1` on the same-top-1 rate) or a `.cact`'s CQ records differ from this project's
CQ of the checkpoint beyond rounding flips (`cq_check`). Without thresholds and without a `.cact`
a report always passes: it describes the damage, it does not judge it.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity_tests.outputs import CSS, ReportError, finite, json_safe, read_report_object

SCHEMA = "needle-twin/quant-report"
SCHEMA_VERSION = 1
KLD_STATS = ("mean", "stderr", "median", "p99", "p999", "max")
JUDGED_KLD_STATS = ("mean", "median", "p99", "p999", "max")  # stderr is a spread, not a damage figure
_REQUIRED = ("passed", "checks", "thresholds", "quantized", "positions", "kld", "same_top1", "rms_dp", "per_layer",
             "per_tensor")


@dataclass(frozen=True)
class Thresholds:
    """What the verdict checks (None: not checked): KL(p_float ‖ p_quant)'s `kld_stat` <= max_kld, and the
    same-top-1 rate >= min_top1."""

    max_kld: float | None = None
    min_top1: float | None = None
    kld_stat: str = "mean"

    def __post_init__(self) -> None:
        if self.kld_stat not in JUDGED_KLD_STATS:
            raise ReportError(f"kld_stat {self.kld_stat!r} is not one of {', '.join(JUDGED_KLD_STATS)}")
        for name, value, hi in (("max_kld", self.max_kld, math.inf), ("min_top1", self.min_top1, 1.0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value <= hi):
                raise ReportError(f"--{name.replace('_', '-')} {value!r} must be a number in [0, {hi:g}]")

    def to_dict(self) -> dict[str, Any]:
        return {"max_kld": self.max_kld, "kld_stat": self.kld_stat, "min_top1": self.min_top1}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Thresholds:
        return cls(d.get("max_kld"), d.get("min_top1"), d.get("kld_stat", "mean"))


@dataclass
class QuantReport:
    """Float vs quantized model on the same inputs; every figure over real (non-pad) positions only."""

    quantized: dict[str, Any]  # what the quantized model is: source (cact, bits, none), file or spec, LoRA, lossy
    positions: dict[str, int]  # real, total
    kld: dict[str, float | None]  # KL(p_float ‖ p_quant) per real position: mean, stderr, median, p99, p999, max
    same_top1: float | None
    top5: float | None
    rms_dp: float | None
    logits_max_rel: float | None
    greedy: dict[str, Any] | None
    per_layer: list[dict[str, Any]]
    per_tensor: list[dict[str, Any]]
    attribution: dict[str, Any]
    inputs: dict[str, Any]
    model: dict[str, Any]
    environment: dict[str, Any]
    thresholds: Thresholds = field(default_factory=Thresholds)
    checks: list[dict[str, Any]] = field(default_factory=list)
    passed: bool = True
    notes: list[str] = field(default_factory=list)
    # Needle 3 sections (None where the family or run has none): the three-way table of deploy models, the cost
    # of each deploy-numerics site, each ladder rung against the full float model, and the .cact's CQ records
    # against this project's CQ of the float weights (rounding flips told apart).
    deploy: dict[str, Any] | None = None
    per_site: list[dict[str, Any]] | None = None
    per_rung: list[dict[str, Any]] | None = None
    cq_check: dict[str, Any] | None = None
    # The arrays behind the figures (logits, lane states, greedy tokens); never written to JSON.
    arrays: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def worst_layer(self) -> dict[str, Any] | None:
        """The attribution unit whose quantization alone moves the logits most (None if none moves them)."""
        rows = [r for r in self.per_layer if _num(r.get("kld_mean")) > 0]
        return max(rows, key=lambda r: _num(r.get("kld_mean"))) if rows else None

    @property
    def worst_tensor(self) -> dict[str, Any] | None:
        """The logits-path tensor with the lowest SQNR (None if every tensor is exact)."""
        rows = [t for t in self.per_tensor if t.get("logits_path") and t.get("sqnr_db") is not None]
        return min(rows, key=lambda t: t["sqnr_db"]) if rows else None

    def to_dict(self) -> dict[str, Any]:
        worst_layer, worst_tensor = self.worst_layer, self.worst_tensor
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "passed": self.passed,
            "checks": json_safe(self.checks),
            "thresholds": self.thresholds.to_dict(),
            "worst": {"layer": None if worst_layer is None else worst_layer["layer"],
                      "tensor": None if worst_tensor is None else worst_tensor["name"]},
            "quantized": json_safe(self.quantized),
            "positions": json_safe(self.positions),
            "kld": json_safe(self.kld),
            "same_top1": finite(self.same_top1),
            "top5": finite(self.top5),
            "rms_dp": finite(self.rms_dp),
            "logits_max_rel": finite(self.logits_max_rel),
            "greedy": json_safe(self.greedy),
            "per_layer": json_safe(self.per_layer),
            "per_tensor": json_safe(self.per_tensor),
            "attribution": json_safe(self.attribution),
            "inputs": json_safe(self.inputs),
            "model": json_safe(self.model),
            "environment": json_safe(self.environment),
            "notes": list(self.notes),
            "deploy": json_safe(self.deploy),
            "per_site": json_safe(self.per_site),
            "per_rung": json_safe(self.per_rung),
            "cq_check": json_safe(self.cq_check),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantReport:
        if d.get("schema") != SCHEMA:
            raise ReportError(f"not a needle-twin quantization report (schema {d.get('schema')!r}); give a file "
                              "written by `needle-twin quant --json`")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ReportError(f"quantization report schema version {d.get('schema_version')!r} is not "
                              f"{SCHEMA_VERSION}; re-run `needle-twin quant` with this version")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ReportError(f"quantization report lacks {', '.join(missing)}; the file may be truncated or edited; "
                              "re-run `needle-twin quant --json`")
        try:
            return cls(
                quantized=dict(d["quantized"]), positions=dict(d["positions"]), kld=dict(d["kld"]),
                same_top1=d["same_top1"], top5=d.get("top5"), rms_dp=d["rms_dp"],
                logits_max_rel=d.get("logits_max_rel"), greedy=d.get("greedy"),
                per_layer=[dict(r) for r in d["per_layer"]], per_tensor=[dict(t) for t in d["per_tensor"]],
                attribution=dict(d.get("attribution") or {}), inputs=dict(d.get("inputs") or {}),
                model=dict(d.get("model") or {}), environment=dict(d.get("environment") or {}),
                thresholds=Thresholds.from_dict(d["thresholds"]), checks=[dict(c) for c in d["checks"]],
                passed=bool(d["passed"]), notes=[str(n) for n in d.get("notes", [])],
                deploy=d.get("deploy"), per_site=d.get("per_site"), per_rung=d.get("per_rung"),
                cq_check=d.get("cq_check"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ReportError(f"quantization report has a malformed field ({e!s}); the file may be truncated or "
                              "edited; re-run `needle-twin quant --json`") from None


def _num(value: Any) -> float:
    """A figure for sorting: null (non-finite) counts as the worst, i.e. +inf."""
    return math.inf if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)




# ----------------------------------------------------------------------------- judging


def score(report: QuantReport, thresholds: Thresholds) -> QuantReport:
    """Judge the report's figures against `thresholds`; returns a new report (the figures are not touched).

    A null (non-finite) figure fails every threshold it is checked against."""
    checks = []
    if thresholds.max_kld is not None:
        value = report.kld.get(thresholds.kld_stat)
        checks.append({"name": f"kld.{thresholds.kld_stat}", "value": value, "op": "<=",
                       "threshold": thresholds.max_kld,
                       "passed": value is not None and math.isfinite(value) and value <= thresholds.max_kld})
    if thresholds.min_top1 is not None:
        value = report.same_top1
        checks.append({"name": "same_top1", "value": value, "op": ">=", "threshold": thresholds.min_top1,
                       "passed": value is not None and math.isfinite(value) and value >= thresholds.min_top1})
    if report.cq_check is not None:  # a .cact whose CQ is not this checkpoint's fails whatever the thresholds
        c = report.cq_check
        checks.append({"name": "cq_check", "value": c.get("divergent_groups"), "op": "==", "threshold": 0,
                       "passed": bool(c.get("ok"))})
    return dataclasses.replace(report, thresholds=thresholds, checks=checks, passed=all(c["passed"] for c in checks))


def rescore(report: QuantReport, max_kld: float | None = None, min_top1: float | None = None,
            kld_stat: str = "mean") -> QuantReport:
    """Re-judge a (saved) report against these thresholds, and only these, without running any model."""
    out = score(report, Thresholds(max_kld, min_top1, kld_stat))
    was = describe_thresholds(report.thresholds)
    return dataclasses.replace(out, notes=[*report.notes, f"re-scored against {describe_thresholds(out.thresholds)} "
                                                          f"(was {was})"])


def describe_thresholds(t: Thresholds) -> str:
    parts = []
    if t.max_kld is not None:
        parts.append(f"KL {t.kld_stat} <= {t.max_kld:g}")
    if t.min_top1 is not None:
        parts.append(f"same top-1 >= {t.min_top1:g}")
    return " and ".join(parts) or "no thresholds"


# ----------------------------------------------------------------------------- files


def to_json(report: QuantReport) -> str:
    return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"


def load_json(path: str | Path) -> QuantReport:
    return QuantReport.from_dict(read_report_object(path, "quant"))


# ----------------------------------------------------------------------------- text


def fmt(value: Any, kind: str = "e") -> str:
    """A figure for people: 'e' 2.3e-04, 'pct' 67.4%, 'db' 12.3 dB (null SQNR: exact), 'f' 0.241."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "exact" if kind == "db" else "nan"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "db":
        return f"{value:.1f} dB"
    if kind == "f":
        return f"{value:.3f}"
    return f"{value:.2e}"


def bits_text(bits: Any) -> str:
    if isinstance(bits, (list, tuple)):
        return "/".join(bits_text(b) for b in bits) or "-"
    return "-" if bits is None else f"{bits:g}"


def scheme_line(report: QuantReport) -> str:
    q = report.quantized
    if q.get("source") == "cact":
        what = f".cact {q.get('cact')} (implied bits {q.get('bits_map') or 'default=4'})"
    elif q.get("source") == "bits":
        what = f"--bits {q.get('bits')}"
    else:
        what = str(q.get("source"))
    lora = q.get("lora")
    return what + (f" + LoRA {lora.get('path', '(in memory)')}" if lora else "")


def headline(report: QuantReport) -> list[str]:
    """The figures in a few plain lines (terminal and HTML)."""
    k, pos = report.kld, report.positions
    lines = [f"KL(p_float || p_quant) over {pos.get('real')} real positions (of {pos.get('total')}): mean "
             f"{fmt(k.get('mean'))} ± {fmt(k.get('stderr'))}, median {fmt(k.get('median'))}, p99 {fmt(k.get('p99'))}, "
             f"p99.9 {fmt(k.get('p999'))}, max {fmt(k.get('max'))}",
             f"same top-1 {fmt(report.same_top1, 'pct')}, top-5 overlap {fmt(report.top5, 'pct')}, RMS Δp of the "
             f"float top token {fmt(report.rms_dp)}, logits max|Δ|/max|float| {fmt(report.logits_max_rel)}"]
    if report.greedy is not None:
        lines.append(greedy_line(report.greedy))
    return lines


def greedy_line(g: Mapping[str, Any]) -> str:
    firsts = ", ".join("-" if s is None else str(s) for s in g.get("first_divergence", []))
    return (f"greedy, {g.get('steps')} steps from {g.get('rows')} prompts: {fmt(g.get('agree_fraction'), 'pct')} of "
            f"steps agree before the first divergence; {g.get('rows_identical')}/{g.get('rows')} rows identical; "
            f"first divergent step per row: [{firsts}] (- = none)")


def worst_line(report: QuantReport) -> str:
    layer, tensor = report.worst_layer, report.worst_tensor
    a = ("worst layer: none (no layer alone moves the logits)" if layer is None else
         f"worst layer: {layer['layer']} (KL mean {fmt(layer.get('kld_mean'))} when quantized alone, "
         f"{fmt(layer.get('kld_share'), 'pct')} of the whole model's)")
    b = ("worst tensor: none (every tensor exact)" if tensor is None else
         f"worst tensor: {tensor['name']} ({bits_text(tensor.get('bits'))} bits, SQNR {fmt(tensor['sqnr_db'], 'db')})")
    return f"{a}; {b}"


def verdict_text(report: QuantReport) -> str:
    if not report.checks:
        return "REPORTED (no thresholds given)"
    failed = [c for c in report.checks if not c["passed"]]
    if not failed:
        held = describe_thresholds(report.thresholds)
        if report.cq_check is not None:
            flips = report.cq_check.get("flips")
            held = f"{held}; the .cact's CQ is this checkpoint's outside {flips} rounding flip(s)"
        return f"QUANT PARITY HOLDS ({held})"
    return "QUANT PARITY FAILED: " + "; ".join(_failure(c, report.cq_check) for c in failed)


def _failure(check: Mapping[str, Any], cq: Mapping[str, Any] | None) -> str:
    if check["name"] == "cq_check" and cq is not None:
        return (f"the .cact's CQ records differ from this checkpoint's CQ in {cq.get('divergent_groups')} group(s) "
                f"beyond rounding flips (judged error {fmt(cq.get('rel_outside_max'))}, budget "
                f"{fmt(cq.get('budget_rel'))})")
    return f"{check['name']} {fmt(check['value'])} not {check['op']} {check['threshold']:g}"


def render_terminal(report: QuantReport, console=None, top_tensors: int = 8) -> None:
    """Headline figures, a table per attribution unit, the worst tensors, notes and the verdict (rich)."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    # Plain lines, no auto-colouring, not re-wrapped (the terminal wraps them; a pipe keeps them whole).
    say = lambda text: console.print(text, highlight=False, soft_wrap=True)  # noqa: E731
    say(f"[bold]needle-twin quant[/] · {escape(scheme_line(report))} · {escape(str(report.environment.get('dtype')))}"
        f" on {escape(str(report.environment.get('device')))}")
    for line in headline(report):
        say(escape(line))
    worst_layer, worst_tensor = report.worst_layer, report.worst_tensor
    table = Table(title="per layer: KL / top-1 with only this layer quantized (the rest float); state rel RMS with "
                        "everything quantized", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD)
    for col, justify in (("layer", "left"), ("bits", "right"), ("min SQNR", "right"), ("KL mean", "right"),
                         ("share", "right"), ("top-1", "right"), ("state rRMS", "right"), ("", "left")):
        table.add_column(col, justify=justify, no_wrap=True, min_width=len(col))
    for r in report.per_layer:
        worst = worst_layer is not None and r["layer"] == worst_layer["layer"]
        table.add_row(r["layer"], bits_text(r.get("bits")), fmt(r.get("sqnr_db_min"), "db"), fmt(r.get("kld_mean")),
                      fmt(r.get("kld_share"), "pct"), fmt(r.get("same_top1"), "pct"), fmt(r.get("state_rel_rms"), "f"),
                      "WORST" if worst else "", style="bold red" if worst else None)
    console.print(table)
    tensors = sorted((t for t in report.per_tensor if t.get("logits_path")),  # lowest SQNR first, exact (null) last
                     key=lambda t: (t.get("sqnr_db") is None, _num(t.get("sqnr_db"))))[:top_tensors]
    if tensors:
        t2 = Table(title=f"tensors with the lowest SQNR (worst {len(tensors)})", title_justify="left",
                   header_style="bold", box=box.SIMPLE_HEAD)
        for col, justify in (("tensor", "left"), ("layer", "left"), ("bits", "right"), ("SQNR", "right"),
                             ("rel err", "right")):
            t2.add_column(col, justify=justify, no_wrap=True)
        for t in tensors:
            worst = worst_tensor is not None and t["name"] == worst_tensor["name"]
            t2.add_row(t["name"], str(t.get("layer")), bits_text(t.get("bits")), fmt(t.get("sqnr_db"), "db"),
                       fmt(t.get("rel_err"), "f"), style="bold red" if worst else None)
        console.print(t2)
    say(escape(worst_line(report)))
    for line in deploy_lines(report):
        say(escape(line))
    for note in report.notes:
        say(f"[dim]note: {escape(note)}[/]")
    colour = "yellow" if not report.checks else ("green" if report.passed else "red")
    say(f"[bold {colour}]{escape(verdict_text(report))}[/]")


# ----------------------------------------------------------------------------- HTML

_BITS_COLOURS = {1.58: "#8250df", 2: "#cf222e", 3: "#bc4c00", 4: "#0969da"}


def _nice_ceiling(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 × 10^k that is >= v (1 for v <= 0): a linear axis with round ticks."""
    if v <= 0:
        return 1.0
    base = 10.0 ** math.floor(math.log10(v))
    return next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= v * (1 - 1e-12))


def bar_svg(labels: Sequence[str], values: Sequence[float | None], *, title: str, log: bool, unit: str = "",
            highlight: str | None = None, colours: Sequence[str] | None = None) -> str:
    """A labelled bar chart as inline SVG (no xmlns, so the page holds no URL): a log10 axis when `log` (zeros
    and nulls sit on the bottom edge), else linear from 0. `highlight` names the bar drawn in red."""
    n = max(len(labels), 1)
    step = max(14, min(40, 900 // n))
    left, right, top, plot_h, bottom = 64, 20, 28, 200, 130
    width = max(720, left + right + step * n)
    height = top + plot_h + bottom
    finite = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)]
    if log:
        pos = [v for v in finite if v > 0]
        lo = math.floor(math.log10(min(pos))) if pos else -6
        hi = math.ceil(math.log10(max(pos))) if pos else 0
        hi = max(hi, lo + 1)
    else:
        lo, hi = 0.0, _nice_ceiling(max([*finite, 0.0]))

    def y(v: float | None) -> float:
        if v is None or not math.isfinite(v):
            return float(top + plot_h)
        if log:
            if v <= 0:
                return float(top + plot_h)
            return top + plot_h * (hi - math.log10(v)) / (hi - lo)
        return top + plot_h * (hi - max(v, 0.0)) / (hi - lo)

    out = [f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{html.escape(title)}">',
           f'<text x="{left}" y="{top - 10}">{html.escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{plot_h}" fill="#fafbfc" '
           'stroke="#d0d7de"/>']
    ticks = [10.0 ** d for d in range(lo, hi + 1)] if log else [hi * k / 4 for k in range(5)]
    for t in ticks:
        yy = y(t)
        label = f"1e{round(math.log10(t))}" if log else f"{t:.3g}"
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eaeef2"/>')
        out.append(f'<text x="{left - 6}" y="{yy + 3:.1f}" text-anchor="end">{label}{html.escape(unit)}</text>')
    for i, (label, v) in enumerate(zip(labels, values, strict=True)):
        x0 = left + step * i + 2
        yy = y(v)
        colour = "#cf222e" if label == highlight else (colours[i] if colours else "#0969da")
        shown = "null" if v is None else f"{v:.4g}"
        out.append(f'<rect x="{x0:.1f}" y="{yy:.1f}" width="{step - 4}" height="{top + plot_h - yy:.1f}" '
                   f'fill="{colour}"><title>{html.escape(label)}: {shown}{html.escape(unit)}</title></rect>')
        xc = x0 + (step - 4) / 2
        out.append(f'<text transform="translate({xc:.1f},{top + plot_h + 8}) rotate(60)">{html.escape(label)}'
                   "</text>")
    out.append("</svg>")
    return "\n".join(out)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], worst: int | None = None) -> str:
    th = "".join(f'<th class="name">{html.escape(h)}</th>' if i == 0 else f"<th>{html.escape(h)}</th>"
                 for i, h in enumerate(head))
    body = []
    for j, row in enumerate(rows):
        cells = "".join(f'<td class="name">{html.escape(c)}</td>' if i == 0 else f"<td>{html.escape(c)}</td>"
                        for i, c in enumerate(row))
        body.append(f'<tr class="{"worst" if j == worst else ""}">{cells}</tr>')
    return "<table><tr>" + th + "</tr>\n" + "\n".join(body) + "</table>"


def render_html(report: QuantReport) -> str:
    """A self-contained page: inline CSS and SVG plots, no scripts, no external references."""
    if not report.checks:
        badge = '<span class="verdict info">REPORTED</span>'
    else:
        badge = (f'<span class="verdict {"pass" if report.passed else "fail"}">'
                 f'{"PASS" if report.passed else "FAIL"}</span>')
    worst_layer, worst_tensor = report.worst_layer, report.worst_tensor
    rows = report.per_layer
    labels = [r["layer"] for r in rows]
    highlight = None if worst_layer is None else worst_layer["layer"]
    layer_rows = [[r["layer"], str(len(r.get("tensors", []))), bits_text(r.get("bits")),
                   fmt(r.get("sqnr_db_min"), "db"), fmt(r.get("kld_mean")), fmt(r.get("kld_share"), "pct"),
                   fmt(r.get("kld_p99")), fmt(r.get("kld_max")), fmt(r.get("same_top1"), "pct"), fmt(r.get("rms_dp")),
                   str(r.get("state", "")), fmt(r.get("state_rel_rms"), "f"), fmt(r.get("state_cos"), "f")]
                  for r in rows]
    worst_row = None if highlight is None else labels.index(highlight)
    tensors = report.per_tensor
    path_tensors = [t for t in tensors if t.get("logits_path")]
    tensor_rows = [[t["name"], str(t.get("layer")), bits_text(t.get("bits")), fmt(t.get("sqnr_db"), "db"),
                    fmt(t.get("rel_err"), "f"), f"{t.get('numel', 0):,}", "yes" if t.get("logits_path") else "no"]
                   for t in tensors]
    worst_t = None if worst_tensor is None else next(i for i, t in enumerate(tensors) if t is worst_tensor)
    q = report.quantized
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>needle-twin quant: {html.escape(scheme_line(report))}</title><style>{CSS}</style></head><body>",
        f"<h1>needle-twin quant {badge}</h1>",
        f'<p class="muted">{html.escape(scheme_line(report))} · {html.escape(str(report.environment.get("dtype")))} · '
        f"{html.escape(verdict_text(report))}</p>",
        "<h2>Figures</h2>", "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in headline(report)) + "</ul>",
        f"<p><b>{html.escape(worst_line(report))}</b></p>",
        "<h2>Per layer</h2>",
        bar_svg(labels, [r.get("kld_mean") for r in rows], log=True, highlight=highlight,
                title="KL mean of the final logits when only this layer is quantized (log scale)"),
        bar_svg(labels, [r.get("state_rel_rms") for r in rows], log=False, highlight=None,
                title="state rel RMS, everything quantized (lanes after a layer; x0; an engram site's value)"),
        _table(("layer", "tensors", "bits", "min SQNR", "KL mean alone", "share", "KL p99 alone", "KL max alone",
                "top-1 alone", "RMS Δp alone", "state", "state rel RMS", "state cos"), layer_rows, worst_row),
        "<h2>Per tensor</h2>",
        bar_svg([t["name"] for t in path_tensors], [t.get("sqnr_db") for t in path_tensors], log=False, unit=" dB",
                highlight=None if worst_tensor is None else worst_tensor["name"],
                colours=[_BITS_COLOURS.get(t.get("bits"), "#57606a") for t in path_tensors],
                title="SQNR per tensor on the logits path (colour: bits; red: the worst)"),
        _table(("tensor", "layer", "bits", "SQNR", "rel err", "elements", "logits path"), tensor_rows, worst_t),
    ]
    if report.greedy is not None:
        parts += ["<h2>Greedy decoding</h2>", f"<p>{html.escape(greedy_line(report.greedy))}</p>"]
    parts += _deploy_html(report)
    parts += ["<h2>Quantized model</h2>", f"<pre>{html.escape(json.dumps(json_safe(q), indent=1))}</pre>",
              "<h2>Inputs</h2>", f"<pre>{html.escape(json.dumps(json_safe(report.inputs), indent=1))}</pre>",
              "<h2>Model</h2>", f"<pre>{html.escape(json.dumps(json_safe(report.model), indent=1))}</pre>",
              "<h2>Environment</h2>", f"<pre>{html.escape(json.dumps(json_safe(report.environment), indent=1))}</pre>"]
    if report.notes:
        parts += ["<h2>Notes</h2>", "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in report.notes) + "</ul>"]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _kl_cells(f: Mapping[str, Any] | None) -> list[str]:
    f = f or {}
    return [fmt(f.get("kld_mean")), fmt(f.get("kld_p99")), fmt(f.get("kld_max")), fmt(f.get("same_top1"), "pct")]


def _deploy_html(report: QuantReport) -> list[str]:
    """The Needle 3 sections: the three-way table, per deploy site, per rung, the .cact's CQ check."""
    parts = []
    if report.deploy:
        rows = [[name, str(m.get("what", "")), *_kl_cells(m)] for name, m in report.deploy.get("models", {}).items()]
        parts += ["<h2>Float / deploy fake-quant / .cact</h2>",
                  _table(("model", "what", "KL mean", "KL p99", "KL max", "same top-1"), rows)]
    if report.per_site:
        sites = report.per_site
        parts += ["<h2>Per deploy-numerics site</h2>",
                  bar_svg([r["site"] for r in sites], [r["cumulative"].get("kld_mean") for r in sites], log=True,
                          title="KL mean against the float model, sites switched on one at a time over CQ weights"),
                  _table(("site", "what", "KL mean", "KL p99", "KL max", "same top-1", "KL added", "KL alone"),
                         [[r["site"], r.get("title", ""), *_kl_cells(r["cumulative"]), fmt(r.get("kld_mean_added")),
                           fmt((r.get("alone") or {}).get("kld_mean")) if r.get("alone") else "-"] for r in sites])]
        heads = [(r["site"], h, f) for r in sites for h, f in (r.get("heads") or {}).items()]
        if heads:
            parts.append(_table(("site", "head", "max |Δ|", "min cos"),
                                [[s, h, fmt(f.get("max_abs")), fmt(f.get("min_cos"), "f") if "min_cos" in f else "-"]
                                 for s, h, f in heads]))
    if report.per_rung:
        rungs = report.per_rung
        models = [k for k in rungs[0] if k not in ("depth", "layers") and not k.endswith("_quant_cost")]
        for name in models:
            parts.append(bar_svg([f"d{r['depth']}" for r in rungs], [r[name].get("kld_mean") for r in rungs],
                                 log=True, title=f"{name}: KL mean of each rung against the full float model"))
        parts = parts[:len(parts) - len(models)] + ["<h2>Per ladder rung</h2>"] + parts[len(parts) - len(models):]
        head = ("depth", "layers", *[f"{m} KL mean" for m in models])
        parts.append(_table(head, [[str(r["depth"]), ",".join(map(str, r["layers"])),
                                    *[fmt(r[m].get("kld_mean")) for m in models]] for r in rungs]))
    if report.cq_check:
        c = report.cq_check
        parts += ["<h2>.cact CQ records against this checkpoint</h2>",
                  f"<p>{html.escape(cq_check_line(c))}</p>"]
        events = [*c.get("flip_events", []), *c.get("divergence_events", [])]
        if events:
            parts.append(_table(("tensor", "row", "group", "kind", "margin (ulp)", "verdict"),
                                [[e["tensor"], str(e["row"]), str(e["group"]), e["kind"], f"{e['margin_ulps']:.1f}"
                                  if e.get("margin_ulps") is not None else "inf",
                                  "flip" if e in c.get("flip_events", []) else "DIVERGENCE"] for e in events]))
    return parts


def cq_check_line(c: Mapping[str, Any]) -> str:
    return (f"{c.get('groups')} CQ groups: {c.get('flips')} rounding flip(s), {c.get('divergent_groups')} real "
            f"difference(s); the rest within {fmt(c.get('rel_outside_max'))} relative (budget "
            f"{fmt(c.get('budget_rel'))}): {'ok' if c.get('ok') else 'NOT OK'}")


def deploy_lines(report: QuantReport) -> list[str]:
    """The Needle 3 sections in plain lines (terminal)."""
    lines = []
    for name, m in (report.deploy or {}).get("models", {}).items():
        lines.append(f"{name}: KL mean {fmt(m.get('kld_mean'))}, same top-1 {fmt(m.get('same_top1'), 'pct')}")
    for r in report.per_site or []:
        alone = f"; alone {fmt(r['alone'].get('kld_mean'))}" if r.get("alone") else ""
        lines.append(f"site {r['site']}: KL mean {fmt(r['cumulative'].get('kld_mean'))} (added "
                     f"{fmt(r.get('kld_mean_added'))}{alone})")
    for r in report.per_rung or []:
        cells = ", ".join(f"{k} {fmt(v.get('kld_mean'))}" for k, v in r.items()
                          if isinstance(v, dict) and not k.endswith("_quant_cost"))
        lines.append(f"rung d{r['depth']}: KL mean vs the full float model: {cells}")
    if report.cq_check:
        lines.append(".cact CQ check: " + cq_check_line(report.cq_check))
    return lines


__all__ = [
    "KLD_STATS", "SCHEMA", "SCHEMA_VERSION", "QuantReport", "ReportError", "Thresholds", "load_json", "render_html",
    "render_terminal", "rescore", "score", "to_json",
]
