"""Report outputs: the JSON schema and round trip, re-scoring, the terminal table and the HTML page."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import re

import pytest
from rich.console import Console

from parity_tests.engine import run_parity
from parity_tests.report import (
    SCHEMA,
    SCHEMA_VERSION,
    Report,
    ReportError,
    load_json,
    render_html,
    render_terminal,
    rescore,
    to_json,
)
from parity_tests.tolerances import get_profile, with_overrides
from parity_tests.v1.tolerances import BUDGETS

NUMBER = (int, float)


def run(*args, **kw):
    """The engine with gradients and generation off unless a test asks (each compiles for seconds)."""
    return run_parity(*args, **{"grads": False, "generate": 0, **kw})


@pytest.fixture(scope="module")
def passing(fixture_checkpoint, fixture_batch) -> Report:
    return run(fixture_checkpoint.config, fixture_checkpoint.params, fixture_batch, grads=True, generate=3,
                      model_info={"flax_checkpoint": "tests/data/needle-v1-tiny.pkl"}, seeds={"inputs": 0})


@pytest.fixture(scope="module")
def failing(fixture_checkpoint, fixture_batch) -> Report:
    """Torch weights with two query features of decoder layer 1 swapped."""
    bad = copy.deepcopy(fixture_checkpoint.params)
    q = bad["decoder"]["layers"]["DecoderBlock_0"]["self_attn"]["q_proj"]["kernel"]  # (L, D, D) Flax (in, out)
    q[1, :, [0, 1]] = q[1, :, [1, 0]]
    return run(fixture_checkpoint.config, fixture_checkpoint.params, fixture_batch, torch_params=bad,
                      mode="isolated")


def _strict_json(text: str):
    """Standard JSON only: NaN / Infinity literals are an error."""
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=reject)


def _check_probe(p: dict, *, logits: bool = False) -> None:
    for key in ("max_abs", "mean_abs", "rel_l2", "cosine", "ref_max_abs"):
        assert isinstance(p[key], NUMBER) or p[key] is None, key
    assert isinstance(p["name"], str) and isinstance(p["shape"], list)
    assert isinstance(p["tolerance"], dict) and isinstance(p["passed"], (bool, type(None)))
    if logits:
        for key in ("kl_mean", "kl_max", "top1", "top5"):
            assert isinstance(p[key], NUMBER), key
        assert "kl_max" in p["tolerance"]


def test_json_has_the_documented_schema(passing):
    d = _strict_json(to_json(passing))
    assert d["schema"] == SCHEMA and d["schema_version"] == SCHEMA_VERSION
    assert d["passed"] is True and d["first_divergence"] is None
    assert d["num_params"] == 110_295 and d["mode"] == "propagated" and d["dtype"] == "float32"
    assert [p["name"] for p in d["probes"]][:2] == ["encoder.embed", "encoder.layers.0.self_attn"]
    for p in d["probes"]:
        _check_probe(p, logits=p["name"] == "logits")
        assert isinstance(p["passed"], bool)
        assert {"rel_l2", "max_abs"} <= set(p["tolerance"])
    prof = d["profile"]
    assert prof["name"] == "float32-cpu" and prof["why"]
    for key in ("local", "drift", "grads_total", "grads"):
        assert set(prof[key]) == {"rel_l2", "max_rel", "atol", "kl_max"}
    g = d["gradients"]
    assert g["passed"] is True and g["first_failure"] is None and isinstance(g["loss_flax"], float)
    _check_probe(g["total"])
    assert g["total"]["shape"] == [110_295]
    assert len(g["params"]) == 31
    for p in g["params"]:
        _check_probe(p)
    gen = d["generation"]
    assert gen["max_new_tokens"] == 3 and "first_diff_step" in gen
    env = d["environment"]
    assert {"devices", "precision", "versions", "seeds", "platform"} <= set(env)
    assert env["seeds"] == {"inputs": 0}
    assert d["inputs"]["batch"] == 3 and d["model"]["flax_checkpoint"] == "tests/data/needle-v1-tiny.pkl"


def test_json_round_trip(passing, failing, tmp_path):
    for report in (passing, failing):
        path = tmp_path / "r.json"
        path.write_text(to_json(report))
        again = load_json(path)
        assert again.to_dict() == _strict_json(to_json(report))
        assert again.first_divergence == report.first_divergence and again.passed == report.passed


def test_non_finite_metrics_become_null_and_fail(passing):
    broken = copy.deepcopy(passing)
    broken.probes[3].metrics["rel_l2"] = math.nan
    broken.probes[3].metrics["max_abs"] = math.inf
    d = _strict_json(to_json(broken))
    assert d["probes"][3]["rel_l2"] is None and d["probes"][3]["max_abs"] is None
    again = rescore(Report.from_dict(d), passing.profile)
    assert not again.passed and again.first_divergence == passing.probes[3].name


def _first_over(report: Report, rtol: float) -> str | None:
    """The first probe over a uniform budget, worked out from the metrics directly."""
    b = report.profile.budget(report.mode)
    for p in report.probes:
        m = p.metrics
        if m["rel_l2"] > rtol or m["max_abs"] > b.atol + rtol * m["ref_max_abs"]:
            return p.name
        if p.name == "logits" and m["kl_max"] > b.kl_max:
            return p.name
    return None


def test_rescore_tighter_and_looser(passing, failing):
    same = rescore(passing, passing.profile)
    assert same.passed and [p.passed for p in same.probes] == [p.passed for p in passing.probes]

    rtol = sorted(p.metrics["rel_l2"] for p in passing.probes)[-3]  # just under the two worst probes
    tight = rescore(passing, with_overrides(passing.profile, rtol=rtol))
    assert not tight.passed and tight.exit_code == 1
    assert tight.first_divergence == _first_over(passing, rtol) is not None
    assert [p.metrics for p in tight.probes] == [p.metrics for p in passing.probes]  # metrics untouched
    assert tight.notes[-1].startswith("re-scored against float32-cpu (overridden: rtol=")

    loose = rescore(failing, with_overrides(failing.profile, rtol=10.0, kl_max=10.0))
    assert loose.passed and loose.first_divergence is None and loose.exit_code == 0
    assert not failing.passed  # the original is not modified


def test_rescore_gradients(passing):
    tight = rescore(passing, with_overrides(passing.profile, grad_rtol=0.0))
    assert not tight.passed and tight.first_divergence is None
    assert tight.gradients.first_failure == next(p.name for p in tight.gradients.params if not p.passed)
    bf16 = dataclasses.replace(get_profile(BUDGETS, "bfloat16"), dtype="float32")  # per-parameter: not judged
    assert all(p.passed is None for p in rescore(passing, bf16).gradients.params)


def test_load_json_errors(tmp_path, passing):
    with pytest.raises(ReportError, match="no such report"):
        load_json(tmp_path / "missing.json")
    (tmp_path / "a.json").write_text("{")
    with pytest.raises(ReportError, match="not valid JSON"):
        load_json(tmp_path / "a.json")
    (tmp_path / "b.json").write_text("[]")
    with pytest.raises(ReportError, match="JSON list"):
        load_json(tmp_path / "b.json")
    (tmp_path / "c.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ReportError, match="not a needle-twin parity report"):
        load_json(tmp_path / "c.json")
    d = passing.to_dict()
    (tmp_path / "d.json").write_text(json.dumps({**d, "schema_version": 99}))
    with pytest.raises(ReportError, match="schema version 99"):
        load_json(tmp_path / "d.json")
    del d["probes"]
    (tmp_path / "e.json").write_text(json.dumps(d))
    with pytest.raises(ReportError, match="malformed field"):
        load_json(tmp_path / "e.json")


def _terminal(report: Report) -> str:
    console = Console(file=io.StringIO(), force_terminal=True, color_system="standard", width=220)
    render_terminal(report, console)
    return console.file.getvalue()


def test_terminal_highlights_the_first_divergence(failing):
    out = _terminal(failing)
    lines = out.splitlines()
    first = [line for line in lines if "FIRST DIVERGENCE" in line]
    assert len(first) == 1 and "decoder.layers.1.self_attn" in first[0]
    assert "\x1b[1;37;41m" in first[0]  # bold white on red
    assert "PARITY FAILED" in out and "first divergence at" in out
    for p in failing.probes:
        assert p.name in out


def test_terminal_passing(passing):
    out = _terminal(passing)
    assert "PARITY HOLDS" in out and "FIRST DIVERGENCE" not in out
    assert "all 18 probes and 31 parameter gradients within budget" in out
    assert "KL max" in out and "top-1 agreement 100.0%" in out
    assert "gradients: loss flax" in out and "generation:" in out


def test_html_is_self_contained_with_the_plot(passing, failing):
    for report in (passing, failing):
        page = render_html(report)
        assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
        assert not re.search(r"https?://|<script|<link|@import|url\(|\ssrc=|href=", page, re.IGNORECASE)
        svg = page[page.index("<svg"): page.index("</svg>")]
        lines = re.findall(r'<polyline points="([^"]+)"', svg)
        assert len(lines) == 2 and all(len(pts.split()) == len(report.probes) for pts in lines)
        for p in report.probes:
            assert p.name in page
    page = render_html(failing)
    assert "first divergence: decoder.layers.1.self_attn" in page and "PARITY FAILED" in page
    assert 'class="first"' in page
    assert "PARITY HOLDS" in render_html(passing) and "Gradients (pass)" in render_html(passing)
