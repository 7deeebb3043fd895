"""``python -m graphcap.testing``: run the conformance suite with the plugin loaded.

Extra arguments go to pytest (``-x``, ``-k``, ``--graphcap-json PATH``, ...).
"""

from __future__ import annotations

import sys

import pytest

from graphcap import testing
from graphcap.testing.plugin import CONFORMANCE_PACKAGE


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    # The plugin is passed as an object: this module already imported it, so `-p` would warn
    # that it can no longer be assertion-rewritten.
    return int(pytest.main(["--pyargs", CONFORMANCE_PACKAGE, *args], plugins=[testing]))


if __name__ == "__main__":
    sys.exit(main())
