"""The benchmark report: one JSON-serialisable record per (mode, batch size), plus context.

Ratios are only ever taken between modes measured in the same run (same process, same model,
same prompts): absolute times move by tens of percent between machines, ratios much less.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

SCHEMA_VERSION = 1

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
    steady_s: list[float] = field(default_factory=list)
    prefill_s: float | None = None
    decode_step_s: float | None = None
    tokens_per_s: float | None = None
    weight_bandwidth_gbps: float | None = None
    bandwidth_fraction: float | None = None
    peak_memory_bytes: int | None = None
    engine_memory_bytes: int | None = None
    graph_pool_bytes: int | None = None
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=_json_default)

    def write_json(self, path: str | Path) -> Path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.to_json() + "\n")
        return target

    def result(self, mode: str, batch_size: int) -> ModeResult | None:
        return next(
            (r for r in self.results if r.mode == mode and r.batch_size == batch_size), None
        )


def load_report(path: str | Path) -> BenchReport:
    """Read a report written by :meth:`BenchReport.write_json` (e.g. to plot it elsewhere)."""
    data = json.loads(Path(path).read_text())
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: report schema version {version!r}, this graphcap reads {SCHEMA_VERSION}"
        )
    data["results"] = [ModeResult(**r) for r in data["results"]]
    data["rl_loop"] = [
        RLLoopResult(**{**r, "iterations": [RLIteration(**i) for i in r["iterations"]]})
        for r in data["rl_loop"]
    ]
    return BenchReport(**data)


def _json_default(value: object) -> object:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def fill_ratios(results: list[ModeResult]) -> None:
    """Speed-ups of every measured mode over the HF baselines at the same batch size.

    A ratio > 1 means faster than the baseline (baseline steady time / this mode's). A baseline
    that fell back, errored or recompiled in the steady state is not a baseline: no ratio.
    """
    baselines = {
        (r.mode, r.batch_size): r.steady_median_s
        for r in results
        if r.status == OK and r.steady_median_s and not r.recompiles_steady
    }
    for r in results:
        if r.status not in (OK, FALLBACK) or not r.steady_median_s:
            continue
        eager = baselines.get(("hf-eager", r.batch_size))
        static = baselines.get(("hf-static-compile", r.batch_size))
        r.speedup_vs_hf_eager = eager / r.steady_median_s if eager else None
        r.speedup_vs_hf_static_compile = static / r.steady_median_s if static else None


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _fmt_bytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}G"


def _agreement(r: ModeResult) -> str:
    if r.token_agreement is None:
        return "n/a"
    return "same" if r.tokens_identical else f"{r.token_agreement * 100:.1f}%"


TABLE_COLUMNS: tuple[str, ...] = (
    "mode",
    "bs",
    "first(s)",
    "steady(ms)",
    "step(ms)",
    "tok/s",
    "BW%",
    "peak mem",
    "capt",
    "tokens",
    "x hf-eager",
    "x hf-static",
)


def format_table(report: BenchReport) -> str:
    """A plain-text table of the results, one row per (mode, batch size), then notes."""
    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    for r in report.results:
        if r.status in (UNSUPPORTED, ERROR, SKIPPED):
            rows.append((r.mode, str(r.batch_size), r.status, *([""] * 9)))
            notes.append(f"{r.mode} (bs {r.batch_size}): {r.status}: {r.reason}")
            continue
        mode = r.mode if r.status == OK else f"{r.mode} [{r.status}]"
        if r.reason:
            notes.append(f"{r.mode} (bs {r.batch_size}): {r.reason}")
        rows.append(
            (
                mode,
                str(r.batch_size),
                _fmt(r.first_call_s, ".2f"),
                _fmt(None if r.steady_median_s is None else r.steady_median_s * 1e3, ".1f"),
                _fmt(None if r.decode_step_s is None else r.decode_step_s * 1e3, ".2f"),
                _fmt(r.tokens_per_s, ".0f"),
                _fmt(None if r.bandwidth_fraction is None else r.bandwidth_fraction * 100, ".0f"),
                _fmt_bytes(r.peak_memory_bytes),
                "n/a" if r.captures is None else str(r.captures),
                _agreement(r),
                _fmt(r.speedup_vs_hf_eager, ".2f", "x"),
                _fmt(r.speedup_vs_hf_static_compile, ".2f", "x"),
            )
        )
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(TABLE_COLUMNS)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(TABLE_COLUMNS, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    header = _header(report)
    footer = [*(f"note: {n}" for n in notes), *(f"warning: {w}" for w in report.warnings)]
    return "\n".join([*header, "", *lines, *(["", *footer] if footer else [])])


def _header(report: BenchReport) -> list[str]:
    cfg, model, backend = report.config, report.model, report.backend
    peak = report.peak_bandwidth_gbps
    return [
        f"graphcap bench: {cfg['model']} ({model.get('architecture')}, "
        f"{model.get('parameters', 0) / 1e6:.1f}M params, {cfg['dtype']}) on "
        f"{backend.get('device_name')} [backend {backend.get('name')}]",
        f"prompt {cfg['prompt_len']} + {cfg['new_tokens']} new tokens, greedy, EOS off; "
        f"first call timed alone, steady = median of {cfg['repeats']} after "
        f"{cfg['warmup']} warmup; weights read per step "
        f"{report.weight_bytes_per_step / 1e9:.3f} GB; peak bandwidth "
        + ("n/a" if peak is None else f"{peak:.0f} GB/s"),
        f"tokens: agreement with {report.reference_mode} at the same batch size",
    ]


def format_rl_table(results: list[RLLoopResult]) -> str:
    """Per-iteration phases of the RL loop, one block per mode."""
    lines = []
    for res in results:
        lines.append(
            f"rl-loop {res.mode} (bs {res.batch_size}, {res.optimizer}): captures at end "
            f"{res.captures_final}, parameters reallocated: {res.parameters_reallocated}"
        )
        lines.append(
            "  iter  generate(ms)  train(ms)  captures  path          peak mem  =eager  changed"
        )
        for it in res.iterations:
            match = "n/a" if it.tokens_match_eager is None else str(it.tokens_match_eager)
            changed = "n/a" if it.tokens_changed is None else str(it.tokens_changed)
            lines.append(
                f"  {it.iteration:<4d}  {it.generate_s * 1e3:12.1f}  {it.train_step_s * 1e3:9.1f}"
                f"  {it.captures if it.captures is not None else 'n/a':>8}  "
                f"{it.path or 'n/a':<12}  {_fmt_bytes(it.peak_memory_bytes):>8}  {match:<6}  "
                f"{changed}"
            )
    return "\n".join(lines)
