"""Agreement between tensor-parallel ranks (docs/rollout.md, "Tensor parallelism").

Under tensor parallelism every rank runs the same rollout on its shard and the forward contains
collectives. If one rank replays while another recaptures, runs eagerly or stops decoding, their
collectives no longer pair up and the job hangs. The decisions that could differ are therefore
all-reduced over the group: once per call for the graph decision (and once after each capture
attempt), and at each ``eos_check_interval`` check for "finished". Nothing here runs inside a
captured region. Without a group every method answers from the local values with no
communication at all.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphcap.errors import CaptureFallbackWarning

#: stats.recapture_reason entry when this rank recaptures because another rank does
PEER_RECAPTURE = "another rank recaptures"
#: stats.fallback_reason when another rank cannot use graphs for this call
PEER_REFUSAL = "another rank of the process group cannot use graphs for this call"
#: stats.fallback_reason (and the engine's reason graphs are off) after a peer's failed capture
PEER_CAPTURE_FAILURE = "graph capture failed on another rank of the process group"


@dataclass(frozen=True)
class GraphVerdict:
    """What the group decided for this rank's call.

    ``eager_reason``: run this call eagerly because another rank cannot use graphs (``None``
    when this rank refused itself or every rank can). ``recapture``: drop this rank's held
    graph and capture, because another rank captures.
    """

    eager_reason: str | None = None
    recapture: bool = False


class RankAgreement:
    """The collectives a rollout path calls; ``group=None`` means a single process (no-ops).

    ``device`` is where the flags live for the collective: the backend's device (NCCL / HCCL
    need device tensors; a gloo group runs on CPU tensors).
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group = group
        self.device = device

    def all_finished(self, flag: torch.Tensor) -> bool:
        """Whether every rank's rows are finished (the periodic check's one host read)."""
        if self.group is None:
            return bool(flag)
        agreed = flag.reshape(1).to(torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return bool(agreed)

    def finished_rows(self, finished: torch.Tensor) -> list[bool]:
        """Per row: finished on every rank. A row retires only when no rank still decodes it,
        so it retires on the same step everywhere and each rank keeps its own full output (a
        rank whose copy finished first just writes pad until then)."""
        if self.group is None:
            return finished.tolist()
        agreed = finished.to(torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return agreed.bool().tolist()

    def decide(self, use_graph: bool, capture: bool) -> GraphVerdict:
        """The graph decision of one call: if any rank cannot use graphs, nobody does; else if
        any rank captures, every rank captures. ``capture``: this rank would capture."""
        if self.group is None:
            return GraphVerdict()
        refused_any, capture_any = self._any(not use_graph, use_graph and capture)
        if refused_any:
            return GraphVerdict(eager_reason=PEER_REFUSAL if use_graph else None)
        return GraphVerdict(recapture=capture_any and not capture)

    def peer_capture_failure(self, captured: bool) -> str | None:
        """After a capture attempt on every rank: the reason to drop this rank's new graph and
        stay eager when another rank's capture failed (``None`` if every rank captured, or if
        this rank failed itself and already has its own reason)."""
        if self.group is None:
            return None
        (failed_any,) = self._any(not captured)
        if not (captured and failed_any):
            return None
        warnings.warn(
            f"{PEER_CAPTURE_FAILURE}; this call finishes eagerly on every rank and the engine "
            "stays eager from now on",
            CaptureFallbackWarning,
            stacklevel=3,
        )
        return PEER_CAPTURE_FAILURE

    def _any(self, *flags: bool) -> tuple[bool, ...]:
        values = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(bool(v) for v in values.tolist())
