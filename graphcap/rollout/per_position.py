"""Per-position graphs: one captured decode step per decode position (DESIGN.md, path 4).

The static graph's single recording must serve every position, so it may read no host value
that changes between steps. Kernels that take host-side sequence lengths (fused attention with
``actual_seq_len`` lists) break that rule. When every row generates exactly ``max_new_tokens``
(``min_new_tokens == max_new_tokens``: EOS cannot end a row early), the schedule of positions is
known before decoding starts, so the graph for position ``p`` may freeze host ints that are right
for ``p`` and only for ``p``: each graph's step (a copy of the decode step sharing its buffers)
sets ``span`` to attend over exactly the written cache columns ``[0, W + p + 1)`` instead of the
whole buffer.

All or nothing per call: each position's graph is captured (through the shared
:func:`~graphcap.rollout.capture.capture_step`) and replayed at once, which performs that step;
if one capture fails, the call finishes with the eager step, the partial set is dropped and the
engine stays eager. All graphs of a set share one memory pool.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from graphcap.backend import Backend
from graphcap.rollout.agreement import RankAgreement
from graphcap.rollout.capture import capture_step, fallback_reason
from graphcap.rollout.config import SamplingParams
from graphcap.rollout.step import DecodeStep


def pinned_refusal(params: SamplingParams) -> str | None:
    """Why this call cannot use per-position graphs (lengths not pinned), or ``None``."""
    if params.min_new_tokens == params.max_new_tokens:
        return None
    return (
        "per_position_graphs needs pinned lengths (min_new_tokens == max_new_tokens, got "
        f"{params.min_new_tokens} and {params.max_new_tokens}): EOS could end rows early, so the "
        "positions are not known in advance; this call used the static graph path"
    )


@dataclass
class PositionGraphs:
    """The graphs of one prompt width and step count: ``graphs[p]`` performs decode step
    ``p + 1`` (the token at column ``width + p`` goes in; attention spans ``width + p + 1``).

    Kept with the engine's buffers while the graph signature holds; the prompt width is an extra
    member here because positions are absolute.
    """

    width: int
    steps: int
    pool: object | None
    graphs: list[object] = field(default_factory=list)

    def differences(self, width: int, steps: int) -> list[str]:
        """Which of this set's own members a call with ``width`` / ``steps`` changes."""
        changed = []
        if width != self.width:
            changed.append("prompt_width")
        if steps != self.steps:
            changed.append("max_new_tokens")
        return changed


class PositionRunner:
    """Performs one call's decode steps in order through the set's graphs.

    Step ``p`` replays ``graphs[p]``, capturing it first when the set lacks it (the capture
    leaves every buffer and the RNG as they were, so that replay performs the step). After a
    failed capture the remaining steps run through ``eager`` and :attr:`failure` says why; with
    a process group, a capture that failed on any rank counts as failed on every rank.
    """

    def __init__(
        self,
        backend: Backend,
        eager: DecodeStep,
        graphs: PositionGraphs,
        agreement: RankAgreement,
    ):
        self.backend = backend
        self.agreement = agreement
        self.eager = eager
        self.step = copy.copy(eager)  # the same buffers, its own attention span
        self.graphs = graphs
        self.position = 0
        self.captures = 0
        self.replays = 0
        self.capture_s = 0.0
        self.failure: str | None = None

    def __call__(self) -> None:
        position, self.position = self.position, self.position + 1
        missing = self.failure is None and position == len(self.graphs.graphs)
        if self.failure is not None or (missing and not self._capture(position)):
            self.eager()
            return
        self.backend.replay_graph(self.graphs.graphs[position])
        self.replays += 1

    def _capture(self, position: int) -> bool:
        start = time.perf_counter()
        self.step.span = (0, self.graphs.width + position + 1)
        try:
            graph = capture_step(
                self.backend,
                self.step,
                self.step.mutable_tensors(),
                self.step.generator,
                pool=self.graphs.pool,
            )
        except Exception as exc:  # any capture failure: rolled back; finish this call eagerly
            self.failure = fallback_reason(exc)
            self.agreement.peer_capture_failure(captured=False)
            return False
        finally:
            self.step.span = None
            self.capture_s += time.perf_counter() - start
        self.captures += 1
        self.failure = self.agreement.peer_capture_failure(captured=True)
        if self.failure is not None:
            return False
        self.graphs.graphs.append(graph)
        return True
