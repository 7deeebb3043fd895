"""Compare rollout speed with and without graphs on this machine: transformers' generate (eager,
static cache + torch.compile) against graphcap's eager and graph paths, one process (or one per
mode and batch size with --isolate), one model. See docs/benchmarks.md."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from graphcap.bench.config import BenchConfig, add_fields, from_args, option
from graphcap.bench.report import format_table
from graphcap.bench.run import run_benchmark
from graphcap.errors import GraphcapError


@dataclass
class Outputs:
    """Where the results go (the other options are :class:`BenchConfig`'s fields)."""

    json: str | None = option("write the full report as JSON", metavar="PATH")
    quiet: bool = option("no progress lines on stderr", False, action="store_true")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; table on stdout, progress on stderr. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="graphcap bench", description=__doc__)
    add_fields(parser, BenchConfig)
    add_fields(parser, Outputs)
    args = parser.parse_args(argv)
    out = from_args(Outputs, args)
    say = None if out.quiet else lambda line: print(f"[bench] {line}", file=sys.stderr, flush=True)
    try:
        report = run_benchmark(from_args(BenchConfig, args), progress=say)
    except (ValueError, ImportError, GraphcapError) as exc:
        print(f"graphcap bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    if out.json:
        print(f"wrote {report.write_json(out.json)}", file=sys.stderr)
    return 0
