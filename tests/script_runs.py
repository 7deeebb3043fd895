"""Run a repository script in a fresh process on the CPU reference backend, as a test does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from graphcap.registry import ENV_VAR


def run_on_cpu(
    script: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python script args`` with ``GRAPHCAP_BACKEND=cpu`` (and ``env``); fails the test with
    the tails of its output where it exits non-zero."""
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env={**os.environ, ENV_VAR: "cpu", **(env or {})},
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done
