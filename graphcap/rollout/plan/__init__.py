"""Request path, plan: input checks, model scan, graph signature, compiled regions, path."""

from graphcap.rollout.plan.plan import (
    DecodePath,
    Plan,
    check_graph_attention,
    eager_reason,
    plan_call,
)

__all__ = ["DecodePath", "Plan", "check_graph_attention", "eager_reason", "plan_call"]
