"""benchmarks/bench_generate_v3.py: a --quick smoke run writes a results file the README table reads, its memory
bound counts what NEEDLE_V3.md's parameter table says a step reads, and bad --only input exits 2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from convert.v3 import TransformerConfig

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _module("bench_generate_v3")


def test_step_bytes_at_the_default_config(bench):
    # NEEDLE_V3.md §2 (counted there with jax.eval_shape): the stack is 36,488,980 + 1,475,100 (mHC) + 768 (final
    # norm) params, the tied output 16384 x 768; engram projections 5 sites x 2 x 768 x 768
    sizes = bench.step_bytes(TransformerConfig(dtype="float32"), 1, 256, 64)
    assert sizes["stack"] == (36_488_980 + 1_475_100 + 768) * 4
    assert sizes["output"] == 16384 * 768 * 4
    assert sizes["engram_proj"] == 5 * 2 * 768 * 768 * 4
    # steps feed positions 256..318, each seeing itself and every earlier key (all < the 1024 window): 288 on
    # average, K = 2 heads of hq 48 + hv 64 in 20 layers
    assert sizes["kv"] == 20 * 288 * 2 * (48 + 64) * 4
    assert bench.step_bytes(TransformerConfig(dtype="bfloat16"), 16, 256, 64)["stack"] == sizes["stack"] // 2


def test_quick_run_writes_a_results_file_the_table_reads(bench, tmp_path, capsys):
    out = tmp_path / "quick.json"
    code = bench.main(["--quick", "--methods", "torch-eager", "--dtype", "float32", "--batch", "1", "--repeats", "1",
                       "--prompt-len", "8", "--new-tokens", "3", "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["schema"] == "needle-twin/bench-result" and data["command"].startswith("benchmarks/bench_generate_v3")
    assert "cpu_flags" in data["machine"] and data["date"]
    (row,) = data["rows"]
    assert row["benchmark"] == "generate, torch eager" and row["setting"] == "Needle 3 quick, float32, batch 1"
    assert row["decode_tok_s"] > 0 and row["e2e_tok_s"] > 0 and 0 < row["of_bound"]
    assert "target b1: torch-eager float32 decode" in capsys.readouterr().out
    table = _module("table").render([{**data, "file": out.name}])
    assert "| generate, torch eager | Needle 3 quick, float32, batch 1 |" in table and "% of the memory bound" in table


def test_bad_only_exits_2(bench, capsys):
    assert bench.main(["--quick", "--only", "torch/float32"]) == 2
    err = capsys.readouterr().err
    assert "--only torch/float32" in err and "torch-compiled/float32/b1" in err
