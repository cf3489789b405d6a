"""scripts/device-check.sh on a machine without a GPU: it parses, documents itself and refuses in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device-check.sh"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_help_names_every_option_and_the_tf32_budget():
    done = run("--help")
    assert done.returncode == 0, done.stderr
    for word in ("--python", "--out", "--skip-bench", "TF32", "2e-2"):
        assert word in done.stdout, word


def test_an_unknown_argument_is_refused_in_one_line(tmp_path):
    done = run("--out", str(tmp_path / "r"), "--bogus")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "--bogus" in done.stderr and "--help" in done.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot be seen")
def test_without_cuda_it_refuses_in_one_line_and_writes_nothing(tmp_path):
    done = run("--python", sys.executable, "--out", str(tmp_path / "r"))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no CUDA device" in done.stderr, done.stderr
    assert not (tmp_path / "r").exists()
