"""The ``graphcap bench`` command line (wired into ``graphcap.cli``; also ``python -m``)."""

from __future__ import annotations

import argparse
import sys

from graphcap.bench.modes import MODES, parse_modes
from graphcap.bench.plot import PlotUnavailableError, check_plotting, plot_throughput
from graphcap.bench.presets import DTYPES, PRESETS
from graphcap.bench.report import format_rl_table, format_table
from graphcap.bench.roofline import parse_bandwidth
from graphcap.bench.runner import ACCELERATOR_DEFAULTS, CPU_DEFAULTS, BenchConfig, run_benchmark
from graphcap.errors import GraphcapError


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers such as 1,8,32, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return values


def _modes(text: str) -> list[str]:
    try:
        return parse_modes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bandwidth(text: str) -> float:
    try:
        return parse_bandwidth(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench options to ``parser`` (the ``bench`` subcommand's own parser)."""
    cpu = ", ".join(f"{k}={v}" for k, v in CPU_DEFAULTS.items())
    acc = ", ".join(f"{k}={v}" for k, v in ACCELERATOR_DEFAULTS.items())
    parser.description = (
        "Compare rollout speed with and without graphs on this machine: transformers' "
        "generate (eager, static cache + torch.compile) against graphcap's eager and graph "
        f"paths, one process, one model. Defaults without an accelerator: {cpu}; "
        f"on an accelerator: {acc}."
    )
    parser.add_argument(
        "--model",
        help=f"preset ({', '.join(PRESETS)}; random weights) or a local model directory",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="weights dtype (default fp32 on CPU, fp16 for gpt2 presets, bf16 otherwise)",
    )
    parser.add_argument("--batch-sizes", type=_int_list, help="comma-separated, e.g. 1,8,32,64")
    parser.add_argument(
        "--compile-batch-sizes",
        type=_int_list,
        help="run the compiling modes only at these batch sizes (default: all)",
    )
    parser.add_argument("--prompt-len", type=int, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, help="generated tokens per row (EOS is off)")
    parser.add_argument("--repeats", type=int, help="steady-state calls (median reported)")
    parser.add_argument("--warmup", type=int, help="discarded calls after the first")
    parser.add_argument(
        "--modes",
        type=_modes,
        help=f"comma-separated subset of {', '.join(MODES)}",
    )
    parser.add_argument(
        "--continuous-slots",
        type=int,
        help="slots of the graphcap-continuous mode (default: one per row)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads (default: 1 without an accelerator, else torch's; 0: torch's)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts seed")
    parser.add_argument(
        "--peak-bandwidth",
        type=_bandwidth,
        help="device memory bandwidth for the roofline, e.g. 4.8TB/s (default: known devices)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="time limit for the mode sweep; pairs not started in time are reported skipped",
    )
    parser.add_argument("--backend", help="graphcap backend name (default: $GRAPHCAP_BACKEND)")
    parser.add_argument(
        "--rl-loop",
        type=int,
        default=0,
        metavar="N",
        help="also run N generate -> train-step -> generate iterations (eager vs graph)",
    )
    parser.add_argument("--rl-batch-size", type=int, help="RL loop batch (default: first bs)")
    parser.add_argument("--rl-optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--rl-lr", type=float, default=1e-3, help="RL loop learning rate")
    parser.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write tokens/s vs batch size (PNG)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        model=args.model,
        dtype=args.dtype,
        batch_sizes=args.batch_sizes,
        compile_batch_sizes=args.compile_batch_sizes,
        budget_s=args.budget_s,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        modes=args.modes,
        continuous_slots=args.continuous_slots,
        threads=args.threads,
        seed=args.seed,
        peak_bandwidth=args.peak_bandwidth,
        backend=args.backend,
        rl_loop=args.rl_loop,
        rl_batch_size=args.rl_batch_size,
        rl_optimizer=args.rl_optimizer,
        rl_lr=args.rl_lr,
    )


def _progress(line: str) -> None:
    print(f"[bench] {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; table on stdout, progress on stderr. Returns the exit status."""
    if args.plot:
        try:
            check_plotting()
        except PlotUnavailableError as exc:
            print(f"graphcap bench: {exc}", file=sys.stderr)
            return 2
    try:
        report = run_benchmark(config_from_args(args), progress=None if args.quiet else _progress)
    except (ValueError, GraphcapError) as exc:
        print(f"graphcap bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    if report.rl_loop:
        print()
        print(format_rl_table(report.rl_loop))
    if args.json:
        print(f"wrote {report.write_json(args.json)}", file=sys.stderr)
    if args.plot:
        print(f"wrote {plot_throughput(report, args.plot)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphcap bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))
