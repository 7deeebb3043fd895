"""Request path, device buffers: the static KV cache, attention masks, attribute swaps."""

from graphcap.rollout.cache.cache import LayerSpec, SpanView, StaticKVCache

__all__ = ["LayerSpec", "SpanView", "StaticKVCache"]
