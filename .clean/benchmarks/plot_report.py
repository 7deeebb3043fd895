"""Plot saved ``graphcap bench --json`` reports: tokens/s vs batch size per mode (needs
matplotlib). A picture of figures the JSON already holds, so it lives beside the bench, not in it.

python benchmarks/plot_report.py REPORT.json OUT.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

STEADY = ("ok", "fallback")  # statuses whose steady-state figures are real


def plot_throughput(report: dict[str, Any], path: str | Path) -> Path:
    """Write tokens/s vs batch size per mode of ``report`` (the JSON form) to ``path``."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from None
    plt.switch_backend("Agg")  # file output only
    cfg, series = report["config"], {}
    for r in report["results"]:
        if r["status"] in STEADY and r["tokens_per_s"]:
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
    ax.set(yscale="log", xlabel="batch size", ylabel="generated tokens/s (steady state)")
    ax.set_title(
        f"{cfg['model']} {cfg['dtype']}, {cfg['prompt_len']}+{cfg['new_tokens']} tokens, "
        f"{report['backend'].get('device_name')}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    (target := Path(path)).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    try:
        written = plot_throughput(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])
    except (ImportError, ValueError) as exc:
        sys.exit(f"plot_report.py: {exc}")
    print(f"wrote {written}")
