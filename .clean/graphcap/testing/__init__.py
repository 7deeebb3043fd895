"""The graphcap backend conformance suite, as an explicitly loaded pytest plugin.

Run it for the backend a machine would use (or the one named by ``GRAPHCAP_BACKEND``)::

    GRAPHCAP_BACKEND=<name> python -m graphcap.testing [--graphcap-json PATH] [pytest options]

which is short for ``pytest -p graphcap.testing --pyargs graphcap.testing.conformance``. The
plugin prints a capability and per-check table at the end of the run and writes the results as
JSON (default ``conformance-<backend>.json``). It is deliberately not registered in the
auto-loaded ``pytest11`` group, so it never runs inside other projects' test sessions.
"""

from graphcap.testing.plugin import pytest_addoption, pytest_configure

__all__ = ["pytest_addoption", "pytest_configure"]
