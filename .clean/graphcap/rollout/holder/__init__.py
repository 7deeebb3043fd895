"""Request path, holder: buffers and graphs kept across calls, capture, rank agreement."""
