"""`needle-twin quant` and re-scoring its report: exit codes, files, errors (figures: parity_tests/v2/test_quant.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli import app
from parity_tests.fixtures import DATA, V2_PKL

runner = CliRunner()
Q4 = DATA / "needle-v2-tiny.q4.cact"
FAST = ["--steps", "2", "--batch", "2", "--seq-len", "8"]


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_quant_writes_json_and_html_and_exits_by_threshold(tmp_path):
    out, page = tmp_path / "q.json", tmp_path / "q.html"
    r = _invoke("quant", V2_PKL, "--cact", Q4, "--json", out, "--html", page, *FAST)
    assert r.exit_code == 0, r.output  # no threshold: reported, exit 0
    report = json.loads(out.read_text())
    assert report["schema"] == "needle-twin/quant-report"
    for key in ("mean", "stderr", "median", "p99", "p999", "max"):
        assert key in report["kld"]
    assert report["per_layer"] and report["per_tensor"] and "same_top1" in report and "rms_dp" in report
    html = page.read_text()
    assert "<svg" in html and "http" not in html and "<script" not in html
    tight = _invoke("quant", V2_PKL, "--cact", Q4, "--max-kld", "1e-9", *FAST)
    assert tight.exit_code == 1 and "QUANT PARITY FAILED" in tight.output


def test_rescore_a_quant_report(tmp_path):
    out = tmp_path / "q.json"
    assert _invoke("quant", V2_PKL, "--bits", "2", "--json", out, *FAST).exit_code == 0
    assert _invoke("rescore", out, "--min-top1", "0.99", "--quiet").exit_code == 1
    assert _invoke("rescore", out, "--max-kld", "100", "--quiet").exit_code == 0
    r = _invoke("rescore", out, "--rtol", "1e-3")
    assert r.exit_code == 2 and "a quant report takes --max-kld" in r.output


@pytest.mark.parametrize("args, needle", [
    ((), "exactly one of --cact FILE or --bits SPEC"),
    (("--bits", "5"), "use 2, 3, 4 or 1.58"),
    (("--cact", DATA / "missing.cact"), "no such file"),
    (("--bits", "4", "--kld-stat", "mode"), "kld"),
    (("--cact", DATA / "v3" / "needle-v3-tiny.cact"), "a Needle 3 file"),
    (("--bits", "4", "--depth", "2"), "--depth judges Needle 3 ladder rungs"),
])
def test_quant_usage_errors_exit_2(args, needle, tmp_path):
    out = tmp_path / "q.json"
    r = _invoke("quant", V2_PKL, *args, "--json", out)
    assert r.exit_code == 2 and needle in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not out.exists()


def test_quant_refuses_a_v1_checkpoint():
    r = _invoke("quant", DATA / "needle-v1-tiny.pkl", "--bits", "4")
    assert r.exit_code == 2 and "quantization parity is for Needle 2 and Needle 3" in r.output
