"""Request path, plan: input checks, model scan, graph signature, compiled regions, path."""
