"""graphcap bench: eager vs graph rollouts on this machine, first call and steady state.

``graphcap bench`` (command.py); :func:`graphcap.bench.run.run_benchmark` from Python. See
docs/benchmarks.md.
"""
