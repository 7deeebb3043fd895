"""Optional PNG plot: tokens/s against batch size, one line per mode (needs matplotlib).

``python -m graphcap.bench.plot REPORT.json OUT.png`` plots a report saved with ``--json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed; the message says how to get it."""


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend; call it early to fail before a long run."""
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailableError(
            "--plot needs matplotlib, which is not installed; install it with pip install "
            "'graphcap[plot]' (or pip install matplotlib), or drop --plot (the JSON report "
            "holds the same figures)"
        ) from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(report: dict[str, Any], path: str | Path) -> Path:
    """Write tokens/s vs batch size per mode of ``report`` (the JSON form) to ``path``."""
    plt = pyplot()
    series: dict[str, list[tuple[int, float]]] = {}
    for r in report["results"]:
        if r["status"] in ("ok", "fallback") and r["tokens_per_s"]:
            label = r["mode"] + ("" if r["status"] == "ok" else " (fallback)")
            series.setdefault(label, []).append((r["batch_size"], r["tokens_per_s"]))
    if not series:
        raise ValueError("nothing to plot: no mode produced a steady-state figure")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in series.items():
        ax.plot(*zip(*sorted(points), strict=True), marker="o", label=label)
    batches = sorted({b for points in series.values() for b, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set(xlabel="batch size", ylabel="generated tokens/s (steady state)")
    cfg = report["config"]
    ax.set_title(
        f"{cfg['model']} {cfg['dtype']}, {cfg['prompt_len']}+{cfg['new_tokens']} tokens, "
        f"{report['backend'].get('device_name')}"
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
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0].startswith("-"):
        print("usage: python -m graphcap.bench.plot REPORT.json OUT.png", file=sys.stderr)
        return 2
    try:
        print(
            f"wrote {plot_throughput(json.loads(Path(args[0]).read_text()), args[1])}",
            file=sys.stderr,
        )
    except (PlotUnavailableError, ValueError, OSError, KeyError) as exc:
        print(f"graphcap bench plot: {exc!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
