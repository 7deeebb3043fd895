"""graphcap bench: structure, bookkeeping and invariants (never timing values).

The runs here use the tiny presets with a handful of tokens on the CPU reference backend, so
they check what the harness reports (statuses, captures, agreement, JSON shape), not how fast.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch

from graphcap.bench import command, modes, plot, presets
from graphcap.bench.modes import MODES, Workload, default_modes, parse_modes
from graphcap.bench.report import (
    ModeResult,
    RLLoopResult,
    fill_ratios,
    format_table,
    load_report,
)
from graphcap.bench.rl_loop import make_optimizer, rl_warnings, run_rl_loop
from graphcap.bench.roofline import (
    bandwidth_figures,
    parse_bandwidth,
    peak_bandwidth,
    weight_bytes_per_step,
)
from graphcap.bench.runner import (
    CPU_DEFAULTS,
    BenchConfig,
    make_prompts,
    resolve,
    run_benchmark,
    token_agreement,
)
from graphcap.bench.timing import StepClock, measure
from graphcap.cpu.backend import CPUBackend

CPU = torch.device("cpu")
#: A few tokens are enough to exercise every path; timings are never asserted.
SMALL = {"prompt_len": 4, "new_tokens": 3, "repeats": 1, "warmup": 0}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    # Tiny models gain nothing from intra-op threads, and on a busy 2-core machine two threads
    # per process make these runs several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def backend() -> CPUBackend:
    return CPUBackend()


@pytest.fixture(scope="module")
def tiny_llama() -> torch.nn.Module:
    return presets.build_model("tiny-llama", dtype=torch.float32, device=CPU)


class NoGraphBackend(CPUBackend):
    """A backend that cannot capture: graph modes must be refused, never faked."""

    name = "no-graph"

    def create_graph(self) -> None:
        return None


# ---- presets ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_tiny_presets_build_in_eval_mode_without_eos(name: str) -> None:
    model = presets.build_model(name, dtype=torch.float32, device=CPU)
    assert not model.training
    assert model.generation_config.eos_token_id is None
    assert model.generation_config.pad_token_id == 0
    info = presets.describe_model(model)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "billions", "tied"),
    [("gpt2-medium", 0.355, True), ("llama-1b", 1.236, True), ("llama-8b", 8.030, False)],
)
def test_large_presets_have_the_real_checkpoint_shapes(
    name: str, billions: float, tied: bool
) -> None:
    config = presets.PRESETS[name].make_config()
    with torch.device("meta"):
        model = presets.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = presets.describe_model(model)["parameters"]
    assert params == pytest.approx(billions * 1e9, rel=0.01)
    assert bool(config.tie_word_embeddings) is tied


def test_preset_outputs_are_varied_and_exactly_max_new_tokens(tiny_llama: Any) -> None:
    ids, mask = make_prompts(tiny_llama.config.vocab_size, 2, 8, seed=0, device=CPU)
    out = tiny_llama.generate(ids, attention_mask=mask, max_new_tokens=24, disable_compile=True)
    response = out[:, 8:]
    assert response.shape == (2, 24)
    # Degenerate (one repeated token) output would make token agreement vacuous.
    assert all(len(set(row.tolist())) >= 8 for row in response)


def test_default_dtypes() -> None:
    assert presets.default_dtype_name("llama-8b", "cpu") == "fp32"
    assert presets.default_dtype_name("gpt2-medium", "cuda") == "fp16"
    assert presets.default_dtype_name("llama-1b", "cuda") == "bf16"
    with pytest.raises(ValueError, match="choose one of"):
        presets.parse_dtype("fp8")


def test_unknown_model_is_a_clear_error(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        presets.build_model(str(tmp_path / "missing"), dtype=torch.float32, device=CPU)


def test_local_model_directory_loads(tmp_path: Any, tiny_llama: Any) -> None:
    tiny_llama.save_pretrained(tmp_path)
    loaded = presets.build_model(str(tmp_path), dtype=torch.float32, device=CPU)
    assert torch.equal(loaded.lm_head.weight, tiny_llama.lm_head.weight)
    assert loaded.generation_config.eos_token_id is None


# ---- roofline ---------------------------------------------------------------------------------
def test_weight_bytes_skip_gathered_embeddings_and_count_tied_once() -> None:
    llama = presets.build_model("tiny-llama", dtype=torch.float32, device=CPU)
    total = sum(p.numel() * 4 for p in llama.parameters())
    embed = llama.get_input_embeddings().weight.numel() * 4
    assert weight_bytes_per_step(llama) == total - embed  # untied: the lookup table is gathered

    gpt2 = presets.build_model("tiny-gpt2", dtype=torch.float16, device=CPU)
    total = sum(p.numel() * 2 for p in gpt2.parameters())  # wte counted once (tied)
    positions = gpt2.transformer.wpe.weight.numel() * 2
    assert weight_bytes_per_step(gpt2) == total - positions


def test_peak_bandwidth_table_override_and_parsing() -> None:
    assert peak_bandwidth("NVIDIA H200") == 4.8e12
    assert peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert peak_bandwidth("Some Future GPU") is None
    assert peak_bandwidth("NVIDIA H200", override=1e12) == 1e12
    assert parse_bandwidth("4.8TB/s") == pytest.approx(4.8e12)
    assert parse_bandwidth("3350GB/s") == pytest.approx(3.35e12)
    assert parse_bandwidth("2e12") == 2e12
    with pytest.raises(ValueError, match="cannot read bandwidth"):
        parse_bandwidth("fast")
    figures = bandwidth_figures(2_000_000_000, 0.001, 4e12)
    assert figures == {"weight_bandwidth_gbps": 2000.0, "bandwidth_fraction": 0.5}
    assert bandwidth_figures(1, None, 4e12)["bandwidth_fraction"] is None


# ---- timing (fake clocks) ---------------------------------------------------------------------
class FakeClock:
    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.durations = iter(durations)

    def __call__(self) -> float:
        return self.now

    def run(self) -> str:
        self.now += next(self.durations)
        return "out"


def test_measure_separates_first_call_warmup_and_steady_median() -> None:
    clock = FakeClock([9.0, 5.0, 1.0, 3.0, 2.0])
    syncs: list[int] = []
    m = measure(clock.run, repeats=3, warmup=1, sync=lambda: syncs.append(1), clock=clock)
    assert m.first.seconds == 9.0
    assert [w.seconds for w in m.warmup] == [5.0]
    assert m.steady_seconds == [1.0, 3.0, 2.0]
    assert m.steady_median_s == 2.0
    assert m.last.value == "out"
    assert len(syncs) == 10  # before and after every call
    with pytest.raises(ValueError, match="repeats"):
        measure(clock.run, repeats=0, warmup=0, sync=lambda: None)


def test_step_clock_reports_prefill_and_median_step() -> None:
    times = iter([10.0, 10.5, 10.6, 10.8, 10.9])
    clock = StepClock(sync=lambda: None, clock=lambda: next(times))
    clock.begin()
    ids = torch.zeros((3, 2), dtype=torch.long)
    for _ in range(4):
        stop = clock(ids, None)
        assert stop.shape == (3,) and not stop.any()
    assert clock.prefill_s == pytest.approx(0.5)
    assert clock.decode_step_s == pytest.approx(0.1)


def test_token_agreement() -> None:
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert token_agreement(ref.clone(), ref) == 1.0
    other = ref.clone()
    other[0] = 0
    assert token_agreement(other, ref) == 0.5
    with pytest.raises(ValueError, match="shapes"):
        token_agreement(ref[:, :2], ref)


def test_ratios_use_only_sound_baselines() -> None:
    results = [
        ModeResult("hf-eager", 1, steady_median_s=4.0),
        ModeResult("hf-static-compile", 1, steady_median_s=2.0, recompiles_steady=0),
        ModeResult("graphcap-graph", 1, steady_median_s=1.0),
        ModeResult("hf-eager", 8, steady_median_s=8.0),
        ModeResult("hf-static-compile", 8, steady_median_s=1.0, recompiles_steady=3),
        ModeResult("graphcap-graph", 8, steady_median_s=2.0),
    ]
    fill_ratios(results)
    assert results[2].speedup_vs_hf_eager == 4.0
    assert results[2].speedup_vs_hf_static_compile == 2.0
    assert results[5].speedup_vs_hf_eager == 4.0
    assert results[5].speedup_vs_hf_static_compile is None  # that baseline recompiled


# ---- whole runs on the CPU reference backend --------------------------------------------------
def test_run_benchmark_report_structure_and_json(backend: CPUBackend) -> None:
    config = BenchConfig(
        model="tiny-llama",
        batch_sizes=[1, 2],
        modes=[
            "hf-eager",
            "graphcap-eager",
            "graphcap-graph",
            "graphcap-graph-compiled",
            "graphcap-continuous",
            "graphcap-per-position",
        ],
        **SMALL,
    )
    report = run_benchmark(config, backend=backend)
    assert report.reference_mode == "graphcap-eager"
    assert len(report.results) == 12
    for bs in (1, 2):
        graph = report.result("graphcap-graph", bs)
        assert graph.status == "ok", graph.reason
        assert graph.path == "static_graph"
        assert graph.captures == 1
        assert graph.replays_per_call == SMALL["new_tokens"] - 1
        assert graph.tokens_identical and graph.first_call_tokens_identical
        assert graph.first_call_s > 0 and len(graph.steady_s) == SMALL["repeats"]
        assert graph.speedup_vs_hf_eager is not None
        assert graph.peak_memory_bytes is None  # the host reports no device memory
        assert report.result("hf-eager", bs).tokens_identical
        assert report.result("graphcap-eager", bs).captures == 0
        assert report.result("graphcap-graph-compiled", bs).status == "unsupported"
        continuous = report.result("graphcap-continuous", bs)
        assert continuous.status == "ok", continuous.reason
        assert continuous.path == "continuous_graph" and continuous.captures == 1
        assert continuous.tokens_identical and 0 < continuous.occupancy <= 1
        per_position = report.result("graphcap-per-position", bs)
        assert per_position.status == "ok", per_position.reason
        assert per_position.path == "per_position_graph"
        assert per_position.captures == SMALL["new_tokens"] - 1
        assert per_position.tokens_identical
    data = json.loads(report.to_json())
    assert data["schema_version"] == 1
    assert {"environment", "backend", "config", "model", "results", "rl_loop"} <= set(data)
    assert data["config"]["dtype"] == "fp32"
    assert data["peak_bandwidth_gbps"] is None  # no roofline on the host
    row = data["results"][0]
    for key in (
        "first_call_s",
        "steady_median_s",
        "decode_step_s",
        "tokens_per_s",
        "token_agreement",
        "compiled_graphs_first_call",
        "recompiles_steady",
    ):
        assert key in row
    table = format_table(report)
    assert "graphcap-graph" in table and "unsupported" in table


class MemoryReportingBackend(CPUBackend):
    """Reports device memory like an accelerator, from a scripted allocator."""

    name = "memory-reporting"

    def memory_allocated(self) -> int:
        return 1000

    def max_memory_allocated(self) -> int:
        return 5000

    def reset_peak_memory_stats(self) -> None:
        pass


def test_memory_and_roofline_figures_reach_the_report() -> None:
    config = BenchConfig(
        model="tiny-llama",
        batch_sizes=[1],
        modes=["graphcap-graph"],
        peak_bandwidth=50e9,
        **SMALL,
    )
    report = run_benchmark(config, backend=MemoryReportingBackend())
    graph = report.result("graphcap-graph", 1)
    assert graph.peak_memory_bytes == 5000
    assert graph.engine_memory_bytes == 0
    assert report.peak_bandwidth_gbps == 50.0
    expected = report.weight_bytes_per_step / graph.decode_step_s
    assert graph.weight_bandwidth_gbps == pytest.approx(expected / 1e9)
    assert graph.bandwidth_fraction == pytest.approx(expected / 50e9)


def test_continuous_mode_queues_rows_through_fewer_slots(backend: CPUBackend) -> None:
    config = BenchConfig(
        model="tiny-llama",
        batch_sizes=[5],
        modes=["graphcap-eager", "graphcap-continuous"],
        continuous_slots=2,
        **SMALL,
    )
    report = run_benchmark(config, backend=backend)
    continuous = report.result("graphcap-continuous", 5)
    assert continuous.status == "ok", continuous.reason
    assert continuous.tokens_identical
    # 5 rows through 2 slots take three waves of decode steps, not one.
    assert continuous.replays_per_call > 2 * (SMALL["new_tokens"] - 1)
    assert report.config["continuous_slots"] == 2


def test_graph_modes_are_refused_on_a_backend_without_graphs() -> None:
    modes = ["graphcap-eager", "graphcap-graph", "graphcap-continuous"]
    config = BenchConfig(model="tiny-llama", batch_sizes=[1], modes=modes, threads=2, **SMALL)
    report = run_benchmark(config, backend=NoGraphBackend())
    assert torch.get_num_threads() == 1  # the run's thread setting does not leak
    assert report.config["threads"] == 2
    for name in modes[1:]:
        graph = report.result(name, 1)
        assert graph.status == "unsupported"
        assert "cannot capture" in graph.reason
        assert graph.tokens_per_s is None


class FailingCaptureBackend(CPUBackend):
    """Hands out graphs, but every capture fails: the engine must finish eagerly."""

    name = "failing-capture"

    def capture_to_graph(self, graph: Any, **kwargs: Any) -> Any:
        raise RuntimeError("capture exploded")


def test_graph_mode_that_ran_eagerly_is_a_fallback_not_a_graph_result() -> None:
    config = BenchConfig(
        model="tiny-llama", batch_sizes=[1], modes=["graphcap-eager", "graphcap-graph"], **SMALL
    )
    with pytest.warns(RuntimeWarning, match="capture exploded"):
        report = run_benchmark(config, backend=FailingCaptureBackend())
    graph = report.result("graphcap-graph", 1)
    assert graph.status == "fallback"
    assert "capture exploded" in graph.reason
    assert graph.path == "eager" and graph.captures == 0
    assert graph.tokens_identical  # the eager completion still gives the reference tokens
    assert "[fallback]" in format_table(report)


def test_rl_warnings_flag_recaptures_and_reallocation() -> None:
    good = RLLoopResult("graphcap-graph", 2, "sgd", captures_final=1)
    assert rl_warnings([good]) == []
    bad = RLLoopResult("graphcap-graph", 2, "sgd", captures_final=3, parameters_reallocated=True)
    text = " ".join(rl_warnings([bad]))
    assert "captured 3 times" in text and "reallocated" in text


def test_static_compile_baseline_that_compiled_nothing_is_reported(backend: CPUBackend) -> None:
    # transformers compiles static-cache decode only on some accelerators, not on the CPU.
    config = BenchConfig(model="tiny-gpt2", batch_sizes=[1], modes=["hf-static-compile"], **SMALL)
    result = run_benchmark(config, backend=backend).result("hf-static-compile", 1)
    assert result.status == "fallback"
    assert result.compiled_graphs_first_call == 0
    assert "compiled nothing" in result.reason


def test_compiling_modes_limited_to_their_batch_sizes_and_budget_skips(
    backend: CPUBackend,
) -> None:
    config = BenchConfig(
        model="tiny-gpt2",
        batch_sizes=[1, 2],
        compile_batch_sizes=[2],
        modes=["hf-static-compile", "graphcap-eager"],
        **SMALL,
    )
    report = run_benchmark(config, backend=backend)
    assert [(r.mode, r.batch_size) for r in report.results] == [
        ("graphcap-eager", 1),
        ("hf-static-compile", 2),
        ("graphcap-eager", 2),
    ]
    spent = run_benchmark(replace(config, budget_s=1e-9), backend=backend)
    assert {r.status for r in spent.results} == {"skipped"}
    assert "budget" in spent.results[0].reason


@pytest.mark.parametrize(("optimizer", "lr"), [("sgd", 1e-2), ("adamw", 1e-3)])
def test_rl_loop_keeps_one_capture_across_in_place_updates(
    backend: CPUBackend, tiny_llama: Any, optimizer: str, lr: float
) -> None:
    model = presets.build_model("tiny-llama", dtype=torch.float32, device=CPU)
    ids, mask = make_prompts(model.config.vocab_size, 2, 4, seed=0, device=CPU)
    work = Workload(model, backend, ids, mask, new_tokens=4)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    eager, graph = run_rl_loop(work, iterations=3, optimizer=optimizer, lr=lr)
    assert (eager.mode, graph.mode) == ("graphcap-eager", "graphcap-graph")
    assert graph.captures_final == 1 and eager.captures_final == 0
    assert [it.captures for it in graph.iterations] == [1, 1, 1]
    assert all(it.path == "static_graph" for it in graph.iterations)
    # The graph sees the updated weights: same tokens as eager on the same weights...
    assert all(it.tokens_match_eager for it in graph.iterations)
    # ...and the updates did change what the model generates.
    assert any(it.tokens_changed for it in graph.iterations[1:])
    assert not graph.parameters_reallocated
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    assert not model.training
    assert not torch.equal(model.lm_head.weight, tiny_llama.lm_head.weight)


def test_adamw_refuses_fp16_weights() -> None:
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp16"):
        make_optimizer("adamw", [param], 1e-3, torch.float16)


# ---- configuration and command line -----------------------------------------------------------
def test_defaults_without_accelerator_are_the_quick_cpu_comparison(backend: CPUBackend) -> None:
    config = resolve(BenchConfig(), backend)
    for key, value in CPU_DEFAULTS.items():
        assert getattr(config, key) == value
    assert config.dtype == "fp32"
    assert config.modes == default_modes(backend)
    assert "hf-static-compile" not in config.modes
    with pytest.raises(ValueError, match="new tokens"):
        resolve(BenchConfig(new_tokens=1), backend)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    return p


def test_cli_arguments_parse() -> None:
    args = parser().parse_args(
        [
            "--model",
            "llama-8b",
            "--dtype",
            "bf16",
            "--batch-sizes",
            "1,8,32,64",
            "--prompt-len",
            "128",
            "--new-tokens",
            "128",
            "--repeats",
            "5",
            "--modes",
            "hf-eager,graphcap-graph",
            "--peak-bandwidth",
            "4.8TB/s",
            "--rl-loop",
            "3",
            "--json",
            "out.json",
        ]
    )
    config = command.config_from_args(args)
    assert config.batch_sizes == [1, 8, 32, 64]
    assert config.modes == ["hf-eager", "graphcap-graph"]
    assert config.peak_bandwidth == pytest.approx(4.8e12)
    assert config.rl_loop == 3
    assert parse_modes("graphcap-graph, hf-eager") == ["graphcap-graph", "hf-eager"]
    assert set(MODES) <= set(parse_modes(",".join(MODES)))
    for bad in (["--batch-sizes", "1,x"], ["--batch-sizes", "0"], ["--modes", "turbo"]):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)


def test_run_writes_json_and_prints_table(tmp_path: Any, capsys: Any) -> None:
    out = tmp_path / "r" / "bench.json"
    args = parser().parse_args(
        [
            "--model",
            "tiny-llama",
            "--batch-sizes",
            "1",
            "--prompt-len",
            "4",
            "--new-tokens",
            "3",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--quiet",
            "--modes",
            "graphcap-eager,graphcap-graph",
            "--json",
            str(out),
        ]
    )
    assert command.run(args) == 0
    assert "graphcap-graph" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"][1]["captures"] == 1


def test_bad_config_is_a_clear_error_not_a_traceback(capsys: Any) -> None:
    args = parser().parse_args(["--model", "no-such-model", "--quiet"])
    assert command.run(args) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_running(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    monkeypatch.setattr(command, "run_benchmark", lambda *a, **k: pytest.fail("ran anyway"))
    args = parser().parse_args(["--plot", "out.png", "--quiet"])
    assert command.run(args) == 2
    assert "pip install" in capsys.readouterr().err


def test_plot_writes_png_when_matplotlib_is_installed(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    report = run_benchmark(
        BenchConfig(model="tiny-llama", batch_sizes=[1, 2], modes=["graphcap-eager"], **SMALL),
        backend=CPUBackend(),
    )
    saved = report.write_json(tmp_path / "r.json")
    assert plot.main([str(saved), str(tmp_path / "tps.png")]) == 0
    assert (tmp_path / "tps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_saved_report_round_trips(tmp_path: Any, backend: CPUBackend) -> None:
    report = run_benchmark(
        BenchConfig(
            model="tiny-llama", batch_sizes=[1], modes=["graphcap-graph"], rl_loop=1, **SMALL
        ),
        backend=backend,
    )
    loaded = load_report(report.write_json(tmp_path / "r.json"))
    assert loaded == report
    assert [r.captures_final for r in loaded.rl_loop] == [0, 1]


def test_graph_compiled_mode_compiles_only_decode_and_restores_forward(
    backend: CPUBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inductor cannot run inside the CPU reference graph, so torch.compile is replaced by a
    # recorder: this checks the mode's plumbing (decode routed to the compiled callable, prefill
    # eager, forward restored), not compilation itself.
    seen: list[int] = []

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        assert kwargs == {"dynamic": False}

        def compiled(*args: Any, **kw: Any) -> Any:
            seen.append(kw["input_ids"].shape[-1])
            return fn(*args, **kw)

        return compiled

    monkeypatch.setattr(modes.torch, "compile", fake_compile)
    model = presets.build_model("tiny-llama", dtype=torch.float32, device=CPU)
    ids, mask = make_prompts(model.config.vocab_size, 1, 4, seed=0, device=CPU)
    mode = modes.GraphcapGraphCompiled()
    mode.open(Workload(model, backend, ids, mask, new_tokens=4))
    assert "logits_to_keep" in inspect.signature(model.forward).parameters
    try:
        out = mode()
    finally:
        mode.close()
    assert out.path == "static_graph" and out.captures == 1
    assert seen and set(seen) == {1}  # only single-token (decode) calls were compiled
    assert "forward" not in vars(model)
