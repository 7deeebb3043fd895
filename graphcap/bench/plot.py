"""Optional PNG plot: tokens/s against batch size, one line per mode (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphcap.bench.report import FALLBACK, OK, BenchReport


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed; the message says how to get it."""


def check_plotting() -> None:
    """Raise PlotUnavailableError now, before a long run whose plot could not be drawn."""
    _pyplot()


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (matplotlib is optional, so is Any)."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailableError(
            "--plot needs matplotlib, which is not installed; install it with "
            "pip install matplotlib, or drop --plot "
            "(the JSON report holds the same figures)"
        ) from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(report: BenchReport, path: str | Path) -> Path:
    """Write tokens/s vs batch size per mode to ``path``; raises PlotUnavailableError."""
    plt = _pyplot()
    series: dict[str, list[tuple[int, float]]] = {}
    for r in report.results:
        if r.status in (OK, FALLBACK) and r.tokens_per_s:
            label = r.mode if r.status == OK else f"{r.mode} (fallback)"
            series.setdefault(label, []).append((r.batch_size, r.tokens_per_s))
    if not series:
        raise ValueError("nothing to plot: no mode produced a steady-state figure")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        points.sort()
        ax.plot([b for b, _ in points], [t for _, t in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    batches = sorted({b for points in series.values() for b, _ in points})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("generated tokens/s (steady state)")
    cfg = report.config
    ax.set_title(
        f"{cfg['model']} {cfg['dtype']}, {cfg['prompt_len']}+{cfg['new_tokens']} tokens, "
        f"{report.backend.get('device_name')}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(target, dpi=120)
    plt.close(fig)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m graphcap.bench.plot REPORT.json OUT.png``: plot a saved report."""
    import argparse
    import sys

    from graphcap.bench.report import load_report

    parser = argparse.ArgumentParser(
        prog="python -m graphcap.bench.plot",
        description="Plot tokens/s vs batch size from a graphcap bench JSON report.",
    )
    parser.add_argument("report", help="JSON written by graphcap bench --json")
    parser.add_argument("output", help="PNG to write")
    args = parser.parse_args(argv)
    try:
        written = plot_throughput(load_report(args.report), args.output)
    except (PlotUnavailableError, ValueError, OSError) as exc:
        print(f"graphcap bench plot: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
