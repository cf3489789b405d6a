"""Documentation that is generated from code stays equal to it."""

from pathlib import Path

from convert.registry import mapping_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_mapping_doc_is_the_rules():
    doc = (ROOT / "docs" / "MAPPING.md").read_text()
    assert doc == mapping_markdown(), "docs/MAPPING.md is stale: regenerate it (see convert.registry.mapping_markdown)"
