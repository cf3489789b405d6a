"""The user documentation: the performance table is what the results files give, and the prose speaks to users."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "decisions" / "README.md"]
# Words about how the work was organised, not about the product.
DIARY = re.compile(r"\bsessions?\b|\bissues?\b|\blent\b|\bthis (run|stop)\b|\bhelpers?\b|\bdiary\b|\breview mend\b",
                   re.I)


def _table_module():
    spec = importlib.util.spec_from_file_location("bench_table", ROOT / "benchmarks" / "table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_performance_table_is_the_results():
    table = _table_module()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert table.with_table(readme, table.render(table.load())) == readme, \
        "README.md's performance table is stale: run python benchmarks/table.py"


def test_every_result_states_machine_flags_date_and_command():
    for data in _table_module().load():
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]), data["file"]
        assert data["command"].strip() and data["machine"]["description"].strip(), data["file"]
        assert "cpu_flags" in data["machine"] and data["rows"], data["file"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_have_no_diary_language(path):
    found = [(n, m.group()) for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             for m in DIARY.finditer(line)]
    assert found == [], f"{path.name}: words about how the work was organised, not the product: {found}"
