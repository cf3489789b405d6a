"""The CLI works from what families declare: their options, their adapters; it names no family itself."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from convert.registry import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = "tests/data/needle-v1-tiny.pkl"
runner = CliRunner()


@pytest.mark.parametrize("command", ["parity", "generate"])
def test_every_declared_option_is_on_its_command(command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for family in FAMILIES.values():
        for option in getattr(family, f"{command}_options"):
            assert option.flag in result.output, f"{family.name}: {option.flag} missing from `{command} --help`"


def test_cli_names_no_family():
    source = (ROOT / "cli.py").read_text(encoding="utf-8")
    assert re.findall(r"\.name\s*[!=]=|[!=]=\s*[\"']v\d[\"']|[\"']v\d[\"']\s*[!=]=", source) == []
    assert "parity_tests.v1" not in source and "_generate_v" not in source


def test_a_family_without_twins_is_refused_in_one_line(monkeypatch):
    from parity_tests import families

    monkeypatch.delitem(families.ADAPTERS, "v3", raising=False)  # a registered family without declared twins
    # A tiny checkpoint of that family: were the refusal ever to go, the run would still take seconds, not minutes.
    result = runner.invoke(app, ["parity", "tests/data/v3/needle-v3-tiny.safetensors", "--no-grads", "--generate",
                                 "0", "--batch", "1", "--seq-len", "4"])
    assert result.exit_code == 2, result.output
    assert "error: " in result.output and "no parity twins yet" in result.output, result.output


def test_a_run_resolves_its_family_once_into_a_frozen_spec(monkeypatch):
    from parity_tests import commands, engine

    looked_up, specs = [], []
    named = commands.adapter_named
    monkeypatch.setattr(commands, "adapter_named", lambda name: looked_up.append(name) or named(name))
    run = commands.run
    monkeypatch.setattr(commands, "run", lambda spec, *a, **k: specs.append(spec) or run(spec, *a, **k))
    report = commands.parity(commands.ParityRequest(FIXTURE, grads=False, generate=0, lengths={"src_len": 8}))
    assert looked_up == ["v1"] and report.passed
    [spec] = specs
    assert isinstance(spec, engine.RunSpec) and spec.adapter.name == "v1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.dtype = "bfloat16"
