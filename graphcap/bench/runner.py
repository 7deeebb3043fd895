"""run_benchmark(): every selected mode, at every batch size, on one model and one prompt set."""

from __future__ import annotations

import gc
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import transformers

import graphcap
from graphcap.backend import Backend
from graphcap.bench import modes as modes_mod
from graphcap.bench.compile_watch import compile_counts
from graphcap.bench.modes import MODES, CallOutput, Workload
from graphcap.bench.presets import build_model, default_dtype_name, describe_model, parse_dtype
from graphcap.bench.report import (
    ERROR,
    FALLBACK,
    OK,
    SKIPPED,
    UNSUPPORTED,
    BenchReport,
    ModeResult,
    fill_ratios,
)
from graphcap.bench.roofline import (
    bandwidth_figures,
    device_name,
    peak_bandwidth,
    weight_bytes_per_step,
)
from graphcap.bench.timing import Measurement, measure

Progress = Callable[[str], None]

#: Fewer distinct response tokens than this in the reference makes agreement nearly vacuous.
MIN_DISTINCT_TOKENS = 4


@dataclass
class BenchConfig:
    """What to measure. ``None`` fields take the backend's defaults (see :func:`resolve`).

    ``compile_batch_sizes`` limits the modes that compile (their first call costs tens of
    seconds per batch size on a device) to those batch sizes; ``None`` means all. ``budget_s``
    bounds the mode sweep: (mode, batch size) pairs not started within it are reported as
    skipped. The RL loop runs after the sweep, outside the budget. ``threads`` sets torch's
    intra-op threads for the run (0: torch's default); restored afterwards.
    """

    model: str | None = None
    dtype: str | None = None
    batch_sizes: list[int] | None = None
    prompt_len: int | None = None
    new_tokens: int | None = None
    repeats: int | None = None
    warmup: int | None = None
    modes: list[str] | None = None
    seed: int = 0
    peak_bandwidth: float | None = None
    backend: str | None = None
    compile_batch_sizes: list[int] | None = None
    budget_s: float | None = None
    continuous_slots: int | None = None
    threads: int | None = None
    rl_loop: int = 0
    rl_batch_size: int | None = None
    rl_optimizer: str = "sgd"
    rl_lr: float = 1e-3


#: Defaults without an accelerator: the quick "graphcap bench" comparison (seconds on 2 cores).
#: One intra-op thread: a tiny model's matmuls gain nothing from more, and on a busy machine
#: extra threads make every step several times slower and the timings noisy.
CPU_DEFAULTS: dict[str, Any] = {
    "model": "tiny-llama",
    "threads": 1,
    "batch_sizes": [1, 4],
    "prompt_len": 16,
    "new_tokens": 16,
    "repeats": 3,
    "warmup": 1,
}
#: Defaults on an accelerator: a Llama-3.2-1B-shaped model, single stream, 128 + 128 tokens.
ACCELERATOR_DEFAULTS: dict[str, Any] = {
    "model": "llama-1b",
    "batch_sizes": [1],
    "prompt_len": 128,
    "new_tokens": 128,
    "repeats": 5,
    "warmup": 2,
}


def resolve(config: BenchConfig, backend: Backend) -> BenchConfig:
    """Fill unset fields with the defaults for this backend's device, and validate."""
    defaults = CPU_DEFAULTS if backend.device.type == "cpu" else ACCELERATOR_DEFAULTS
    values = {k: v if v is not None else defaults.get(k) for k, v in asdict(config).items()}
    resolved = replace(config, **values)
    if resolved.dtype is None:
        resolved.dtype = default_dtype_name(resolved.model, backend.device.type)
    if resolved.modes is None:
        resolved.modes = modes_mod.default_modes(backend)
    if resolved.rl_batch_size is None:
        resolved.rl_batch_size = resolved.batch_sizes[0]
    if resolved.threads is None:
        resolved.threads = 0
    _validate(resolved)
    return resolved


