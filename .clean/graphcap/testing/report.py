"""The conformance report: per-check outcomes, the capability table and the JSON record.

The JSON record is what ``docs/conformance-results.md`` is built from, so it carries everything
needed to reproduce a result: backend and plugin, device, library versions and the date.
"""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

from graphcap.backend import Backend

SCHEMA_VERSION = 2
#: "no graphs": the check applies only to backends that capture, and this one (by its own,
#: verified, declaration) does not; "skipped": the check could not run (no backend, say).
OUTCOMES = ("passed", "failed", "error", "no graphs", "skipped")
#: How the conformance fixtures start the skip reason of a graph check on an eager backend.
NO_GRAPHS_PREFIX = "no graphs:"


@dataclass
class Selection:
    """The backend under test, or why there is none."""

    requested: str | None
    backend: Backend | None = None
    skip_reason: str | None = None
    error: BaseException | None = None


@dataclass
class CheckResult:
    """One check's outcome, folded from its setup, call and teardown reports."""

    check: str
    outcome: str = "not run"
    reason: str | None = None
    duration_s: float = 0.0

    def add(self, report: pytest.TestReport) -> None:
        self.duration_s += report.duration
        if report.skipped:
            self.reason = _skip_reason(report)
            no_graphs = self.reason.startswith(NO_GRAPHS_PREFIX)
            self.outcome = "no graphs" if no_graphs else "skipped"
        elif report.failed:
            # A failure outside the check itself (fixture setup or teardown) is an error.
            self.outcome = "failed" if report.when == "call" else "error"
            self.reason = _failure_reason(report)
        elif report.when == "call":
            self.outcome = "passed"

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "outcome": self.outcome,
            "reason": self.reason,
            "duration_s": round(self.duration_s, 4),
        }


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _failure_reason(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr)
    return message.strip().splitlines()[0] if message.strip() else "failed"


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return platform.processor() or platform.machine()
    module = torch.get_device_module(device.type)
    get_name = getattr(module, "get_device_name", None)
    return str(get_name(device)) if get_name is not None else device.type


def build_record(selection: Selection, results: list[CheckResult]) -> dict[str, Any]:
    """The JSON-serialisable record of one conformance run."""
    backend = selection.backend
    backend_info: dict[str, Any] = {"requested": selection.requested, "selected": False}
    device_info: dict[str, Any] | None = None
    if backend is not None:
        backend_info.update(backend.describe())
        backend_info["selected"] = True
        device_info = {"device": str(backend.device), "name": _device_name(backend.device)}
    else:
        backend_info["name"] = selection.requested
        backend_info["reason"] = selection.skip_reason or repr(selection.error)
    counts = {outcome: 0 for outcome in OUTCOMES}
    for result in results:
        counts[result.outcome] = counts.get(result.outcome, 0) + 1
    return {
        "schema": SCHEMA_VERSION,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": backend_info,
        "device": device_info,
        "versions": {
            "python": platform.python_version(),
            "platform": sys.platform,
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "graphcap": _version("graphcap"),
            "plugin": _plugin_version(backend_info),
        },
        "summary": counts,
        "checks": [result.as_dict() for result in results],
    }


def _plugin_version(backend_info: dict[str, Any]) -> str | None:
    distribution = backend_info.get("distribution")
    if not distribution:
        return None
    return f"{distribution} {backend_info.get('version') or '(unknown version)'}"


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def render_table(record: dict[str, Any]) -> list[str]:
    """The terminal summary: what the backend is and declares, then every check's outcome."""
    backend, versions = record["backend"], record["versions"]
    lines = [f"backend       {backend['name'] or '(auto-selected)'}"]
    if backend["selected"]:
        lines.append(f"plugin        {versions['plugin']}, priority {backend['priority']}")
        device = record["device"]
        lines.append(f"device        {device['device']} ({device['name']})")
        lines.append(f"available     {backend['reason']}")
        lines.append("capabilities")
        for flag, value in backend["capabilities"].items():
            shown = ("yes" if value else "no") if isinstance(value, bool) else str(value)
            lines.append(f"  {flag:<27} {shown}")
    else:
        lines.append(f"NOT SELECTED  {backend['reason']}")
    lines.append(
        f"versions      torch {versions['torch']}, transformers {versions['transformers']}, "
        f"graphcap {versions['graphcap']}, python {versions['python']}"
    )
    width = max(len(check["check"]) for check in record["checks"])
    lines.append("")
    lines.append(f"{'check':<{width}}  outcome    note")
    for check in record["checks"]:
        note = (check["reason"] or "").split("\n", 1)[0]
        if len(note) > 100:
            note = note[:97] + "..."
        lines.append(f"{check['check']:<{width}}  {check['outcome']:<9}  {note}")
    summary = ", ".join(f"{n} {outcome}" for outcome, n in record["summary"].items() if n)
    lines.append(f"summary: {summary}")
    return lines
