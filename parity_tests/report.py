"""The parity report: data, judging against a profile, JSON round trip, re-scoring, terminal and HTML output.

The JSON schema is documented in parity_tests/SCHEMA.md; `SCHEMA_VERSION` changes when it does.
Judging lives here (`score`) so a fresh run and a re-scored JSON use the same rule.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity_tests.metrics import max_rel_of
from parity_tests.outputs import CSS, ReportError, finite, json_safe, read_report_object
from parity_tests.tolerances import Profile, judge

SCHEMA = "needle-twin/parity-report"
SCHEMA_VERSION = 1
CORE_METRICS = ("max_abs", "mean_abs", "rel_l2", "cosine", "ref_max_abs", "nan_matched", "nan_mismatch")
LOGIT_METRICS = ("kl_mean", "kl_max", "top1", "top5")


@dataclass
class ProbeResult:
    """One compared tensor: a probe (activation) or a parameter gradient."""

    name: str
    shape: list[int]
    metrics: dict[str, float | None]  # CORE_METRICS, plus LOGIT_METRICS for the logits
    tolerance: dict[str, float] = field(default_factory=dict)
    passed: bool | None = False  # None: reported, not judged (half-precision per-parameter gradients)

    @property
    def is_logits(self) -> bool:
        return "kl_max" in self.metrics

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), **{k: finite(v) for k, v in self.metrics.items()},
                "tolerance": dict(self.tolerance), "passed": self.passed}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ProbeResult:
        metrics = {k: d.get(k) for k in (*CORE_METRICS, *LOGIT_METRICS) if k in d}
        passed = d["passed"]
        return cls(d["name"], list(d.get("shape", [])), metrics, dict(d.get("tolerance") or {}),
                   None if passed is None else bool(passed))


@dataclass
class GradientResult:
    loss_flax: float | None
    loss_torch: float | None
    total: ProbeResult  # every parameter's gradient as one vector
    params: list[ProbeResult]  # per Flax parameter (scanned layers stacked); passed None = not judged
    passed: bool = False
    first_failure: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "first_failure": self.first_failure, "loss_flax": finite(self.loss_flax),
                "loss_torch": finite(self.loss_torch), "total": self.total.to_dict(),
                "params": [p.to_dict() for p in self.params]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GradientResult:
        return cls(d.get("loss_flax"), d.get("loss_torch"), ProbeResult.from_dict(d["total"]),
                   [ProbeResult.from_dict(p) for p in d["params"]], bool(d["passed"]), d.get("first_failure"))


@dataclass
class Report:
    mode: str  # "propagated" or "isolated"
    dtype: str
    num_params: int
    profile: Profile
    probes: list[ProbeResult]
    inputs: dict[str, Any]
    model: dict[str, Any]
    environment: dict[str, Any]
    gradients: GradientResult | None = None
    generation: dict[str, Any] | None = None
    lora_gradients: GradientResult | None = None  # an adapter's A/B gradients (--lora)
    flips: dict[str, Any] | None = None  # rounding flips of the quant pass (parity_tests/flips.py); ok False fails
    passed: bool = False
    first_divergence: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "passed": self.passed,
            "first_divergence": self.first_divergence,
            "mode": self.mode,
            "dtype": self.dtype,
            "num_params": self.num_params,
            "profile": self.profile.to_dict(),
            "probes": [p.to_dict() for p in self.probes],
            "gradients": None if self.gradients is None else self.gradients.to_dict(),
            "lora_gradients": None if self.lora_gradients is None else self.lora_gradients.to_dict(),
            "flips": json_safe(self.flips),
            "generation": json_safe(self.generation),
            "inputs": json_safe(self.inputs),
            "model": json_safe(self.model),
            "environment": json_safe(self.environment),
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Report:
        if d.get("schema") != SCHEMA:
            raise ReportError(f"not a needle-twin parity report (schema {d.get('schema')!r}); give a file written "
                              "by `needle-twin parity --json`")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ReportError(f"report schema version {d.get('schema_version')!r} is not {SCHEMA_VERSION}; "
                              "re-run `needle-twin parity` with this version")
        try:
            return cls(
                mode=d["mode"], dtype=d["dtype"], num_params=int(d["num_params"]),
                profile=Profile.from_dict(d["profile"]),
                probes=[ProbeResult.from_dict(p) for p in d["probes"]],
                inputs=d.get("inputs", {}), model=d.get("model", {}), environment=d.get("environment", {}),
                gradients=None if d.get("gradients") is None else GradientResult.from_dict(d["gradients"]),
                lora_gradients=None if d.get("lora_gradients") is None else GradientResult.from_dict(
                    d["lora_gradients"]),
                flips=d.get("flips"), generation=d.get("generation"), passed=bool(d["passed"]),
                first_divergence=d.get("first_divergence"),
                notes=list(d.get("notes", [])),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ReportError(f"report is missing or has a malformed field ({e!s}); the file may be truncated "
                              "or edited; re-run `needle-twin parity --json`") from None




# ----------------------------------------------------------------------------- judging


def score(report: Report, profile: Profile) -> Report:
    """Judge every probe (and gradient) against `profile`; returns a new report. Metrics are not touched."""
    budget = profile.budget(report.mode)
    probes = [_judged(p, budget, logits=p.is_logits) for p in report.probes]
    first = next((p.name for p in probes if not p.passed), None)
    gradients, lora = (_judged_gradients(g, profile) for g in (report.gradients, report.lora_gradients))
    passed = first is None and all(g is None or g.passed for g in (gradients, lora)) and (
        report.flips is None or bool(report.flips.get("ok")))
    return dataclasses.replace(report, profile=profile, probes=probes, gradients=gradients, lora_gradients=lora,
                               passed=passed, first_divergence=first)


def _judged_gradients(gradients: GradientResult | None, profile: Profile) -> GradientResult | None:
    if gradients is None:
        return None
    total = _judged(gradients.total, profile.grads_total)
    if profile.grads is None:
        params = [dataclasses.replace(p, tolerance={}, passed=None) for p in gradients.params]
    else:
        params = [_judged(p, profile.grads) for p in gradients.params]
    failure = next((p.name for p in params if p.passed is False), None if total.passed else total.name)
    return dataclasses.replace(gradients, total=total, params=params, passed=failure is None, first_failure=failure)


def _judged(p: ProbeResult, budget, logits: bool = False) -> ProbeResult:
    passed, tol = judge(p.metrics, budget, logits=logits)
    return dataclasses.replace(p, tolerance=tol, passed=passed)


# ----------------------------------------------------------------------------- files


def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n"


def load_json(path: str | Path) -> Report:
    return Report.from_dict(read_report_object(path, "parity"))


def rescore(report: Report, profile: Profile) -> Report:
    """Re-judge a saved report against new tolerances, without running any model."""
    out = score(report, profile)
    note = f"re-scored against {profile.name} (was {report.profile.name})"
    return dataclasses.replace(out, notes=[*report.notes, note])


# ----------------------------------------------------------------------------- terminal


def _fmt(value: float | None, kind: str = "e") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "nan"
    if kind == "cos":
        return f"{value:.9f}"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    return f"{value:.2e}"


def render_terminal(report: Report, console=None) -> None:
    """A rich table of every probe, the first divergence highlighted, then logits, gradients and generation."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    title = (f"needle-twin parity · {report.mode} · {report.dtype} · {report.num_params:,} params · "
             f"profile {report.profile.name}")
    table = Table(title=title, title_justify="left", header_style="bold")
    for col, justify in (("#", "right"), ("probe", "left"), ("max abs", "right"), ("mean abs", "right"),
                         ("rel L2", "right"), ("cosine", "right"), ("budget rel L2 / max", "right"), ("", "left")):
        table.add_column(col, justify=justify)
    for i, p in enumerate(report.probes):
        m, t = p.metrics, p.tolerance
        first = p.name == report.first_divergence
        status = "FIRST DIVERGENCE" if first else ("ok" if p.passed else "FAIL")
        style = "bold white on red" if first else (None if p.passed else "red")
        table.add_row(str(i), p.name, _fmt(m.get("max_abs")), _fmt(m.get("mean_abs")), _fmt(m.get("rel_l2")),
                      _fmt(m.get("cosine"), "cos"), f"{_fmt(t.get('rel_l2'))} / {_fmt(t.get('max_abs'))}", status,
                      style=style)
    console.print(table, highlight=False)

    say = lambda text: console.print(text, highlight=False)  # noqa: E731 - plain lines, no auto-colouring
    logits = next((p for p in report.probes if p.is_logits), None)
    if logits is not None:
        m = logits.metrics
        say(f"logits: KL mean {_fmt(m.get('kl_mean'))}, KL max {_fmt(m.get('kl_max'))} "
            f"(budget {_fmt(logits.tolerance.get('kl_max'))}), top-1 agreement {_fmt(m.get('top1'), 'pct')}, "
            f"top-5 overlap {_fmt(m.get('top5'), 'pct')}")
    if report.flips is not None:  # the quant pass's rounding flips (parity_tests/flips.py)
        verdict = "ok" if report.flips.get("ok") else "[red]FAIL[/]"
        lines = str(report.flips.get("summary", "")).splitlines() or [""]
        say(f"rounding flips ({', '.join(report.flips.get('probes', []))}): {escape(lines[0])} {verdict}")
        for line in lines[1:]:
            say(escape(line))
    if report.gradients is not None:
        _render_gradients(report.gradients, console)
    if report.lora_gradients is not None:
        _render_gradients(report.lora_gradients, console, "LoRA gradients (adapter A/B)")
    if report.generation is not None:
        say(generation_line(report.generation))
    for note in report.notes:
        say(f"[dim]note: {escape(note)}[/]")
    env = report.environment
    devices, pinned = env.get("devices", {}), env.get("precision", {}).get("pinned")
    say(f"[dim]devices: torch {escape(str(devices.get('torch', '?')))}, jax {escape(str(devices.get('jax', '?')))}; "
        f"precision {'pinned (highest)' if pinned else 'library defaults'}[/]")
    say(verdict_line(report))


