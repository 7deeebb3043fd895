"""Request path, holder: buffers and graphs kept across calls, capture, rank agreement."""

from graphcap.rollout.holder.holder import GraphHolder, GraphKey

__all__ = ["GraphHolder", "GraphKey"]
