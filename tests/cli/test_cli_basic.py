"""The needle-twin entry point: --help and --version through CliRunner and as a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import cli

ROOT = Path(__file__).resolve().parents[2]


def test_version_and_help_in_process():
    runner = CliRunner()
    result = runner.invoke(cli.app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"needle-twin {cli.__version__}"
    result = runner.invoke(cli.app, ["--help"])
    assert result.exit_code == 0 and "Flax/JAX <-> PyTorch parity" in result.output


def test_version_as_subprocess():
    result = subprocess.run([sys.executable, "-m", "cli", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"needle-twin {cli.__version__}"


def test_unknown_command_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "cli", "frobnicate"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert "No such command" in result.stderr
