"""Counting torch.compile activity, so a baseline that recompiles is reported, not trusted.

dynamo increments ``counters["stats"]["unique_graphs"]`` for every graph it compiles (a
recompilation included) and ``counters["graph_break"]`` per break; differences of these around a
call say whether that call compiled anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch._dynamo.utils import counters


@dataclass(frozen=True)
class CompileCounts:
    graphs: int
    graph_breaks: int

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(self.graphs - other.graphs, self.graph_breaks - other.graph_breaks)


def compile_counts() -> CompileCounts:
    """Compiled graphs and graph breaks so far in this process (monotonic; take differences)."""
    return CompileCounts(
        graphs=int(counters["stats"]["unique_graphs"]),
        graph_breaks=int(sum(counters["graph_break"].values())),
    )
