"""Request path, step: the decode step the eager loop calls and a graph captures."""
