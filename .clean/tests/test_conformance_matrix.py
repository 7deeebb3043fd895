"""docs/conformance-results.md's matrix is what ``graphcap.testing.matrix`` makes of the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from graphcap.testing import matrix

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_committed_matrix_is_generated_from_the_records() -> None:
    page = DOCS / "conformance-results.md"
    records = sorted((DOCS / "conformance").glob("*.json"))
    table = matrix.render(records, page.parent)
    assert matrix.update(page, table) == page.read_text(), (
        "docs/conformance-results.md is out of date: run python -m graphcap.testing.matrix "
        "docs/conformance/*.json --update docs/conformance-results.md"
    )
    assert len(table) == 2 + len(records)


def test_no_graphs_and_failures_are_shown_apart(tmp_path: Path) -> None:
    record = {
        "date": "2026-12-01T00:00:00+00:00",
        "backend": {"name": "eager-only"},
        "device": {"device": "cpu", "name": "x86_64"},
        "versions": {"plugin": "p 1", "torch": "2", "transformers": "5"},
        "summary": {"passed": 9, "failed": 1, "error": 1, "no graphs": 14, "skipped": 2},
        "checks": [{}] * 27,
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    (row,) = matrix.render([path], tmp_path)[2:]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[6:11] == ["27", "9", "**2**", "14", "2"]
