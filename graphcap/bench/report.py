"""The benchmark report (one JSON-serialisable record per mode and batch size), and its
rendering as text tables (benchmarks/plot_report.py plots a saved report)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from graphcap.cpu.backend import CPUBackend

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
    attention: str | None = None
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
    compiled: bool | None = None
    compile_cache: str | None = None
    joined_projections: int | None = None
    first_call_phases: dict[str, float] | None = None
    round: dict[str, Any] | None = None  # rl-round figures (run.fill_round)


#: Where a graphcap mode's first call spends its time: the prefill (input checks and the model
#: scan included), the warm-up before capture split into compiling (by dynamo's own clock) and the
#: rest (each kernel's first use), the capture, the decode loop, and the rest of the call. Every
#: capture counts once, under warm-up and capture, and the parts sum to the call's time.
PHASES: tuple[str, ...] = ("prefill_s", "compile_s", "warmup_s", "capture_s", "decode_s", "other_s")


def first_call_phases(stats: Any, total_s: float, compile_s: float = 0.0) -> dict[str, float]:
    """The phases of a first call that took ``total_s``, from its engine ``stats`` and the
    seconds dynamo spent compiling during it (counted against the warm-up). Each capture counts
    once, in ``capture_s`` (the engine's ``decode_s`` leaves out the ladder's mid-decode
    captures); ``other_s`` is the rest of the call."""
    compiling = min(max(compile_s, 0.0), stats.warmup_s)
    values = (stats.prefill_s, compiling, stats.warmup_s - compiling)
    values += (stats.capture_s - stats.warmup_s, stats.decode_s)
    phases = dict(zip(PHASES, values, strict=False))
    return {**phases, "other_s": max(0.0, total_s - sum(phases.values()))}


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
    peak_flops: float | None = None
    eos_ids: int | None = None  # rl-round: how many EOS ids end rows
    results: list[ModeResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    elapsed_s: float | None = None
    schema_version: int = 7  # the changes of each version: docs/benchmarks.md

    def write_json(self, path: str | Path) -> Path:
        (target := Path(path)).parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return target

    def result(self, mode: str, batch_size: int) -> ModeResult | None:
        return next((r for r in self.results if (r.mode, r.batch_size) == (mode, batch_size)), None)


# ---- text -------------------------------------------------------------------------------------
def _num(value: float | None, spec: str, scale: float = 1, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{suffix}"


def _spread(fields: str, spec: str = ".1f", scale: float = 1e3) -> Callable[[ModeResult], str]:
    """The cell ``median [min-max]`` (ms) of three ``fields`` (median, min, max); the median
    alone without a spread."""

    def cell(r: ModeResult) -> str:
        values = [getattr(r, name) for name in fields.split()]
        median, *rest = (_num(v, spec, scale) for v in values)
        return median if None in values[1:] else f"{median} [{rest[0]}-{rest[1]}]"

    return cell


def _round(key: str, spec: str, scale: float = 1) -> Callable[[ModeResult], str]:
    return lambda r: _num(r.round and r.round[key], spec, scale)


STEADY = "steady_median_s steady_min_s steady_max_s"
#: header -> cell, for a mode that ran (the others show their status after the batch size).
COLUMNS: dict[str, Callable[[ModeResult], str]] = {
    "mode": lambda r: r.mode if r.status == OK else f"{r.mode} [{r.status}]",
    "bs": lambda r: str(r.batch_size),
    "first(s)": lambda r: _num(r.first_call_s, ".2f"),
    "steady ms [min-max]": _spread(STEADY),
    "step ms [min-max]": _spread("decode_step_s decode_step_min_s decode_step_max_s", ".2f"),
    "tok/s": lambda r: _num(r.tokens_per_s, ".0f"),
    "BW%": lambda r: _num(r.bandwidth_fraction, ".0f", 100),
    "peak mem": lambda r: _num(r.peak_memory_bytes, ".2f", 2**-30, "G"),
    "capt": lambda r: _num(r.captures, "d"),
    "tokens": lambda r: "same" if r.tokens_identical else _num(r.token_agreement, ".1f", 100, "%"),
    "x hf-eager": lambda r: _num(r.speedup_vs_hf_eager, ".2f", suffix="x"),
    "x hf-static": lambda r: _num(r.speedup_vs_hf_static_compile, ".2f", suffix="x"),
}
ROUND_COLUMNS = {"mode": COLUMNS["mode"], "rows": COLUMNS["bs"], "first(s)": COLUMNS["first(s)"]}
ROUND_COLUMNS |= {"round s [min-max]": _spread(STEADY, ".2f", 1)}
ROUND_COLUMNS |= {"useful tok": _round("useful_tokens", "d"), "useful tok/s": COLUMNS["tok/s"]}
ROUND_COLUMNS |= {"ended%": _round("dead_share", ".0f", 100), "limit(s)": _round("limit_s", ".3g")}
ROUND_COLUMNS |= {"%limit": _round("limit_fraction", ".0f", 100)}
ROUND_COLUMNS |= {k: COLUMNS[k] for k in ("capt", "x hf-eager")}


def _iteration(cell: Callable[[dict[str, Any]], str]) -> Callable[[ModeResult], str]:
    return lambda r: cell(r.round["iteration"]) if r.round and "iteration" in r.round else "n/a"


#: Columns of a round after a pause (``--between``): graphs the steady rounds captured (new
#: sizes of the live-row ladder included), the wake's median milliseconds, the training step's
#: median seconds, the least share of what the engine held that its sleep gave back (the
#: device's own report), and the rollout's share of an iteration.
ITERATION_COLUMNS = {
    "new graphs": _iteration(lambda i: str(sum(i["captured"]))),
    "wake ms": _iteration(lambda i: _num(_median(i["wake_s"]), ".1f", 1e3)),
    "train s": _iteration(lambda i: _num(_median(i["train_s"]), ".2f")),
    "given back": _iteration(lambda i: _num(i["given_back_share"], ".0f", 100, "%")),
    "rollout%": _iteration(lambda i: _num(i["rollout_share"], ".0f", 100)),
}


def _median(values: Sequence[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


def render_table(
    columns: Sequence[str], rows: Sequence[Sequence[str]], indent: str = ""
) -> list[str]:
    """Left-aligned columns two spaces apart, a dashed rule under the header."""
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    rules = ["-" * w for w in widths]
    return [
        indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in (columns, rules, *rows)
    ]


def _mode_row(r: ModeResult, columns: dict[str, Callable[[ModeResult], str]]) -> list[str]:
    cells = [c(r) for c in columns.values()] if r.status in (OK, FALLBACK) else None
    return cells or [r.mode, str(r.batch_size), r.status, *[""] * (len(columns) - 3)]


def format_table(report: BenchReport) -> str:
    """The report as text: what ran, one row per (mode, batch size), notes."""
    cfg, model, backend = report.config, report.model, report.backend
    where = "a fresh process per mode and batch size" if cfg.get("isolate") else "one process"
    columns = ROUND_COLUMNS if cfg.get("workload") == "rl-round" else COLUMNS
    if cfg.get("between", "nothing") != "nothing":
        columns = columns | ITERATION_COLUMNS
    lines = [
        f"graphcap bench: {cfg['model']} ({model['architecture']}, "
        f"{model['parameters'] / 1e6:.1f}M params, {cfg['dtype']}) on "
        f"{backend['device_name']} [backend {backend['name']}], {where}",
        *_header(report),
    ]
    if backend["name"] == CPUBackend.name:
        lines += [CPU_REFERENCE]
    lines += ["", *render_table(list(columns), [_mode_row(r, columns) for r in report.results])]
    rs = report.results
    if phased := [r for r in rs if r.first_call_phases]:
        lines += ["", "first calls (s): " + " + ".join(p.removesuffix("_s") for p in PHASES)]
        lines += [f"  {_phases_line(r)}" for r in phased]
    notes = [f"note: {r.mode} (bs {r.batch_size}): {r.status}: {r.reason}" for r in rs if r.reason]
    if "x hf-static" in columns and any(_no_ratio(r) for r in rs):
        notes += [_no_static_baseline(rs)]
    notes += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines + (["", *notes] if notes else []))


#: Said under the header of a run on the CPU reference backend, whose ratios are not speed.
CPU_REFERENCE = (
    "on the CPU reference backend these runs check correctness (tokens, captures, fallbacks), "
    "not speed: its graphs replay the recorded aten operations one by one from Python, so graph "
    "modes are not expected to beat HF here; speed is measured on an accelerator backend; "
    "'given back' reads the host's available memory, which every other process moves too "
    "(noise larger than a small model's cache, so it can read below 0%)"
)


def _no_ratio(r: ModeResult) -> bool:
    return r.status in (OK, FALLBACK) and r.speedup_vs_hf_static_compile is None


def _no_static_baseline(results: Sequence[ModeResult]) -> str:
    """Why ``x hf-static`` reads n/a: the baseline did not run, or could not serve as one."""
    if not any(r.mode == "hf-static-compile" for r in results):
        return (
            "note: x hf-static is n/a: hf-static-compile did not run (a default mode on "
            "accelerators only; --modes adds it)"
        )
    return (
        "note: x hf-static is n/a where hf-static-compile did not finish or compiled again in "
        "its steady calls (its row says which): no baseline at that batch size"
    )


def _header(report: BenchReport) -> list[str]:
    """What the rows measured: the steps' or the round's settings, the peaks."""
    cfg, bandwidth = report.config, _num(report.peak_bandwidth_gbps, ".0f", suffix=" GB/s")
    if cfg.get("workload") != "rl-round":
        unknown = " (unknown device: give --peak-bandwidth)" if bandwidth == "n/a" else ""
        return [
            f"prompt {cfg['prompt_len']} + {cfg['new_tokens']} new tokens, greedy, EOS off; first "
            f"call timed alone, steady = median [min-max] of {cfg['repeats']} after "
            f"{cfg['warmup']} warmup; weights read per step "
            f"{report.weight_bytes_per_step / 1e9:.3f} GB; peak bandwidth {bandwidth}{unknown}",
            f"tokens: agreement with {report.reference_mode} at the same batch size",
        ]
    hf = cfg["repeats"] if cfg["hf_repeats"] is None else cfg["hf_repeats"] or "the first"
    between = {
        "nothing": "steady rounds back to back",
        "sleep-train": f"before each steady round the engine slept and a training step ran on "
        f"{cfg.get('train_rows')} of the round's rows (forward, backward, SGD in place)",
        "move": "before each steady round every parameter moved to new storage",
    }[cfg.get("between", "nothing")]
    return [
        f"rl-round: {cfg['prompts']} prompts of {cfg['prompt_widths'][0]}-"
        f"{cfg['prompt_widths'][1]} tokens (left-padded) x {cfg['samples']} samples, up to "
        f"{cfg['new_tokens']} new; temperature {cfg['temperature']:g}, top-k "
        f"{cfg['top_k'] or 'off'}, top-p {cfg['top_p']:g}; rows end at {report.eos_ids} EOS ids "
        f"(mean length {cfg['eos_fraction']:g} of the cap before it cuts); continuous slots "
        f"{cfg['continuous_slots']}; useful: tokens up to EOS; ended%: row-steps of ended rows",
        f"first round timed alone; steady = median [min-max] of {cfg['repeats']} rounds (hf "
        f"modes: {hf}); {_limit(report)}; {between}",
    ]


def _limit(report: BenchReport) -> str:
    """The peaks a round's limit is reckoned at, or the options that give the missing ones."""
    peaks = {"--peak-bandwidth": report.peak_bandwidth_gbps, "--peak-flops": report.peak_flops}
    if missing := [option for option, value in peaks.items() if value is None]:
        return f"limit: n/a on an unknown device (give {' and '.join(missing)})"
    return (
        f"limit: the round's physical limit at {report.peak_bandwidth_gbps:.0f} GB/s and "
        f"{report.peak_flops:.3g} FLOP/s"
    )


def _phases_line(r: ModeResult) -> str:
    """``mode bs N: total = prefill + warmup + ...``, with what was compiled and cached."""
    phases = r.first_call_phases or {}
    parts = " + ".join(_num(phases.get(p), ".2f") for p in PHASES)
    compiled = f", compiled, compile cache {r.compile_cache}" if r.compiled else ""
    return f"{r.mode} bs {r.batch_size}: {_num(r.first_call_s, '.2f')} = {parts}{compiled}"
