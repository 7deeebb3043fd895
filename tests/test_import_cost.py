"""What ``import graphcap.rollout`` loads: not the parts a user who does not shard or compile
never needs (docs/architecture.md, "Import time")."""

from __future__ import annotations

import subprocess
import sys

#: Loaded only where a call needs them: FSDP2 and DTensor by the model's owner (graphcap
#: recognises them once loaded), dynamo at the first compiled capture.
NOT_AT_IMPORT = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor")


def test_importing_the_rollout_loads_neither_dynamo_nor_fsdp():
    code = (
        f"import sys, graphcap.rollout; print([m for m in {NOT_AT_IMPORT!r} if m in sys.modules])"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]", run.stdout
