"""The ``graphcap`` command: ``graphcap info`` (installed backends) and ``graphcap bench``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from graphcap.errors import BackendSelectionError
from graphcap.registry import discover, get_backend, unclaimed_accelerator


def backend_table() -> dict[str, Any]:
    """Every installed backend and broken plugin, with availability and capabilities.

    A plugin found broken while selecting or describing (a probe, constructor or
    ``create_graph()`` that raised) is listed under ``broken_plugins`` with the reason.
    """
    registry = discover()
    try:
        selected: str | None = get_backend().name
        selection_error = None
    except BackendSelectionError as exc:
        selected, selection_error = None, str(exc)
    rows = registry.describe_backends()
    for row in rows:
        row["selected"] = row["name"] == selected
    return {
        "backends": rows,
        "broken_plugins": [vars(f) for f in registry.failures],
        "selected": selected,
        "selection_error": selection_error,
        "unclaimed_accelerator": unclaimed_accelerator(registry),
    }


def _format_table(info: dict[str, Any]) -> str:
    header = ("", "backend", "distribution", "available", "device", "capabilities")
    lines = [header]
    for row in info["backends"]:
        caps = row.get("capabilities") or {}
        flags = [k for k, v in caps.items() if v is True]
        if caps:
            flags.append(f"mask={caps['mask_form']}")
        lines.append(
            (
                "*" if row["selected"] else "",
                row["name"],
                f"{row['distribution']} {row['version']}".strip(),
                "yes" if row["available"] else "no (below)",
                row.get("device", "-"),
                ", ".join(flags) or "-",
            )
        )
    for failure in info["broken_plugins"]:
        offered = ", ".join(failure["backends"]) or f"({failure['entry_point']})"
        lines.append(("", offered, failure["distribution"], "broken (below)", "-", "-"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = [
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]
    for row in info["backends"]:
        if not row["available"]:
            out.append(f"{row['name']} unavailable: {row['reason']}")
    for failure in info["broken_plugins"]:
        out.append(
            f"broken plugin {failure['entry_point']!r} ({failure['distribution']}): "
            f"{failure['error']}"
        )
    if info["selected"]:
        out.append(f"* selected: {info['selected']} (set GRAPHCAP_BACKEND to choose another)")
    if info["selection_error"]:
        out.append(f"no backend selected: {info['selection_error']}")
    return "\n".join(out)


def _info(args: argparse.Namespace) -> int:
    info = backend_table()
    print(json.dumps(info, indent=2) if args.json else _format_table(info))
    return 0 if info["selected"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphcap", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log backend selection")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="installed backends, availability and capabilities")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=_info)
    # The bench (torch._dynamo, transformers) is imported only when it runs; it parses its own
    # options (``graphcap bench --help`` lists them).
    help = "eager vs graph rollouts on the selected backend (first call and steady state)"
    sub.add_parser("bench", help=help, add_help=False).set_defaults(func=_bench)
    args, rest = parser.parse_known_args(argv)
    if rest and args.func is not _bench:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return _bench(rest) if args.func is _bench else args.func(args)


def _bench(argv: list[str]) -> int:
    from graphcap.bench.command import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(main())
