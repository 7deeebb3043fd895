"""Request path, step: the decode step the eager loop calls and a graph captures."""

from graphcap.rollout.step.step import DecodeState, DecodeStep

__all__ = ["DecodeState", "DecodeStep"]
