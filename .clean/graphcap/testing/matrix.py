"""The backend matrix of docs/conformance-results.md, generated from recorded JSON results.

::

    python -m graphcap.testing.matrix docs/conformance/*.json --update docs/conformance-results.md

prints the Markdown table built from the records (one row each, newest first per backend) or,
with ``--update``, rewrites the part of the page between the ``matrix`` markers, so the matrix
is never written by hand. A check that does not apply to a backend without graphs counts under
"no graphs", never under "skipped".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

START, END = "<!-- matrix:start (generated) -->", "<!-- matrix:end -->"
COLUMNS = (
    "backend",
    "plugin",
    "device",
    "torch",
    "transformers",
    "date (UTC)",
    "checks",
    "passed",
    "failed",
    "no graphs",
    "skipped",
    "JSON",
)


def row(record: dict[str, Any], link: str) -> list[str]:
    """One table row: what ran, where, with which versions, and the outcome counts."""
    backend, versions, summary = record["backend"], record["versions"], record["summary"]
    device = record.get("device")
    failed = summary.get("failed", 0) + summary.get("error", 0)
    return [
        f"`{backend.get('name') or backend.get('requested')}`",
        versions.get("plugin") or "—",
        f"{device['name']} (`{device['device']}`)" if device else "not selected",
        versions.get("torch") or "—",
        versions.get("transformers") or "—",
        record["date"].replace("T", " ")[:16],
        str(len(record["checks"])),
        str(summary.get("passed", 0)),
        f"**{failed}**" if failed else "0",
        str(summary.get("no graphs", 0)),
        str(summary.get("skipped", 0)),
        f"[{Path(link).name}]({link})",
    ]


def render(paths: list[Path], relative_to: Path) -> list[str]:
    """The Markdown table for the records at ``paths``, links relative to ``relative_to``."""
    records = []
    for path in paths:
        record = json.loads(path.read_text())
        link = Path(os.path.relpath(path.resolve(), relative_to.resolve())).as_posix()
        records.append((record["backend"].get("name") or "", record["date"], record, link))
    records.sort(key=lambda item: (item[0], [-ord(c) for c in item[1]]))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(record, link)) + " |" for _, _, record, link in records]
    return lines


def update(page: Path, table: list[str]) -> str:
    """``page``'s text with the table between the markers replaced."""
    text = page.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{page}: add the markers {START!r} and {END!r} where the table goes")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + START + "\n" + "\n".join(table) + "\n" + END + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphcap.testing.matrix", description=__doc__)
    parser.add_argument("records", nargs="+", type=Path, help="conformance JSON files")
    parser.add_argument("--update", type=Path, metavar="PAGE", help="rewrite PAGE's matrix")
    args = parser.parse_args(argv)
    if args.update is None:
        print("\n".join(render(args.records, Path.cwd())))
        return 0
    args.update.write_text(update(args.update, render(args.records, args.update.parent)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
