"""graphcap bench: eager vs graph rollouts, first call and steady state (docs/benchmarks.md)."""
