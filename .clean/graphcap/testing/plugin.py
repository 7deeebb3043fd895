"""pytest hooks and fixtures of the conformance suite.

The backend is selected once per session, exactly as the rollout engine selects it
(``graphcap.get_backend``). When it cannot be selected, every check is skipped with the reason
and the run fails, so a missing plugin or an unavailable device never looks like a pass;
``--graphcap-allow-unavailable`` turns that into a passing run of skips (CI without the device).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from graphcap.errors import BackendSelectionError
from graphcap.registry import ENV_VAR, get_backend
from graphcap.testing.report import (
    CheckResult,
    Selection,
    build_record,
    render_table,
    write_json,
)

PLUGIN_NAME = "graphcap-conformance"
CONFORMANCE_PACKAGE = "graphcap.testing.conformance"
#: Run order of the check modules: a failed capture runs last, so a device left broken by it
#: cannot spoil the other checks' results.
MODULE_ORDER = (
    "contract",
    "graph_semantics",
    "rng",
    "capabilities",
    "decode_step",
    "engine",
    "capture_errors",
)


def conformance_args() -> list[str]:
    """The pytest arguments that run the suite: the plugin plus the checks shipped with it."""
    return ["-p", "graphcap.testing", "--pyargs", CONFORMANCE_PACKAGE]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphcap", "graphcap backend conformance")
    group.addoption(
        "--graphcap-backend",
        default=None,
        metavar="NAME",
        help=f"backend to check (default: ${ENV_VAR}, else the one graphcap auto-selects)",
    )
    group.addoption(
        "--graphcap-json",
        default=None,
        metavar="PATH",
        help="where to write the JSON results (default: conformance-<backend>.json)",
    )
    group.addoption(
        "--graphcap-allow-unavailable",
        action="store_true",
        help="when the backend cannot be selected, skip every check with the reason and pass "
        "(default: the run fails), e.g. in CI on a machine without the device",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(ConformanceSession(config), PLUGIN_NAME)


@dataclass(eq=False)  # registered with pytest's pluggy, which hashes plugins by identity
class ConformanceSession:
    """Collects the outcome of every conformance check and reports them at the end."""

    config: pytest.Config
    results: dict[str, CheckResult] = field(default_factory=dict)
    json_path: Path | None = None
    record: dict[str, Any] | None = None
    _selection: Selection | None = None

    @property
    def selection(self) -> Selection:
        if self._selection is None:
            self._selection = _select(self.config)
        return self._selection

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        checks = {item.nodeid: _check_module(item) for item in items}
        rank = {module: index for index, module in enumerate(MODULE_ORDER)}
        # Stable: other tests keep their place at the front, checks follow in MODULE_ORDER.
        items.sort(key=lambda item: rank.get(checks[item.nodeid] or "", -1))
        for item in items:
            module = checks[item.nodeid]
            if module is not None:
                self.results[item.nodeid] = CheckResult(f"{module}::{item.name}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        result = self.results.get(report.nodeid)
        if result is not None:
            result.add(report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.results:
            return
        record = build_record(self.selection, list(self.results.values()))
        option = self.config.getoption("graphcap_json")
        name = record["backend"]["name"] or "unselected"
        self.json_path = Path(option or f"conformance-{name}.json")
        write_json(self.json_path, record)
        self.record = record
        if self.unavailable_fails:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @property
    def unavailable_fails(self) -> bool:
        """No backend to check and no ``--graphcap-allow-unavailable``: the run fails."""
        allowed = self.config.getoption("graphcap_allow_unavailable")
        return self.selection.backend is None and not allowed

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        record = self.record
        if record is None:
            return
        terminalreporter.section(f"graphcap conformance: backend {record['backend']['name']!r}")
        for line in render_table(record):
            terminalreporter.write_line(line)
        terminalreporter.write_line(f"results written to {self.json_path}")
        if self.unavailable_fails:
            terminalreporter.write_line(
                "FAILED: the backend cannot be selected, so nothing was checked; pass "
                "--graphcap-allow-unavailable to accept that (every check reports skipped)",
                red=True,
            )
        elif self.selection.backend is None:
            terminalreporter.write_line(
                f"skipped (--graphcap-allow-unavailable): {self.selection.skip_reason}"
            )


def _check_module(item: pytest.Item) -> str | None:
    """The conformance module an item comes from (without ``test_``), or None for other tests."""
    name = getattr(getattr(item, "module", None), "__name__", "")
    if not name.startswith(CONFORMANCE_PACKAGE + "."):
        return None
    return name.rsplit(".", 1)[-1].removeprefix("test_")


def _select(config: pytest.Config) -> Selection:
    requested = config.getoption("graphcap_backend") or os.environ.get(ENV_VAR) or None
    selection = Selection(requested)
    try:
        selection.backend = get_backend(requested)
    except BackendSelectionError as exc:
        selection.skip_reason = f"backend cannot be selected: {exc}"
    except Exception as exc:  # a backend that breaks while being created fails every check
        selection.error = exc
    return selection


def session_of(config: pytest.Config) -> ConformanceSession:
    """The running conformance session; a usage error when the plugin was not loaded."""
    session = config.pluginmanager.get_plugin(PLUGIN_NAME)
    if session is None:
        raise pytest.UsageError(
            "the graphcap conformance checks need their plugin: run them with "
            f"`python -m graphcap.testing` or `pytest {' '.join(conformance_args())}`"
        )
    return session