def verdict_line(report: Report) -> str:
    """One rich-markup line: the verdict and where parity first failed."""
    from rich.markup import escape

    what = f"{report.mode}, {report.dtype}, profile {escape(report.profile.name)}"
    if report.passed:
        g = report.gradients
        judged = 0 if g is None else sum(p.passed is not None for p in g.params)
        grads = "" if g is None else (f" and {judged} parameter gradients" if judged else " and the whole gradient")
        return f"[bold green]PARITY HOLDS[/]: all {len(report.probes)} probes{grads} within budget ({what})"
    if report.first_divergence is not None:
        return f"[bold red]PARITY FAILED[/]: first divergence at [bold]{escape(report.first_divergence)}[/] ({what})"
    failed = next(g for g in (report.gradients, report.lora_gradients) if g is not None and not g.passed)
    kind = "LoRA gradient" if failed is report.lora_gradients else "gradient"
    return (f"[bold red]PARITY FAILED[/]: activations agree, {kind} of [bold]{escape(str(failed.first_failure))}[/] "
            f"differs ({what})")


def _sortable(value: float | None) -> float:
    """Non-finite metrics (null) sort as the worst."""
    return math.inf if value is None or math.isnan(value) else value


def _render_gradients(g: GradientResult, console, what: str = "gradients") -> None:
    from rich.table import Table

    judged = [p for p in g.params if p.passed is not None]
    within = f"{sum(bool(p.passed) for p in judged)}/{len(judged)} params within budget" if judged else \
        "per-parameter not judged in half precision"
    t = g.total
    console.print(f"{what}: loss flax {_fmt(g.loss_flax)}, torch {_fmt(g.loss_torch)}; all parameters rel L2 "
                  f"{_fmt(t.metrics.get('rel_l2'))} (budget {_fmt(t.tolerance.get('rel_l2'))}) "
                  f"{'ok' if t.passed else 'FAIL'}; {within}", highlight=False)
    table = Table(title=f"{what}, worst 5 parameters", title_justify="left", header_style="bold")
    for col in ("param", "max abs", "rel L2", "cosine", "budget rel L2", ""):
        table.add_column(col)
    for p in sorted(g.params, key=lambda p: (p.passed is not False, -_sortable(p.metrics.get("rel_l2"))))[:5]:
        first = p.name == g.first_failure
        status = "FIRST FAILURE" if first else {True: "ok", False: "FAIL", None: "-"}[p.passed]
        table.add_row(p.name, _fmt(p.metrics.get("max_abs")), _fmt(p.metrics.get("rel_l2")),
                      _fmt(p.metrics.get("cosine"), "cos"), _fmt(p.tolerance.get("rel_l2")), status,
                      style="bold white on red" if first else ("red" if p.passed is False else None))
    console.print(table, highlight=False)


