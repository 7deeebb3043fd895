"""Request path, runner and collect: the static and continuous paths, and the runners they
drive."""
