"""Request path, runner and collect: the static and continuous paths, and the runners they
drive.

:data:`ROLLOUTS` names the object serving each :class:`~graphcap.rollout.plan.Path`;
:func:`~graphcap.rollout.paths.runners.start_runner` gives a call its runner.
"""

from graphcap.rollout.paths.continuous import ContinuousRollout
from graphcap.rollout.paths.static import StaticRollout
from graphcap.rollout.plan import Path

#: The path object that serves each path: the static one its eager, static and per-position
#: graph steps, the continuous one its slots' eager or graph steps.
ROLLOUTS: dict[Path, type[StaticRollout] | type[ContinuousRollout]] = {
    Path.EAGER: StaticRollout,
    Path.STATIC_GRAPH: StaticRollout,
    Path.PER_POSITION_GRAPH: StaticRollout,
    Path.CONTINUOUS_EAGER: ContinuousRollout,
    Path.CONTINUOUS_GRAPH: ContinuousRollout,
}

__all__ = ["ROLLOUTS", "ContinuousRollout", "StaticRollout"]
