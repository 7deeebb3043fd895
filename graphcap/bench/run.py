"""run_benchmark(): every selected mode, at every batch size, on one model and one prompt set.

The first call of a mode pays for capture or compilation once; what a long RL run pays per
rollout is the steady state. So the first call is timed alone, ``warmup`` calls are dropped, and
the steady figures are the median, min and max of ``repeats`` further calls.
"""

from __future__ import annotations

import gc
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import transformers

import graphcap
from graphcap.backend import Backend
from graphcap.bench import models
from graphcap.bench.config import BenchConfig, resolve
from graphcap.bench.modes import MODES, Workload, compile_counts, spread, timed_call
from graphcap.bench.report import ERROR, FALLBACK, OK, SKIPPED, UNSUPPORTED, BenchReport, ModeResult

#: Fewer distinct response tokens than this in the reference makes agreement nearly vacuous.
MIN_DISTINCT_TOKENS = 4


def run_benchmark(
    config: BenchConfig | None = None,
    *,
    backend: Backend | None = None,
    progress: Callable[[str], None] | None = None,
) -> BenchReport:
    """Every selected mode at every batch size (same process, model and prompts, so ratios are
    comparable); ``progress`` receives one line per step of the run."""
    backend = backend or graphcap.get_backend(config.backend if config else None)
    config = resolve(config or BenchConfig(), backend)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads or threads)
    try:
        return _run(config, backend, progress or (lambda _line: None))
    finally:
        torch.set_num_threads(threads)