def _validate(config: BenchConfig) -> None:
    parse_dtype(config.dtype)
    checks = {
        "batch sizes": min(config.batch_sizes) if config.batch_sizes else 0,
        "prompt length": config.prompt_len,
        "new tokens": config.new_tokens,
        "repeats": config.repeats,
        "RL batch size": config.rl_batch_size,
        "continuous slots": config.continuous_slots or 1,
    }
    for what, value in checks.items():
        if value < 1:
            raise ValueError(f"{what} must be >= 1, got {value}")
    if config.new_tokens < 2:
        raise ValueError("new tokens must be >= 2 (the prefill token plus at least one step)")
    if config.warmup < 0 or config.rl_loop < 0:
        raise ValueError("warmup and --rl-loop must be >= 0")
    if config.threads < 0:
        raise ValueError(f"threads must be >= 0 (0: torch's default), got {config.threads}")
    if config.budget_s is not None and config.budget_s <= 0:
        raise ValueError(f"the time budget must be positive, got {config.budget_s}")
    if config.rl_optimizer not in ("sgd", "adamw"):
        raise ValueError(f"RL optimizer must be 'sgd' or 'adamw', got {config.rl_optimizer!r}")


def make_prompts(
    vocab_size: int, batch_size: int, prompt_len: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token prompts (full length, no padding), the same for every mode."""
    generator = torch.Generator().manual_seed(seed + batch_size)
    ids = torch.randint(0, vocab_size, (batch_size, prompt_len), generator=generator)
    return ids.to(device), torch.ones_like(ids).to(device)


def run_benchmark(
    config: BenchConfig | None = None,
    *,
    backend: Backend | None = None,
    progress: Progress | None = None,
) -> BenchReport:
    """Measure every selected mode at every batch size and return the report.

    All modes share one process, one model and one prompt set per batch size, so their ratios
    are comparable. ``progress`` receives one line per step of a long run.
    """
    backend = backend or graphcap.get_backend(config.backend if config else None)
    config = resolve(config or BenchConfig(), backend)
    threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        return _run(config, backend, progress or (lambda _line: None))
    finally:
        torch.set_num_threads(threads)


def _run(config: BenchConfig, backend: Backend, say: Progress) -> BenchReport:
    started = time.monotonic()
    deadline = None if config.budget_s is None else time.monotonic() + config.budget_s
    say(f"building {config.model} ({config.dtype}) on {backend.device}")
    model = build_model(
        config.model,
        dtype=parse_dtype(config.dtype),
        device=backend.device,
        seed=config.seed,
        backend_seed=backend.manual_seed,
    )
    report = _new_report(config, backend, model)
    peak = None if report.peak_bandwidth_gbps is None else report.peak_bandwidth_gbps * 1e9
    _warm_device(model, backend)
    for batch in config.batch_sizes:
        ids, mask = make_prompts(
            model.config.vocab_size, batch, config.prompt_len, config.seed, backend.device
        )
        work = Workload(
            model, backend, ids, mask, config.new_tokens, continuous_slots=config.continuous_slots
        )
        outputs: dict[str, tuple[CallOutput, CallOutput]] = {}
        for name in config.modes:
            if not _runs_at(name, batch, config):
                continue
            if deadline is not None and time.monotonic() > deadline:
                report.results.append(
                    ModeResult(name, batch, SKIPPED, f"time budget of {config.budget_s:g} s spent")
                )
                continue
            say(f"bs {batch}: {name}")
            result, calls = _run_mode(name, work, config, report.weight_bytes_per_step, peak, say)
            report.results.append(result)
            if calls is not None:
                outputs[name] = calls
        _fill_agreement(report, batch, outputs)
    fill_ratios(report.results)
    _collect_warnings(report)
    if config.rl_loop:
        from graphcap.bench.rl_loop import rl_warnings, run_rl_loop

        ids, mask = make_prompts(
            model.config.vocab_size,
            config.rl_batch_size,
            config.prompt_len,
            config.seed,
            backend.device,
        )
        work = Workload(model, backend, ids, mask, config.new_tokens)
        report.rl_loop = run_rl_loop(
            work,
            iterations=config.rl_loop,
            optimizer=config.rl_optimizer,
            lr=config.rl_lr,
            seed=config.seed,
            progress=say,
        )
        report.warnings += rl_warnings(report.rl_loop)
    report.elapsed_s = time.monotonic() - started
    return report


def _runs_at(name: str, batch: int, config: BenchConfig) -> bool:
    """Whether ``name`` is measured at ``batch`` (compiling modes may be limited)."""
    mode = MODES.get(name)
    limit = config.compile_batch_sizes
    return mode is None or not mode.compiles or limit is None or batch in limit


def _new_report(config: BenchConfig, backend: Backend, model: torch.nn.Module) -> BenchReport:
    name = device_name(backend)
    peak = peak_bandwidth(name, config.peak_bandwidth)
    return BenchReport(
        environment={
            "graphcap": graphcap.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        backend={**backend.describe(), "device_name": name},
        config=asdict(config),
        model=describe_model(model),
        weight_bytes_per_step=weight_bytes_per_step(model),
        peak_bandwidth_gbps=None if peak is None else peak / 1e9,
        reference_mode=_reference_mode(config.modes),
    )


def _reference_mode(modes: list[str]) -> str | None:
    for candidate in ("graphcap-eager", "hf-eager"):
        if candidate in modes:
            return candidate
    return None


def _warm_device(model: torch.nn.Module, backend: Backend) -> None:
    """One forward before any mode, so the first mode measured does not pay device start-up."""
    ids = torch.zeros((1, 4), dtype=torch.long, device=backend.device)
    with torch.no_grad():
        model(input_ids=ids)
    backend.synchronize()


def _run_mode(
    name: str,
    work: Workload,
    config: BenchConfig,
    weight_bytes: int,
    peak: float | None,
    say: Progress,
) -> tuple[ModeResult, tuple[CallOutput, CallOutput] | None]:
    """Measure one mode at one batch size; also return its first and last call's output."""
    result = ModeResult(mode=name, batch_size=work.batch_size)
    mode = MODES[name]()
    reason = mode.unsupported(work.backend)
    if reason is not None:
        result.status, result.reason = UNSUPPORTED, reason
        say(f"  unsupported: {reason}")
        return result, None
    backend = work.backend
    gc.collect()
    backend.empty_cache()
    backend.reset_peak_memory_stats()
    before = backend.memory_allocated()
    compiled = {"start": compile_counts()}

    def on_call(phase: str, index: int, seconds: float) -> None:
        if phase == "first":
            compiled["first"] = compile_counts()
            held = backend.memory_allocated()
            if held is not None and before is not None:
                result.engine_memory_bytes = held - before
        label = phase if phase == "first" else f"{phase} {index + 1}"
        say(f"  {label}: {seconds * 1e3:.1f} ms")

    try:
        mode.open(work)
        try:
            measured = measure(
                mode,
                repeats=config.repeats,
                warmup=config.warmup,
                sync=backend.synchronize,
                on_call=on_call,
            )
        finally:
            mode.close()
    except Exception as exc:  # one broken mode must not lose the others' figures
        result.status = ERROR
        result.reason = f"{type(exc).__name__}: {exc}"
        say(f"  error: {result.reason}\n{traceback.format_exc()}")
        return result, None
    end = compile_counts()
    result.compiled_graphs_first_call = compiled["first"].graphs - compiled["start"].graphs
    result.recompiles_steady = end.graphs - compiled["first"].graphs
    result.graph_breaks = end.graph_breaks - compiled["start"].graph_breaks
    result.peak_memory_bytes = backend.max_memory_allocated()
    _fill_timings(result, measured, work, weight_bytes, peak)
    _judge(result, mode, measured)
    return result, (measured.first.value, measured.last.value)


def _fill_timings(
    result: ModeResult,
    measured: Measurement[CallOutput],
    work: Workload,
    weight_bytes: int,
    peak: float | None,
) -> None:
    steady = [t.value for t in measured.steady]
    result.first_call_s = measured.first.seconds
    result.steady_s = measured.steady_seconds
    result.steady_median_s = measured.steady_median_s
    result.steady_min_s = min(measured.steady_seconds)
    result.tokens_per_s = work.batch_size * work.new_tokens / result.steady_median_s
    result.prefill_s = _median([c.prefill_s for c in steady])
    result.decode_step_s = _median([c.decode_step_s for c in steady])
    figures = bandwidth_figures(weight_bytes, result.decode_step_s, peak)
    result.weight_bandwidth_gbps = figures["weight_bandwidth_gbps"]
    result.bandwidth_fraction = figures["bandwidth_fraction"]
    last = measured.last.value
    result.path = last.path
    result.captures = last.captures
    result.replays_per_call = last.replays
    result.occupancy = _median([c.occupancy for c in steady])


def _median(values: list[float | None]) -> float | None:
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    mid = len(known) // 2
    return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2


def _judge(
    result: ModeResult, mode: modes_mod.BenchMode, measured: Measurement[CallOutput]
) -> None:
    """Mark results that are not what the mode name claims (fallbacks, broken baselines)."""
    last = measured.last.value
    if mode.expected_path is not None and last.path != mode.expected_path:
        result.status = FALLBACK
        result.reason = f"ran eagerly: {last.fallback_reason or 'no graph was captured'}"
    elif result.mode == "hf-static-compile":
        if not result.compiled_graphs_first_call:
            result.status = FALLBACK
            result.reason = "generate() compiled nothing on this device (ran uncompiled)"
        elif result.recompiles_steady:
            result.reason = (
                f"recompiled {result.recompiles_steady} graph(s) after the first call: a broken "
                "baseline (its steady time includes compilation); not used for ratios"
            )


def _fill_agreement(
    report: BenchReport, batch: int, outputs: dict[str, tuple[CallOutput, CallOutput]]
) -> None:
    """Token agreement of every mode's last steady call with the reference mode's."""
    reference = outputs.get(report.reference_mode or "")
    if reference is None:
        return
    ref_tokens = reference[1].tokens
    for name, (first, last) in outputs.items():
        result = report.result(name, batch)
        result.distinct_tokens = int(torch.unique(last.tokens).numel())
        if last.tokens.shape != ref_tokens.shape or first.tokens.shape != ref_tokens.shape:
            report.warnings.append(
                f"{name} (bs {batch}) returned {tuple(last.tokens.shape)} tokens, the reference "
                f"{tuple(ref_tokens.shape)}: not compared"
            )
            continue
        fraction = token_agreement(last.tokens, ref_tokens)
        result.token_agreement = fraction
        result.tokens_identical = fraction == 1.0
        result.first_call_tokens_identical = token_agreement(first.tokens, ref_tokens) == 1.0


def token_agreement(tokens: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of positions where ``tokens`` equals ``reference`` (shapes must match)."""
    if tokens.shape != reference.shape:
        raise ValueError(
            f"cannot compare token tensors of shapes {tuple(tokens.shape)} and "
            f"{tuple(reference.shape)}"
        )
    if tokens.numel() == 0:
        return 1.0
    return float((tokens == reference).float().mean())


def _collect_warnings(report: BenchReport) -> None:
    ref = report.reference_mode
    for r in report.results:
        if (
            r.mode == ref
            and r.distinct_tokens is not None
            and (r.distinct_tokens < MIN_DISTINCT_TOKENS)
        ):
            report.warnings.append(
                f"the reference output at bs {r.batch_size} has only {r.distinct_tokens} "
                "distinct tokens: token agreement says little for this model"
            )
        if r.status == OK and r.tokens_identical is False and r.mode != ref:
            report.warnings.append(
                f"{r.mode} (bs {r.batch_size}) differs from {ref} in "
                f"{(1 - (r.token_agreement or 0)) * 100:.1f}% of tokens"
            )
    if ref is None:
        report.warnings.append(
            "no reference mode (graphcap-eager or hf-eager) selected: token agreement not checked"
        )
