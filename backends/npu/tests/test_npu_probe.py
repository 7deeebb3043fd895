"""The child-process probe: every way ``import torch_npu`` can fail gives a clear reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fake_torch_npu import without_real_torch_npu
from graphcap_npu.probe import probe_torch_npu

FAKE_NPU_NAMESPACE = """
import types, torch
torch.npu = types.SimpleNamespace(
    is_available=lambda: {available}, device_count=lambda: {count}
)
__version__ = "9.9.fake"
"""


def _env(path: Path | None, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASCEND_RT_VISIBLE_DEVICES")
    }
    if path is not None:
        env["PYTHONPATH"] = str(path)
    env.update(extra)
    return env


@without_real_torch_npu
def test_not_installed_says_so() -> None:
    result = probe_torch_npu(env=_env(None))
    assert not result.ok
    assert "torch_npu is not installed" in result.reason


def test_import_error_for_missing_cann(fake_package) -> None:
    root = fake_package(
        'raise ImportError("libascend_hal.so: cannot open shared object file: No such file")'
    )
    result = probe_torch_npu(env=_env(root))
    assert not result.ok
    assert "CANN is missing" in result.reason
    assert "libascend_hal.so" in result.reason
    assert "set_env.sh" in result.reason


def test_torch_mismatch_is_named(fake_package) -> None:
    root = fake_package('raise ImportError("libtorch_npu.so: undefined symbol: _ZN3c10")')
    result = probe_torch_npu(env=_env(root))
    assert not result.ok
    assert "does not match the installed torch" in result.reason


def test_module_that_calls_sys_exit(fake_package) -> None:
    root = fake_package('import sys\nprint("CANN not found", file=sys.stderr)\nsys.exit(1)')
    result = probe_torch_npu(env=_env(root))
    assert not result.ok
    assert "exit code 1" in result.reason
    assert "CANN not found" in result.reason


def test_module_that_exits_the_process_hard(fake_package) -> None:
    # exit() from C code cannot be caught by any try; os._exit behaves the same.
    root = fake_package("import os\nos._exit(3)")
    result = probe_torch_npu(env=_env(root))
    assert not result.ok
    assert "exit code 3" in result.reason


def test_no_device_names_the_visible_devices_variable(fake_package) -> None:
    root = fake_package(FAKE_NPU_NAMESPACE.format(available=False, count=0))
    result = probe_torch_npu(env=_env(root, ASCEND_RT_VISIBLE_DEVICES="7"))
    assert not result.ok
    assert "no NPU device is visible" in result.reason
    assert "ASCEND_RT_VISIBLE_DEVICES='7'" in result.reason
    assert "torch_npu 9.9.fake" in result.reason


def test_working_install_is_ok(fake_package) -> None:
    root = fake_package(FAKE_NPU_NAMESPACE.format(available=True, count=2))
    result = probe_torch_npu(env=_env(root))
    assert result.ok, result.reason
    assert result.device_count == 2
    assert "2 NPU device(s)" in result.reason


def test_hanging_import_times_out(fake_package) -> None:
    root = fake_package("import time\ntime.sleep(30)")
    result = probe_torch_npu(env=_env(root), timeout_s=1.0)
    assert not result.ok
    assert "did not finish" in result.reason


def test_package_import_survives_a_torch_npu_that_exits(fake_package) -> None:
    """Importing graphcap_npu and asking for availability never runs torch_npu in-process."""
    root = fake_package("import os\nos._exit(5)")
    code = (
        "import sys, graphcap_npu\n"
        "from graphcap_npu import NPUBackend\n"
        "a = NPUBackend.availability()\n"
        "assert 'torch_npu' not in sys.modules\n"
        "print('survived', a.ok, a.reason)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=_env(root), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "survived False" in done.stdout
    assert "exit code 5" in done.stdout


def test_torch_npu_below_the_floor_is_refused_with_the_floor(fake_package) -> None:
    body = FAKE_NPU_NAMESPACE.format(available=True, count=2).replace("9.9.fake", "2.10.0.post7")
    result = probe_torch_npu(env=_env(fake_package(body)))
    assert not result.ok
    assert "torch_npu 2.10.0.post7 is older than 2.11.0" in result.reason