def generation_line(gen: Mapping[str, Any]) -> str:
    """One line on greedy generation (parity_tests.generation's dict): where tokens part, logits error, caches."""
    step = gen.get("first_diff_step")
    head = (f"greedy tokens identical ({gen.get('rows_equal')}/{gen.get('rows')} rows, "
            f"{gen.get('max_new_tokens')} new tokens)" if step is None
            else f"greedy tokens first differ at step {step} ({gen.get('rows_equal')}/{gen.get('rows')} rows equal)")
    flax_cvr, torch_cvr = (_fmt(gen.get(f"{t}_cached_vs_recompute_max_rel")) for t in ("flax", "torch"))
    return (f"generation: {head}; step logits max rel {_fmt(gen.get('logits_max_rel'))} over "
            f"{gen.get('steps_compared')} steps; cached vs recompute max rel: flax {flax_cvr}, torch {torch_cvr}")


# ----------------------------------------------------------------------------- HTML



def error_plot_svg(report: Report) -> str:
    """Per-probe relative error (rel L2 and max/max|ref|) on a log axis, budgets dashed, first divergence marked."""
    budget = report.profile.budget(report.mode)
    n = len(report.probes)
    step = 13
    left, right, top, bottom = 64, 20, 26, 150
    width = max(720, left + right + step * max(n, 1))
    height = top + 260 + bottom
    plot_h = 260
    series = {"rel_l2": [p.metrics.get("rel_l2") for p in report.probes],
              "max_rel": [max_rel_of(p.metrics) for p in report.probes]}
    finite = [v for vals in series.values() for v in vals if v is not None and math.isfinite(v) and v > 0]
    lo = math.floor(math.log10(min([*finite, budget.rel_l2, budget.max_rel]))) - 1
    hi = math.ceil(math.log10(max([*finite, budget.rel_l2, budget.max_rel]))) + 1
    hi = max(hi, lo + 2)

    def y(v: float | None) -> float:
        if v is None or not math.isfinite(v):
            return float(top)  # non-finite: pinned to the top edge
        v = max(v, 10.0 ** lo)  # exact zeros sit on the bottom edge
        return top + plot_h * (hi - math.log10(v)) / (hi - lo)

    def x(i: int) -> float:
        return left + step * (i + 0.5)

    # Inline SVG in HTML5 needs no xmlns, so the page holds no URL at all.
    out = [f'<svg width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="per-probe error plot">']
    out.append(f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{plot_h}" fill="#fafbfc" '
               'stroke="#d0d7de"/>')
    for d in range(lo, hi + 1):
        yy = y(10.0 ** d)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eaeef2"/>')
        out.append(f'<text x="{left - 6}" y="{yy + 3:.1f}" text-anchor="end">1e{d}</text>')
    for name, value, color in (("rel L2 budget", budget.rel_l2, "#0969da"),
                               ("max budget", budget.max_rel, "#bc4c00")):
        yy = y(value)
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="{color}" '
                   f'stroke-dasharray="5 4"><title>{name} {value:.2e}</title></line>')
    table = {p.name: i for i, p in enumerate(report.probes)}
    if report.first_divergence in table:
        xx = x(table[report.first_divergence])
        out.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{top}" y2="{top + plot_h}" stroke="#cf222e" '
                   'stroke-width="2"/>')
        out.append(f'<text x="{xx + 4:.1f}" y="{top - 8}" fill="#cf222e">first divergence: '
                   f'{html.escape(report.first_divergence)}</text>')
    for key, color in (("rel_l2", "#0969da"), ("max_rel", "#bc4c00")):
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(series[key]))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.3"/>')
        for i, (v, p) in enumerate(zip(series[key], report.probes, strict=True)):
            fill = color if p.passed else "#cf222e"
            label = "nan" if v is None else f"{v:.3e}"
            out.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="{2.2 if p.passed else 3.2}" fill="{fill}">'
                       f'<title>{html.escape(p.name)} {key} {label}</title></circle>')
    for i, p in enumerate(report.probes):
        major = p.name.endswith(".out") or "." not in p.name or p.name.endswith(".embed")
        xx = x(i)
        out.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{top + plot_h}" y2="{top + plot_h + (6 if major else 3)}" '
                   'stroke="#57606a"/>')
        if major:
            out.append(f'<text transform="translate({xx + 3:.1f},{top + plot_h + 10}) rotate(60)">'
                       f'{html.escape(p.name)}</text>')
    legend_y = height - 12
    out.append(f'<text x="{left}" y="{legend_y}"><tspan fill="#0969da">&#9679; rel L2</tspan>  '
               f'<tspan fill="#bc4c00">&#9679; max|t-f| / max|f|</tspan>  dashed: budgets ({report.mode})  '
               '<tspan fill="#cf222e">&#9679; over budget</tspan></text>')
    out.append("</svg>")
    return "\n".join(out)


