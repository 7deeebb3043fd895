"""Request path, holder: buffers and graphs kept across calls, capture, rank agreement."""

from graphcap.rollout.holder.holder import FULL_STEP, GraphHolder, GraphKey

__all__ = ["FULL_STEP", "GraphHolder", "GraphKey"]
