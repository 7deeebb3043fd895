"""Request path, runner and collect: the static and continuous paths, and the runners they
drive.

:data:`ROLLOUTS` names the object serving each :class:`~graphcap.rollout.plan.DecodePath`;
:func:`~graphcap.rollout.paths.runners.start_runner` gives a call its runner.
"""

from graphcap.rollout.paths.continuous import ContinuousRollout
from graphcap.rollout.paths.static import StaticRollout
from graphcap.rollout.plan import DecodePath

#: The path object that serves each path: the static one its eager, static and per-position
#: graph steps, the continuous one its slots' eager or graph steps.
ROLLOUTS: dict[DecodePath, type[StaticRollout] | type[ContinuousRollout]] = {
    DecodePath.EAGER: StaticRollout,
    DecodePath.STATIC_GRAPH: StaticRollout,
    DecodePath.PER_POSITION_GRAPH: StaticRollout,
    DecodePath.CONTINUOUS_EAGER: ContinuousRollout,
    DecodePath.CONTINUOUS_GRAPH: ContinuousRollout,
}

__all__ = ["ROLLOUTS", "ContinuousRollout", "StaticRollout"]