def _cells(p: ProbeResult) -> str:
    m, t = p.metrics, p.tolerance
    vals = [_fmt(m.get("max_abs")), _fmt(m.get("mean_abs")), _fmt(m.get("rel_l2")), _fmt(m.get("cosine"), "cos"),
            _fmt(t.get("rel_l2")), _fmt(t.get("max_abs"))]
    return "".join(f"<td>{html.escape(v)}</td>" for v in vals)


def _probe_rows(items: list[ProbeResult], first: str | None) -> str:
    rows = []
    for i, p in enumerate(items):
        cls = "first" if p.name == first else ("bad" if p.passed is False else "")
        status = "first divergence" if p.name == first else {True: "ok", False: "FAIL", None: "not judged"}[p.passed]
        rows.append(f'<tr class="{cls}"><td>{i}</td><td class="name">{html.escape(p.name)}</td>{_cells(p)}'
                    f"<td>{status}</td></tr>")
    return "\n".join(rows)


_HEAD = ('<tr><th>#</th><th class="name">{what}</th><th>max abs</th><th>mean abs</th><th>rel L2</th>'
         "<th>cosine</th><th>budget rel L2</th><th>budget max abs</th><th></th></tr>")


def _dl(items: Mapping[str, Any]) -> str:
    return "<dl>" + "".join(f"<dt>{html.escape(str(k))}</dt><dd>{html.escape(str(v))}</dd>"
                            for k, v in items.items()) + "</dl>"


