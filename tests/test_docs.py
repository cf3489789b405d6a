"""Documentation that is generated from code stays equal to it."""

from pathlib import Path

from convert.mapping import markdown_table

ROOT = Path(__file__).resolve().parents[1]


def test_mapping_doc_is_the_table():
    doc = (ROOT / "docs" / "MAPPING.md").read_text()
    assert doc.endswith(markdown_table()), "docs/MAPPING.md is stale: regenerate it from convert.mapping.markdown_table"
