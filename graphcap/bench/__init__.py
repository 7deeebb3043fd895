"""graphcap bench: how much faster rollouts are with graphs on this machine, and what it costs.

Every mode (transformers' generate, eager and compiled; graphcap eager and graph paths) runs in
one process on one model and one prompt set; the report separates the first call (capture or
compilation) from the steady state and adds the memory-bandwidth roofline, memory, capture
counts and token agreement. See docs/benchmarks.md.
"""

from graphcap.bench.config import BenchConfig
from graphcap.bench.report import BenchReport, ModeResult, RLLoopResult
from graphcap.bench.run import run_benchmark

__all__ = ["BenchConfig", "BenchReport", "ModeResult", "RLLoopResult", "run_benchmark"]
