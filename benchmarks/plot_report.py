"""Plot a saved ``graphcap bench --json`` report: tokens/s vs batch size (needs matplotlib).

python benchmarks/plot_report.py REPORT.json OUT.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from graphcap.bench.report import plot_throughput

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"wrote {plot_throughput(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2])}")
