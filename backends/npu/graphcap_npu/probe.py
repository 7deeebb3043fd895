"""Find out, without risking this process, whether torch_npu can run here.

``import torch_npu`` needs the CANN libraries. Without them recent releases raise ImportError,
but older ones call ``exit()`` from inside the import, which no ``try`` can stop. So the first
look happens in a child interpreter; torch_npu is imported in this process only once the child
has imported it, seen a device, and exited cleanly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

#: Line prefix the child prints its verdict after, so banners torch_npu prints are ignored.
_MARKER = "GRAPHCAP_NPU_PROBE "
PROBE_TIMEOUT_S = 180.0
VISIBLE_DEVICES_VAR = "ASCEND_RT_VISIBLE_DEVICES"
CANN_HINT = (
    "install the CANN toolkit matching your torch_npu release and load its environment "
    "(source /usr/local/Ascend/ascend-toolkit/set_env.sh)"
)
INSTALL_HINT = (
    "install torch_npu matching your CANN toolkit and torch (see docs/npu.md); graphcap-npu "
    "does not pull it in, since torch-npu pins an exact torch release"
)

#: The oldest torch_npu graphcap-npu runs on: graphcap needs torch 2.11 or later, and
#: ``npu_fusion_attention_v3`` is missing from several earlier torch_npu releases.
MIN_TORCH_NPU = (2, 11, 0)

_CHILD = f"""
import json, sys
verdict = {{"stage": "import"}}
try:
    import torch_npu
    import torch
    verdict["torch_npu"] = getattr(torch_npu, "__version__", "unknown")
    verdict["torch"] = torch.__version__
    verdict["stage"] = "device"
    npu = getattr(torch, "npu", None)
    if npu is None:
        raise RuntimeError("importing torch_npu did not create torch.npu")
    verdict["available"] = bool(npu.is_available())
    verdict["device_count"] = int(npu.device_count()) if verdict["available"] else 0
    verdict["stage"] = "done"
except Exception as exc:
    verdict["error"] = f"{{type(exc).__name__}}: {{exc}}"
print({_MARKER!r} + json.dumps(verdict), flush=True)
"""

# Phrases in a failed import's message that mean the CANN runtime libraries were not found.
_CANN_SIGNS = ("libascend", "libhccl", "libacl", "libge_runner", "ascend", "cann", "cannot open")


@dataclass(frozen=True)
class ProbeResult:
    """What the child interpreter found. ``ok`` only when torch_npu imported and sees a device."""

    ok: bool
    reason: str
    device_count: int = 0


def torch_npu_installed() -> bool:
    """Whether a ``torch_npu`` package can be found, without importing (running) it."""
    if "torch_npu" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def probe_torch_npu(
    python: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = PROBE_TIMEOUT_S,
) -> ProbeResult:
    """Import torch_npu in a child interpreter and report whether it can run, and why not.

    ``python`` and ``env`` default to this interpreter and this environment; tests pass others.
    """
    child_env = dict(os.environ if env is None else env)
    try:
        done = subprocess.run(
            [python or sys.executable, "-c", _CHILD],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ProbeResult(
            False, f"import torch_npu did not finish within {timeout_s:.0f} s in a probe process"
        )
    except OSError as exc:
        return ProbeResult(False, f"could not start a probe interpreter: {exc}")
    verdict = _verdict(done.stdout)
    if verdict is None:
        return ProbeResult(False, _died_reason(done.returncode, done.stderr))
    return _judge(verdict, child_env.get(VISIBLE_DEVICES_VAR))


def _verdict(stdout: str) -> dict[str, object] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(_MARKER):
            try:
                parsed = json.loads(line[len(_MARKER) :])
            except json.JSONDecodeError:
                return None
            return parsed if isinstance(parsed, dict) else None
    return None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _died_reason(returncode: int, stderr: str) -> str:
    detail = _last_line(stderr)
    reason = (
        f"import torch_npu ended the probe process with exit code {returncode} before it "
        "could report (older torch_npu releases exit when the CANN libraries are missing)"
    )
    if detail:
        reason += f"; its last message: {detail}"
    return f"{reason}; {CANN_HINT}"


def release(version: str) -> tuple[int, int, int, int] | None:
    """torch_npu ``version`` as (major, minor, micro, post): "2.12.0.post3" is (2, 12, 0, 3);
    ``None`` when it does not start with a release number."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?(?:\.post(\d+))?", version)
    if match is None:
        return None
    major, minor, micro, post = (int(part or 0) for part in match.groups())
    return major, minor, micro, post


def version_problem(version: str) -> str | None:
    """Why torch_npu ``version`` is too old for graphcap-npu, or ``None`` when it will do."""
    floor = ".".join(map(str, MIN_TORCH_NPU))
    found = release(version)
    if found is None:
        return f"torch_npu reports version {version!r}, not one graphcap-npu can compare to {floor}"
    if found[:3] >= MIN_TORCH_NPU:
        return None
    return (
        f"torch_npu {version} is older than {floor}, the oldest graphcap-npu runs on (graphcap "
        f"needs torch 2.11 or later, and npu_fusion_attention_v3 is missing from several older "
        f"releases); install torch_npu {floor} or later with its matching torch and CANN"
    )


def _judge(verdict: Mapping[str, object], visible: str | None) -> ProbeResult:
    error = str(verdict.get("error", ""))
    if verdict.get("stage") == "import":
        if error.startswith("ModuleNotFoundError") and "torch_npu" in error:
            return ProbeResult(False, f"torch_npu is not installed; {INSTALL_HINT}")
        if "undefined symbol" in error:
            return ProbeResult(
                False,
                f"torch_npu does not match the installed torch ({error}); install the torch_npu "
                "release built for this torch",
            )
        if any(sign in error.lower() for sign in _CANN_SIGNS):
            return ProbeResult(
                False, f"torch_npu is installed but CANN is missing ({error}); {CANN_HINT}"
            )
        return ProbeResult(False, f"import torch_npu failed: {error}; {CANN_HINT}")
    versions = f"torch_npu {verdict.get('torch_npu')}, torch {verdict.get('torch')}"
    too_old = version_problem(str(verdict.get("torch_npu")))
    if too_old is not None:
        return ProbeResult(False, too_old)
    if error:
        return ProbeResult(False, f"{versions} imported, but querying devices failed: {error}")
    count = verdict.get("device_count")
    count = count if isinstance(count, int) else 0
    if not verdict.get("available") or count < 1:
        where = (
            f"{VISIBLE_DEVICES_VAR}={visible!r}"
            if visible is not None
            else f"{VISIBLE_DEVICES_VAR} is unset"
        )
        return ProbeResult(
            False,
            f"{versions} imported, but no NPU device is visible ({where}); check the driver "
            f"(npu-smi info) and {VISIBLE_DEVICES_VAR}",
        )
    return ProbeResult(True, f"{count} NPU device(s) visible ({versions})", count)
