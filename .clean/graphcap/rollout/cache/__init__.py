"""Request path, device buffers: the static KV cache, attention masks, attribute swaps."""
