"""Make the core's tiny model builders (tests/rollout_models.py) importable from these tests."""

from __future__ import annotations

import sys
from pathlib import Path

CORE_TESTS = Path(__file__).resolve().parents[3] / "tests"
if str(CORE_TESTS) not in sys.path:
    sys.path.insert(0, str(CORE_TESTS))