def _run(config: BenchConfig, backend: Backend, say: Callable[[str], None]) -> BenchReport:
    started = time.monotonic()
    say(f"building {config.model} ({config.dtype}) on {backend.device}")
    dtype, device = models.DTYPES[config.dtype], backend.device
    model = models.build_model(
        config.model, dtype=dtype, device=device, seed=config.seed, backend_seed=backend.manual_seed
    )
    name = models.device_name(backend)
    peak = models.peak_bandwidth(name, config.peak_bandwidth)
    versions = {
        "graphcap": graphcap.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    report = BenchReport(
        environment={
            **versions,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        backend={**backend.describe(), "device_name": name},
        config=asdict(config),
        model=models.describe_model(model),
        weight_bytes_per_step=models.weight_bytes_per_step(model),
        peak_bandwidth_gbps=None if peak is None else peak / 1e9,
        reference_mode=next((m for m in ("graphcap-eager", "hf-eager") if m in config.modes), None),
    )
    with torch.no_grad():  # one forward first: the first mode must not pay device start-up
        model(input_ids=torch.zeros((1, 4), dtype=torch.long, device=device))
    backend.synchronize()

    def workload(batch: int, slots: int | None = None) -> Workload:
        ids, mask = models.make_prompts(
            model.config.vocab_size, batch, config.prompt_len, config.seed, device
        )
        return Workload(model, backend, ids, mask, config.new_tokens, slots)

    limit = config.compile_batch_sizes
    pairs = [
        (bs, m)
        for bs in config.batch_sizes
        for m in config.modes
        if limit is None or bs in limit or not MODES[m].compiles
    ]
    outputs: dict[tuple[str, int], tuple[Any, Any]] = {}
    for done, (bs, mode) in enumerate(pairs):
        if config.budget_s is not None and time.monotonic() - started > config.budget_s:
            report.results.append(
                ModeResult(mode, bs, SKIPPED, f"time budget of {config.budget_s:g} s spent")
            )
            continue
        say(f"[{done + 1}/{len(pairs)}, {len(pairs) - done - 1} left] bs {bs}: {mode}")
        result, calls = _run_mode(
            MODES[mode].name, workload(bs, config.continuous_slots), config, say
        )
        report.results.append(result)
        if calls is not None:
            outputs[mode, bs] = calls
        if result.decode_step_s:  # the roofline: weight bytes a step reads / step time
            result.weight_bandwidth_gbps = report.weight_bytes_per_step / result.decode_step_s / 1e9
            if report.peak_bandwidth_gbps is not None:
                result.bandwidth_fraction = (
                    result.weight_bandwidth_gbps / report.peak_bandwidth_gbps
                )
    _agreement(report, outputs)
    fill_ratios(report.results)
    if config.rl_loop:
        from graphcap.bench.rl_loop import run_rl_loop

        say(f"rl-loop: {config.rl_loop} iterations at bs {config.rl_batch_size}")
        rl_work = workload(config.rl_batch_size)
        report.rl_loop, warnings = run_rl_loop(
            rl_work,
            iterations=config.rl_loop,
            optimizer=config.rl_optimizer,
            lr=config.rl_lr,
            seed=config.seed,
        )
        report.warnings += warnings
    report.elapsed_s = time.monotonic() - started
    return report


def _run_mode(
    name: str, work: Workload, config: BenchConfig, say: Callable[[str], None]
) -> tuple[ModeResult, Any]:
    """Measure one mode at one batch size; also return its first and last call's output."""
    result, mode, backend = ModeResult(name, work.batch_size), MODES[name], work.backend
    result.reason = mode.unsupported(backend)
    if result.reason is not None:
        result.status = UNSUPPORTED
        say(f"  unsupported: {result.reason}")
        return result, None
    gc.collect()
    backend.empty_cache()
    backend.reset_peak_memory_stats()
    before, (graphs0, breaks0) = backend.memory_allocated(), compile_counts()

    def timed(label: str) -> tuple[float, Any]:
        seconds, out = timed_call(call, backend.synchronize)
        say(f"  {label}: {seconds * 1e3:.1f} ms")
        return seconds, out

    try:
        with mode.session(work) as call:
            result.first_call_s, first = timed("first")
            graphs1, held = compile_counts()[0], backend.memory_allocated()
            for i in range(config.warmup):
                timed(f"warmup {i + 1}")
            steady = [timed(f"steady {i + 1}") for i in range(config.repeats)]
    except Exception as exc:  # one broken mode must not lose the others' figures
        result.status, result.reason = ERROR, f"{type(exc).__name__}: {exc}"
        say(f"  error: {result.reason}\n{traceback.format_exc()}")
        return result, None
    graphs2, breaks2 = compile_counts()
    result.compiled_graphs_first_call, result.recompiles_steady = (
        graphs1 - graphs0,
        graphs2 - graphs1,
    )
    result.graph_breaks = breaks2 - breaks0
    if held is not None and before is not None:
        result.engine_memory_bytes = held - before  # what the engine keeps between calls
    result.peak_memory_bytes = backend.max_memory_allocated()
    result.steady_s, calls = [s for s, _ in steady], [out for _, out in steady]
    result.steady_median_s, result.steady_min_s, result.steady_max_s = spread(result.steady_s)
    result.tokens_per_s = work.batch_size * work.new_tokens / result.steady_median_s
    result.prefill_s = spread(c.prefill_s for c in calls)[0]
    step = spread(c.decode_step_s for c in calls)
    result.decode_step_s, result.decode_step_min_s, result.decode_step_max_s = step
    stats = calls[-1].stats
    result.path = "hf" if stats is None else stats.path
    if stats is not None:
        result.captures, result.replays_per_call = stats.captures, stats.replays
        result.occupancy = spread(c.stats.occupancy for c in calls)[0]
    if mode.expected_path is not None and result.path != mode.expected_path:
        result.status = FALLBACK
        result.reason = f"ran eagerly: {stats.fallback_reason or 'no graph was captured'}"
    elif name == "hf-static-compile" and not result.compiled_graphs_first_call:
        result.status = FALLBACK
        result.reason = "generate() compiled nothing on this device (ran uncompiled)"
    elif name == "hf-static-compile" and result.recompiles_steady:
        result.reason = (
            f"recompiled {result.recompiles_steady} graph(s) after the first call: a broken "
            "baseline (its steady time includes compilation); not used for ratios"
        )
    return result, (first, calls[-1])


def token_agreement(tokens: torch.Tensor, reference: torch.Tensor) -> float | None:
    """Fraction of positions where ``tokens`` equals ``reference``; None if the shapes differ."""
    if tokens.shape != reference.shape:
        return None
    return float((tokens == reference).float().mean()) if tokens.numel() else 1.0


def _agreement(report: BenchReport, outputs: dict[tuple[str, int], tuple[Any, Any]]) -> None:
    """Token agreement of every mode's first and last call with the reference's last call."""
    ref, warn = report.reference_mode, report.warnings.append
    if ref is None:
        warn("no reference mode (graphcap-eager or hf-eager) selected: token agreement unchecked")
    for (name, bs), (first, last) in outputs.items():
        r = report.result(name, bs)
        r.distinct_tokens = int(torch.unique(last.tokens).numel())
        expected = outputs[ref, bs][1].tokens if (ref, bs) in outputs else None
        r.token_agreement = None if expected is None else token_agreement(last.tokens, expected)
        if r.token_agreement is None:
            continue
        r.tokens_identical = r.token_agreement == 1.0
        r.first_call_tokens_identical = token_agreement(first.tokens, expected) == 1.0
        if name == ref and r.distinct_tokens < MIN_DISTINCT_TOKENS:
            warn(f"the reference output at bs {bs} has only {r.distinct_tokens} distinct tokens")
        if r.status == OK and not r.tokens_identical:
            warn(f"{name} (bs {bs}) differs from {ref} in {(1 - r.token_agreement):.1%} of tokens")


def fill_ratios(results: list[ModeResult]) -> None:
    """Speed-ups over the HF baselines at the same batch size (baseline time / this mode's; > 1
    is faster). A baseline that fell back, errored or recompiled in the steady state is none."""
    base = {
        (r.mode, r.batch_size): r.steady_median_s
        for r in results
        if r.status == OK and r.steady_median_s and not r.recompiles_steady
    }
    for r in results:
        if r.status in (OK, FALLBACK) and r.steady_median_s:
            eager, static = (base.get((m, r.batch_size)) for m in ("hf-eager", "hf-static-compile"))
            r.speedup_vs_hf_eager = eager / r.steady_median_s if eager else None
            r.speedup_vs_hf_static_compile = static / r.steady_median_s if static else None
