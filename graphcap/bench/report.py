"""The benchmark report (one JSON-serialisable record per mode and batch size) and its tables.

Ratios are only ever taken between modes measured in the same run (same process, same model,
same prompts): absolute times move by tens of percent between machines, ratios much less. All
text rendering lives here (:func:`render_table` lays out every table).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from graphcap.bench.modes import spread

#: 2: steady_max_s and decode_step_min_s / _max_s added, graph_pool_bytes (never set) removed.
SCHEMA_VERSION = 2

#: status values of a ModeResult
OK, FALLBACK, UNSUPPORTED, ERROR, SKIPPED = "ok", "fallback", "unsupported", "error", "skipped"


@dataclass
class ModeResult:
    """Figures of one mode at one batch size; ``None`` where a figure does not apply here."""

    mode: str
    batch_size: int
    status: str = OK
    reason: str | None = None
    first_call_s: float | None = None
    steady_median_s: float | None = None
    steady_min_s: float | None = None
    steady_max_s: float | None = None
    steady_s: list[float] = field(default_factory=list)
    prefill_s: float | None = None
    decode_step_s: float | None = None
    decode_step_min_s: float | None = None
    decode_step_max_s: float | None = None
    tokens_per_s: float | None = None
    weight_bandwidth_gbps: float | None = None
    bandwidth_fraction: float | None = None
    peak_memory_bytes: int | None = None
    engine_memory_bytes: int | None = None
    path: str | None = None
    captures: int | None = None
    replays_per_call: int | None = None
    occupancy: float | None = None
    compiled_graphs_first_call: int | None = None
    recompiles_steady: int | None = None
    graph_breaks: int | None = None
    token_agreement: float | None = None
    tokens_identical: bool | None = None
    first_call_tokens_identical: bool | None = None
    distinct_tokens: int | None = None
    speedup_vs_hf_eager: float | None = None
    speedup_vs_hf_static_compile: float | None = None


@dataclass
class RLIteration:
    """One generate -> train-step iteration of the RL loop for one engine."""

    iteration: int
    generate_s: float
    train_step_s: float
    loss: float
    captures: int | None
    path: str | None
    peak_memory_bytes: int | None
    train_peak_memory_bytes: int | None
    tokens_match_eager: bool | None
    tokens_changed: bool | None


@dataclass
class RLLoopResult:
    """The RL loop for one mode (eager or graph): per-iteration phases and the invariants."""

    mode: str
    batch_size: int
    optimizer: str
    iterations: list[RLIteration] = field(default_factory=list)
    parameters_reallocated: bool = False
    captures_final: int | None = None
    first_generate_s: float | None = None
    steady_generate_median_s: float | None = None
    train_step_median_s: float | None = None
    iteration_median_s: float | None = None


@dataclass
class BenchReport:
    """Everything one ``graphcap bench`` run measured, with the context needed to read it."""

    environment: dict[str, Any]
    backend: dict[str, Any]
    config: dict[str, Any]
    model: dict[str, Any]
    weight_bytes_per_step: int
    peak_bandwidth_gbps: float | None
    reference_mode: str | None
    results: list[ModeResult] = field(default_factory=list)
    rl_loop: list[RLLoopResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    elapsed_s: float | None = None
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def write_json(self, path: str | Path) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.to_json() + "\n")
        return target

    def result(self, mode: str, batch_size: int) -> ModeResult | None:
        return next((r for r in self.results if (r.mode, r.batch_size) == (mode, batch_size)), None)


# ---- text -------------------------------------------------------------------------------------
def render_table(
    columns: Sequence[str], rows: Sequence[Sequence[str]], indent: str = ""
) -> list[str]:
    """Left-aligned columns separated by two spaces, a dashed rule under the header."""
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(columns), line(["-" * w for w in widths]), *(line(row) for row in rows)]


def _num(value: float | None, spec: str, scale: float = 1, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{suffix}"


def _spread(median: float | None, low: float | None, high: float | None, spec: str) -> str:
    """``median [min-max]`` in ms (the spread only when it is known)."""
    if median is None:
        return "n/a"
    if low is None or high is None:
        return _num(median, spec, 1e3)
    return f"{median * 1e3:{spec}} [{low * 1e3:{spec}}-{high * 1e3:{spec}}]"


def _gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}G"


def _tokens(r: ModeResult) -> str:
    if r.token_agreement is None:
        return "n/a"
    return "same" if r.tokens_identical else f"{r.token_agreement * 100:.1f}%"


COLUMNS = ("mode", "bs", "first(s)", "steady ms [min-max]", "step ms [min-max]", "tok/s", "BW%")
COLUMNS += ("peak mem", "capt", "tokens", "x hf-eager", "x hf-static")


def format_table(report: BenchReport) -> str:
    """The whole report as text: header, one row per (mode, batch size), RL loop, notes."""
    rows, notes = [], []
    for r in report.results:
        if r.reason:
            notes.append(f"{r.mode} (bs {r.batch_size}): {r.status}: {r.reason}")
        if r.status in (UNSUPPORTED, ERROR, SKIPPED):
            rows.append((r.mode, str(r.batch_size), r.status, *[""] * (len(COLUMNS) - 3)))
            continue
        rows.append((
            r.mode if r.status == OK else f"{r.mode} [{r.status}]",
            str(r.batch_size),
            _num(r.first_call_s, ".2f"),
            _spread(r.steady_median_s, r.steady_min_s, r.steady_max_s, ".1f"),
            _spread(r.decode_step_s, r.decode_step_min_s, r.decode_step_max_s, ".2f"),
            _num(r.tokens_per_s, ".0f"),
            _num(r.bandwidth_fraction, ".0f", 100),
            _gib(r.peak_memory_bytes),
            _num(r.captures, "d"),
            _tokens(r),
            _num(r.speedup_vs_hf_eager, ".2f", suffix="x"),
            _num(r.speedup_vs_hf_static_compile, ".2f", suffix="x"),
        ))  # fmt: skip
    cfg, model, peak = report.config, report.model, report.peak_bandwidth_gbps
    lines = [
        f"graphcap bench: {cfg['model']} ({model.get('architecture')}, "
        f"{model.get('parameters', 0) / 1e6:.1f}M params, {cfg['dtype']}) on "
        f"{report.backend.get('device_name')} [backend {report.backend.get('name')}]",
        f"prompt {cfg['prompt_len']} + {cfg['new_tokens']} new tokens, greedy, EOS off; first "
        f"call timed alone, steady = median [min-max] of {cfg['repeats']} after {cfg['warmup']} "
        f"warmup; weights read per step {report.weight_bytes_per_step / 1e9:.3f} GB; peak "
        f"bandwidth {_num(peak, '.0f', suffix=' GB/s')}",
        f"tokens: agreement with {report.reference_mode} at the same batch size",
        "",
        *render_table(COLUMNS, rows),
    ]
    for res in report.rl_loop:
        lines += ["", *_rl_block(res)]
    footer = [*(f"note: {n}" for n in notes), *(f"warning: {w}" for w in report.warnings)]
    return "\n".join(lines + (["", *footer] if footer else []))


def _rl_block(res: RLLoopResult) -> list[str]:
    """Per-iteration phases of the RL loop for one mode, after a summary with spreads."""
    later = spread(i.generate_s for i in res.iterations[1:]) or (None, None, None)
    train = spread(i.train_step_s for i in res.iterations) or (None, None, None)
    rows = [
        (
            str(it.iteration),
            f"{it.generate_s * 1e3:.1f}",
            f"{it.train_step_s * 1e3:.1f}",
            _num(it.captures, "d"),
            it.path or "n/a",
            _gib(it.peak_memory_bytes),
            str(it.tokens_match_eager),
            "n/a" if it.tokens_changed is None else str(it.tokens_changed),
        )
        for it in res.iterations
    ]
    return [
        f"rl-loop {res.mode} (bs {res.batch_size}, {res.optimizer}): captures at end "
        f"{res.captures_final}, parameters reallocated: {res.parameters_reallocated}; generate "
        f"after the first {_spread(*later, '.1f')} ms, train step {_spread(*train, '.1f')} ms",
        *render_table(
            (
                "iter",
                "generate(ms)",
                "train(ms)",
                "captures",
                "path",
                "peak mem",
                "=eager",
                "changed",
            ),
            rows,
            indent="  ",
        ),
    ]
