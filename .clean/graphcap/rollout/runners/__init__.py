"""Request path, runner and collect: the runners, and the static and continuous paths."""