def render_html(report: Report) -> str:
    """A self-contained page (inline CSS and SVG, no scripts, no external references)."""
    verdict = ('<span class="verdict pass">PARITY HOLDS</span>' if report.passed
               else '<span class="verdict fail">PARITY FAILED</span>')
    where = report.first_divergence or next((g.first_failure for g in (report.gradients, report.lora_gradients)
                                             if g is not None and g.first_failure), None)
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>needle-twin parity: {'pass' if report.passed else 'fail'}</title><style>{CSS}</style></head><body>",
        f"<h1>needle-twin parity {verdict}</h1>",
        f'<p class="muted">{html.escape(report.mode)} mode · {html.escape(report.dtype)} · '
        f"{report.num_params:,} parameters · profile {html.escape(report.profile.name)}"
        + (f" · first divergence <b>{html.escape(where)}</b>" if where else "") + "</p>",
        "<h2>Error per probe (execution order)</h2>", error_plot_svg(report),
        f"<p class=\"muted\">Budgets: {html.escape(report.profile.why)}</p>",
        "<h2>Probes</h2>", "<table>", _HEAD.format(what="probe"),
        _probe_rows(report.probes, report.first_divergence), "</table>",
    ]
    logits = next((p for p in report.probes if p.is_logits), None)
    if logits is not None:
        m = logits.metrics
        parts += ["<h2>Logits</h2>", _dl({"KL mean (flax || torch)": _fmt(m.get("kl_mean")),
                                          "KL max": _fmt(m.get("kl_max")),
                                          "KL max budget": _fmt(logits.tolerance.get("kl_max")),
                                          "top-1 agreement": _fmt(m.get("top1"), "pct"),
                                          "top-5 overlap": _fmt(m.get("top5"), "pct")})]
    for title, g in (("Gradients", report.gradients), ("LoRA gradients (adapter A/B)", report.lora_gradients)):
        if g is None:
            continue
        parts += [f"<h2>{title} ({'pass' if g.passed else 'FAIL'})</h2>",
                  _dl({"loss (flax)": _fmt(g.loss_flax), "loss (torch)": _fmt(g.loss_torch),
                       "all parameters, rel L2": f"{_fmt(g.total.metrics.get('rel_l2'))} (budget "
                                                 f"{_fmt(g.total.tolerance.get('rel_l2'))})",
                       "first failure": g.first_failure or "none"}),
                  "<table>", _HEAD.format(what="parameter"), _probe_rows(g.params, g.first_failure), "</table>"]
    if report.generation is not None:
        generation = html.escape(json.dumps(json_safe(report.generation), indent=1))
        summary = html.escape(generation_line(report.generation).removeprefix("generation: "))
        parts += ["<h2>Generation</h2>", f"<p>{summary}</p>", f"<pre>{generation}</pre>"]
    parts += ["<h2>Inputs</h2>", _dl(report.inputs), "<h2>Model</h2>",
              _dl({k: v for k, v in report.model.items() if k != "config"}),
              f"<pre>{html.escape(json.dumps(report.model.get('config', {}), indent=1))}</pre>",
              "<h2>Environment</h2>", f"<pre>{html.escape(json.dumps(json_safe(report.environment), indent=1))}</pre>"]
    if report.notes:
        parts += ["<h2>Notes</h2>", "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in report.notes) + "</ul>"]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
