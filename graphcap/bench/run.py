"""run_benchmark(): every selected mode, at every batch size, on one model and one prompt set.
The first call of a mode (capture, compilation) is timed alone, ``warmup`` calls are dropped, and
the steady state an RL run pays per rollout is the median, min and max of ``repeats`` calls."""

from __future__ import annotations

import collections
import functools
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import transformers

import graphcap
from graphcap import preset_models
from graphcap.backend import Backend
from graphcap.bench import iteration, models, modes
from graphcap.bench import report as rep
from graphcap.bench.config import BenchConfig, resolve
from graphcap.bench.iteration import pause
from graphcap.bench.modes import MODES, CallOutput, Workload, compile_counts, spread, timed_call
from graphcap.bench.report import BenchReport, ModeResult

#: Fewer distinct response tokens than this in the reference makes agreement nearly vacuous.
MIN_DISTINCT_TOKENS = 4
REFERENCES = ("graphcap-eager", "hf-eager")
#: Lines of a failed child's output (stderr included) kept as its result's reason.
CHILD_REASON_LINES = 8
Say = Callable[[str], None]


def run_benchmark(
    config: BenchConfig | None = None,
    *,
    backend: Backend | None = None,
    progress: Say | None = None,
) -> BenchReport:
    """Every selected mode at every batch size (same model and prompts, so ratios are
    comparable; one process, or a fresh one per pair with ``isolate``); ``progress`` receives one
    line per step of the run."""
    backend = backend or graphcap.get_backend(config.backend if config else None)
    cfg, say = resolve(config or BenchConfig(), backend), progress or (lambda _line: None)
    threads, started = torch.get_num_threads(), time.monotonic()
    torch.set_num_threads(cfg.threads or threads)
    try:
        # Isolated pairs run before this process builds its model: none shares the device with it.
        in_child = functools.partial(_run_child, cfg, backend.name, say)
        isolated = _sweep(cfg, backend, started, say, in_child) if cfg.isolate else None
        # After isolated pairs the model only describes the run.
        report, workload = _prepare(cfg, backend, say, cfg.isolate)

        def in_process(bs: int, mode: str) -> tuple[ModeResult, Any]:
            return _run_mode(mode, workload(bs, cfg.continuous_slots), cfg, say)

        report.results, outputs = isolated or _sweep(cfg, backend, started, say, in_process)
        peak = report.peak_bandwidth_gbps
        for result in report.results:  # the roofline: weight bytes a step reads / step time
            if step := result.decode_step_s:
                gbps = result.weight_bandwidth_gbps = report.weight_bytes_per_step / step / 1e9
                result.bandwidth_fraction = None if peak is None else gbps / peak
        if cfg.workload == "step":  # sampled rounds differ between modes by design
            _agreement(report, outputs)
        fill_ratios(report.results)
        report.elapsed_s = time.monotonic() - started
        return report
    finally:
        torch.set_num_threads(threads)


def _prepare(
    cfg: BenchConfig, backend: Backend, say: Say, describe_only: bool = False
) -> tuple[BenchReport, Callable[..., Workload]]:
    """Build the model: an empty report describing the run, and a workload builder (batch
    size, continuous slots) on that model. ``describe_only``: the model is built on the meta
    device (shapes, no weights), enough for the report; no workload runs on it."""
    device = torch.device("meta") if describe_only else backend.device
    say(f"building {cfg.model} ({cfg.dtype}) on {device}")
    dtype, name, seed = preset_models.DTYPES[cfg.dtype], backend.device_name(), cfg.seed
    model = preset_models.build_model(
        cfg.model, dtype=dtype, device=device, seed=seed, backend_seed=backend.manual_seed
    )
    peaks = [models.peak_bandwidth(name, cfg.peak_bandwidth)]
    peaks.append(models.peak_bandwidth(name, cfg.peak_flops, models.PEAK_FLOPS))
    environment = {m.__name__: m.__version__ for m in (graphcap, torch, transformers)}
    environment.update(python=platform.python_version(), platform=platform.platform())
    report = BenchReport(
        {**environment, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        {**backend.describe(), "device_name": name},
        asdict(cfg),
        models.describe_model(model),
        models.weight_bytes_per_step(model),
        None if peaks[0] is None else peaks[0] / 1e9,
        next((m for m in REFERENCES if m in cfg.modes), None),
        peaks[1],
    )
    if not describe_only:
        with torch.no_grad():  # one forward first: the first mode must not pay device start-up
            model(input_ids=torch.zeros((1, 4), dtype=torch.long, device=device))
        backend.synchronize()
    settings = (cfg.graph_attention, cfg.fuse_projections, cfg.compile_cache, cfg.draws)
    settings += (cfg.trainer_exact,)
    settings, vocab = modes.engine_settings(*settings), model.config.vocab_size
    if cfg.workload == "rl-round":
        ids, mask = models.round_prompts(vocab, cfg.prompts, cfg.prompt_widths, seed, device)
        eos = models.eos_ids(vocab, cfg.new_tokens, cfg.eos_fraction, seed)
        sampling = {"do_sample": True, "temperature": cfg.temperature, "top_k": cfg.top_k}
        sampling.update(top_p=cfg.top_p, eos_token_id=eos, num_return_sequences=cfg.samples)
        args = (ids, mask, cfg.new_tokens, cfg.continuous_slots, settings, sampling, seed)
        round_work = Workload(model, backend, *args, models.round_costs(model, peaks))
        report.eos_ids = len(eos)

    def workload(batch: int, slots: int | None = None) -> Workload:
        if cfg.workload == "rl-round":
            return round_work
        ids, mask = models.make_prompts(vocab, batch, cfg.prompt_len, seed, device)
        return Workload(model, backend, ids, mask, cfg.new_tokens, slots, settings)

    return report, workload


def _sweep(
    cfg: BenchConfig, backend: Backend, started: float, say: Say, run_pair: Callable[..., Any]
) -> tuple[list[ModeResult], dict[tuple[str, int], tuple[Any, Any]]]:
    """Every (batch size, mode) pair in order, measured by ``run_pair`` while the time budget
    lasts (the rest are skipped); the results, and the first and last calls by (mode, size)."""
    compiled = cfg.compile_batch_sizes or cfg.batch_sizes
    pairs = [(b, m) for b in cfg.batch_sizes for m in cfg.modes]
    pairs = [(b, m) for b, m in pairs if b in compiled or not MODES[m].compiles(backend)]
    results, outputs = [], {}
    for done, (bs, mode) in enumerate(pairs):
        if cfg.budget_s is not None and time.monotonic() - started > cfg.budget_s:
            spent = f"time budget of {cfg.budget_s:g} s spent"
            results.append(ModeResult(mode, bs, rep.SKIPPED, spent))
            continue
        say(f"[{done + 1}/{len(pairs)}, {len(pairs) - done - 1} left] bs {bs}: {mode}")
        result, calls = run_pair(bs, mode)
        results.append(result)
        if calls is not None:
            outputs[mode, bs] = calls
    return results, outputs


def _run_child(cfg: BenchConfig, backend: str, say: Say, bs: int, mode: str) -> tuple[Any, Any]:
    """One pair in a fresh process (``python -m graphcap.bench.run``), so that it inherits no
    other mode's compiled code, allocator state or caches; its output lines go to ``say``, and
    the last ones are the reason of the ERROR result a failed child gives."""
    only = {"batch_sizes": [bs], "modes": [mode], "compile_batch_sizes": None}
    child = replace(cfg, **only, budget_s=None, isolate=False, backend=backend)
    with tempfile.TemporaryDirectory(prefix="graphcap-bench-") as folder:
        (Path(folder) / "config.json").write_text(json.dumps(asdict(child)))
        command = [sys.executable, "-m", "graphcap.bench.run", folder]
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        tail: collections.deque[str] = collections.deque(maxlen=CHILD_REASON_LINES)
        for line in proc.stdout or ():
            say(line.rstrip())
            tail.extend([line.rstrip()] if line.strip() else [])
        if proc.wait() != 0:
            reason = f"child process exited with status {proc.returncode}: " + "\n".join(tail)
            return ModeResult(mode, bs, rep.ERROR, reason), None
        saved = torch.load(Path(folder) / "result.pt", weights_only=True)
    tokens = saved["tokens"]
    calls = None if tokens is None else tuple(CallOutput(t, None, None) for t in tokens)
    return ModeResult(**saved["result"]), calls


def _child_main(folder: str) -> None:
    """A child of :func:`_run_child`: its one pair, measured as in-process runs measure theirs."""
    cfg = BenchConfig(**json.loads((Path(folder) / "config.json").read_text()))
    backend, say = graphcap.get_backend(cfg.backend), functools.partial(print, flush=True)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    _, workload = _prepare(cfg, backend, say)
    (bs,), (mode,) = cfg.batch_sizes, cfg.modes
    result, calls = _run_mode(mode, workload(bs, cfg.continuous_slots), cfg, say)
    tokens = None if calls is None else [c.tokens.cpu() for c in calls]
    torch.save({"result": asdict(result), "tokens": tokens}, Path(folder) / "result.pt")


def _run_mode(name: str, work: Workload, config: BenchConfig, say: Say) -> tuple[ModeResult, Any]:
    """Measure one mode at one batch size; also return its first and last call's output."""
    r, mode, backend = ModeResult(name, work.batch_size), MODES[name], work.backend
    if (reason := mode.unsupported(backend)) is not None:
        say(f"  unsupported: {reason}")
        return ModeResult(name, work.batch_size, rep.UNSUPPORTED, reason), None
    hf = mode.hf_kwargs is not None and config.hf_repeats is not None  # fewer calls of HF's
    gc.collect()
    backend.empty_cache()
    backend.reset_peak_memory_stats()
    before, (graphs0, breaks0, _) = backend.memory_allocated(), compile_counts()

    def timed(label: str) -> Any:
        seconds, out = timed_call(call, backend.synchronize)
        say(f"  {label}: {seconds * 1e3:.1f} ms")
        out.seconds = seconds
        return out

    try:
        with mode.session(work) as (call, engine):
            compiled_before = compile_counts()[2]
            first = timed("first")
            graphs1, _, compiled = compile_counts()
            first_compile_s, held = compiled - compiled_before, backend.memory_allocated()
            for i in range(0 if hf else config.warmup):
                timed(f"warmup {i + 1}")
            repeats = config.hf_repeats if hf else config.repeats
            calls, pauses, last = [], [], first
            for i in range(repeats):
                pauses.append(pause(config.between, work, engine, last, config.train_rows))
                calls.append(last := timed(f"steady {i + 1}"))
            calls = calls or [first]
    except Exception as exc:  # one broken mode must not lose the others' figures
        r.status, r.reason = rep.ERROR, f"{type(exc).__name__}: {exc}"
        say(f"  error: {r.reason}\n{traceback.format_exc()}")
        return r, None
    graphs2, breaks2, _ = compile_counts()
    r.compiled_graphs_first_call, r.recompiles_steady = graphs1 - graphs0, graphs2 - graphs1
    r.graph_breaks, r.first_call_s = breaks2 - breaks0, first.seconds
    r.engine_memory_bytes = None if None in (held, before) else held - before  # kept by the engine
    r.peak_memory_bytes = backend.max_memory_allocated()
    r.steady_s = [c.seconds for c in calls]
    r.steady_median_s, r.steady_min_s, r.steady_max_s = spread(r.steady_s)
    r.tokens_per_s = work.batch_size * work.new_tokens / r.steady_median_s
    r.prefill_s = spread(c.prefill_s for c in calls)[0]
    steps = spread(c.decode_step_s for c in calls)
    r.decode_step_s, r.decode_step_min_s, r.decode_step_max_s = steps
    if (stats := calls[-1].stats) is not None:
        r.captures, r.replays_per_call, r.attention = stats.captures, stats.replays, stats.attention
        r.occupancy = spread(c.stats.occupancy for c in calls)[0]
        r.compiled, r.compile_cache = first.stats.compiled, first.stats.compile_cache
        r.joined_projections = stats.fused_projections
        r.first_call_phases = rep.first_call_phases(first.stats, first.seconds, first_compile_s)
    r.path = "hf" if stats is None else stats.path
    if mode.expected_path is not None and r.path != mode.expected_path:
        r.status = rep.FALLBACK
        r.reason = f"ran eagerly: {stats.fallback_reason or 'no graph was captured'}"
    elif name == "hf-static-compile" and not r.compiled_graphs_first_call:
        r.status, r.reason = rep.FALLBACK, "generate() compiled nothing here (ran uncompiled)"
    elif name == "hf-static-compile" and r.recompiles_steady:
        r.reason = f"recompiled {r.recompiles_steady} graph(s) after the first call: a broken "
        r.reason += "baseline (its steady time includes compilation); not used for ratios"
    if work.sampling:
        fill_round(r, work, [first, *calls])
        if config.between != "nothing" and pauses:
            r.round["iteration"] = iteration.summary(pauses, first, calls, r.steady_s)
    return r, (first, calls[-1])


def response_lengths(tokens: torch.Tensor, eos: Sequence[int], cap: int) -> list[int]:
    """Each row's useful tokens: up to and including its first EOS, else the cap."""
    ended = torch.isin(tokens, torch.tensor(list(eos), dtype=tokens.dtype))
    return torch.where(ended.any(1), ended.int().argmax(1) + 1, cap).tolist()


def dead_share(lengths: Sequence[int]) -> float:
    """Share of row-steps (rows x steps until the longest row ended) spent on ended rows."""
    return 1 - sum(lengths) / (len(lengths) * max(lengths))


def fill_round(r: ModeResult, work: Workload, calls: list[CallOutput]) -> None:
    """``r.round``: per call (the first, then the steady ones) each row's length and the
    round's limit; medians over the steady calls. ``r.tokens_per_s`` counts useful tokens."""
    prompts = work.attention_mask.sum(1).repeat_interleave(work.sampling["num_return_sequences"])
    eos, cap = work.sampling["eos_token_id"], work.new_tokens
    lengths = [response_lengths(c.tokens, eos, cap) for c in calls]
    limits = [work.costs and models.round_limit(n, prompts.tolist(), work.costs) for n in lengths]
    steady = list(zip(lengths[1:], limits[1:], r.steady_s, strict=True))
    r.tokens_per_s = spread(sum(n) / s for n, _, s in steady)[0]
    fraction = spread(lim / s for _, lim, s in steady)[0] if work.costs else None
    r.round = {"lengths": lengths, "limits_s": limits, "limit_fraction": fraction}
    r.round["useful_tokens"] = round(spread(sum(n) for n, _, _ in steady)[0])
    r.round["dead_share"] = spread(dead_share(n) for n, _, _ in steady)[0]
    r.round["limit_s"] = spread(limits[1:])[0]


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
        r, expected = report.result(name, bs), outputs.get((ref, bs), (None, None))[1]
        r.distinct_tokens = int(torch.unique(last.tokens).numel())
        if name == ref and r.distinct_tokens < MIN_DISTINCT_TOKENS:
            warn(f"the reference output at bs {bs} has only {r.distinct_tokens} distinct tokens")
        if expected is None or (agree := token_agreement(last.tokens, expected.tokens)) is None:
            continue
        r.token_agreement, r.tokens_identical = agree, agree == 1.0
        r.first_call_tokens_identical = token_agreement(first.tokens, expected.tokens) == 1.0
        if r.status == rep.OK and not r.tokens_identical:
            warn(f"{name} (bs {bs}) differs from {ref} in {(1 - r.token_agreement):.1%} of tokens")


def fill_ratios(results: list[ModeResult]) -> None:
    """Speed-ups over the HF baselines at the same batch size (> 1 is faster); a baseline that
    fell back, errored or recompiled in the steady state gives none."""
    ok = [r for r in results if r.status == rep.OK and not r.recompiles_steady]
    base = {(r.mode, r.batch_size): r.steady_median_s for r in ok if r.steady_median_s}
    for r in results:
        if r.status in (rep.OK, rep.FALLBACK) and r.steady_median_s:
            eager, static = (base.get((m, r.batch_size)) for m in ("hf-eager", "hf-static-compile"))
            r.speedup_vs_hf_eager = eager / r.steady_median_s if eager else None
            r.speedup_vs_hf_static_compile = static / r.steady_median_s if static else None


if __name__ == "__main__":  # _run_child's entry point
    _child_main(sys.argv[1])
