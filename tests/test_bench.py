"""graphcap bench: structure, bookkeeping and invariants (never timing values).

The runs use the tiny presets with a handful of tokens on the CPU reference backend, so they
check what the bench reports (statuses, captures, agreement, spreads, JSON), not how fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from graphcap import preset_models
from graphcap.bench import command, config, models, modes, report, run
from graphcap.bench.config import BenchConfig, resolve
from graphcap.bench.modes import MODES, Workload, default_modes, parse_modes
from graphcap.bench.report import ModeResult
from graphcap.bench.run import fill_ratios, run_benchmark, token_agreement
from graphcap.cpu.backend import CPUBackend

CPU = torch.device("cpu")
#: A few tokens are enough to exercise every path; timings are never asserted.
SMALL = {"model": "tiny-llama", "prompt_len": 4, "new_tokens": 3, "repeats": 2, "warmup": 0}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    # Tiny models gain nothing from intra-op threads; on a busy 2-core machine two threads per
    # process make these runs several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def backend() -> CPUBackend:
    return CPUBackend()


def tiny(batch: int = 1, backend: Any = None, new_tokens: int = 4) -> Workload:
    model = preset_models.build_model("tiny-llama", dtype=torch.float32, device=CPU)
    ids, mask = models.make_prompts(model.config.vocab_size, batch, 4, seed=0, device=CPU)
    return Workload(model, backend or CPUBackend(), ids, mask, new_tokens)


class NoGraphBackend(CPUBackend):
    """A backend that cannot capture: graph modes must be refused, never faked."""

    name = "no-graph"

    def create_graph(self) -> None:
        return None


class FailingCaptureBackend(CPUBackend):
    """Hands out graphs, but every capture fails: the engine must finish eagerly."""

    name = "failing-capture"

    def capture_to_graph(self, graph: Any, **kwargs: Any) -> Any:
        raise RuntimeError("capture exploded")


class MemoryReportingBackend(CPUBackend):
    """Reports device memory like an accelerator, from a scripted allocator."""

    name = "memory-reporting"

    def memory_allocated(self) -> int:
        return 1000

    def max_memory_allocated(self) -> int:
        return 5000

    def reset_peak_memory_stats(self) -> None:
        pass


# ---- models and the roofline ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_tiny_presets_build_in_eval_mode_without_eos(name: str) -> None:
    model = preset_models.build_model(name, dtype=torch.float32, device=CPU)
    assert not model.training and model.generation_config.eos_token_id is None
    assert model.generation_config.pad_token_id == 0
    assert models.describe_model(model)["parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "billions", "tied"),
    [("gpt2-medium", 0.355, True), ("llama-1b", 1.236, True), ("llama-8b", 8.030, False)],
)
def test_large_presets_have_the_real_checkpoint_shapes(
    name: str, billions: float, tied: bool
) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_models.preset_config(name))
    assert models.describe_model(model)["parameters"] == pytest.approx(billions * 1e9, rel=0.01)
    assert bool(model.config.tie_word_embeddings) is tied


def test_preset_outputs_are_varied_and_local_directories_load(tmp_path: Any) -> None:
    work = tiny(batch=2)
    out = work.model.generate(work.input_ids, max_new_tokens=24, disable_compile=True)[:, 4:]
    # Degenerate (one repeated token) output would make token agreement vacuous.
    assert out.shape == (2, 24) and all(len(set(row.tolist())) >= 8 for row in out)
    work.model.save_pretrained(tmp_path)
    loaded = preset_models.build_model(str(tmp_path), dtype=torch.float32, device=CPU)
    assert torch.equal(loaded.lm_head.weight, work.model.lm_head.weight)
    shapes = preset_models.build_model(
        str(tmp_path), dtype=torch.float32, device=torch.device("meta")
    )
    assert models.describe_model(shapes) == models.describe_model(loaded)
    assert models.weight_bytes_per_step(shapes) == models.weight_bytes_per_step(loaded)
    with pytest.raises(ValueError, match="neither a preset"):
        preset_models.build_model(str(tmp_path / "missing"), dtype=torch.float32, device=CPU)


def test_default_dtypes_weight_bytes_and_peak_bandwidth() -> None:
    assert preset_models.default_dtype_name("llama-8b", "cpu") == "fp32"
    assert preset_models.default_dtype_name("gpt2-medium", "cuda") == "fp16"
    assert preset_models.default_dtype_name("llama-1b", "cuda") == "bf16"
    llama = tiny().model  # untied: the input embedding is a lookup table, not read whole
    embed = llama.get_input_embeddings().weight.numel() * 4
    assert (
        models.weight_bytes_per_step(llama)
        == sum(p.numel() * 4 for p in llama.parameters()) - embed
    )
    gpt2 = preset_models.build_model(
        "tiny-gpt2", dtype=torch.float16, device=CPU
    )  # wte tied: counted once
    positions = gpt2.transformer.wpe.weight.numel() * 2
    assert (
        models.weight_bytes_per_step(gpt2)
        == sum(p.numel() * 2 for p in gpt2.parameters()) - positions
    )
    assert models.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert models.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert models.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert models.peak_bandwidth("Some Future GPU") is None
    assert models.peak_bandwidth("NVIDIA H200", override=1e12) == 1e12
    assert models.parse_bandwidth("4.8TB/s") == pytest.approx(4.8e12)
    assert models.parse_bandwidth("3350GB/s") == pytest.approx(3.35e12)
    with pytest.raises(ValueError, match="cannot read bandwidth"):
        models.parse_bandwidth("fast")


# ---- timing and bookkeeping -------------------------------------------------------------------
def test_step_clock_reports_prefill_and_median_step(monkeypatch: pytest.MonkeyPatch) -> None:
    times = iter([10.0, 10.5, 10.6, 10.8, 10.9])
    monkeypatch.setattr(modes.time, "perf_counter", lambda: next(times))
    clock = modes.StepClock(sync=lambda: None)

    class Model:
        def generate(self, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            for _ in range(4):
                assert not kwargs["stopping_criteria"][0](ids, None).any()
            return torch.zeros((3, 6), dtype=torch.long)

    work = Workload(Model(), CPUBackend(), torch.zeros((3, 2), dtype=torch.long), None, 4)  # type: ignore[arg-type]
    out = clock.generate(work)
    assert out.prefill_s == pytest.approx(0.5) and out.decode_step_s == pytest.approx(0.1)
    assert out.tokens.shape == (3, 4) and out.stats is None


def test_spread_agreement_and_ratios() -> None:
    assert modes.spread([3.0, None, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert modes.spread([None]) == (None, None, None)
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    other = ref.clone()
    other[0] = 0
    assert token_agreement(ref.clone(), ref) == 1.0 and token_agreement(other, ref) == 0.5
    assert token_agreement(ref[:, :2], ref) is None
    results = [
        ModeResult("hf-eager", 1, steady_median_s=4.0),
        ModeResult("hf-static-compile", 1, steady_median_s=2.0, recompiles_steady=0),
        ModeResult("graphcap-graph", 1, steady_median_s=1.0),
        ModeResult("hf-eager", 8, steady_median_s=8.0),
        ModeResult("hf-static-compile", 8, steady_median_s=1.0, recompiles_steady=3),
        ModeResult("graphcap-graph", 8, steady_median_s=2.0),
    ]
    fill_ratios(results)
    assert (results[2].speedup_vs_hf_eager, results[2].speedup_vs_hf_static_compile) == (4.0, 2.0)
    assert results[5].speedup_vs_hf_eager == 4.0
    assert results[5].speedup_vs_hf_static_compile is None  # that baseline recompiled


# ---- whole runs on the CPU reference backend --------------------------------------------------
def test_run_reports_every_mode_with_spreads_progress_and_json(
    backend: CPUBackend, tmp_path: Any
) -> None:
    lines: list[str] = []
    names = [m for m in MODES if m not in ("hf-static-compile", "graphcap-drop-in")]
    result = run_benchmark(
        BenchConfig(batch_sizes=[1, 2], modes=names, **SMALL),
        backend=backend,
        progress=lines.append,
    )
    assert result.reference_mode == "graphcap-eager" and len(result.results) == 12
    pairs = [line for line in lines if " left] " in line]
    assert pairs[0].startswith("[1/12, 11 left]") and pairs[-1].startswith("[12/12, 0 left]")
    expected = {
        "graphcap-graph": ("static_graph", 1),
        "graphcap-graph-uncompiled": ("static_graph", 1),
        "graphcap-continuous": ("continuous_graph", 1),
    }
    expected["graphcap-per-position"] = ("per_position_graph", SMALL["new_tokens"] - 1)
    for bs in (1, 2):
        for name, (path, captures) in expected.items():
            r = result.result(name, bs)
            assert r.status == "ok", r.reason
            assert (r.path, r.captures) == (path, captures)
            assert r.tokens_identical and r.first_call_tokens_identical
            assert r.first_call_s > 0 and len(r.steady_s) == SMALL["repeats"]
            assert r.steady_min_s <= r.steady_median_s <= r.steady_max_s
            assert r.decode_step_min_s <= r.decode_step_s <= r.decode_step_max_s
            assert r.speedup_vs_hf_eager is not None and r.peak_memory_bytes is None
        assert result.result("graphcap-graph", bs).replays_per_call == SMALL["new_tokens"] - 1
        assert 0 < result.result("graphcap-continuous", bs).occupancy <= 1
        assert result.result("hf-eager", bs).tokens_identical
        assert (
            result.result("hf-eager", bs).path == "hf"
            and result.result("hf-eager", bs).captures is None
        )
        assert result.result("graphcap-eager", bs).captures == 0
    data = json.loads(result.write_json(tmp_path / "r" / "bench.json").read_text())
    assert data["schema_version"] == 7 and data["config"]["dtype"] == "fp32"
    for r in result.results:  # graphcap's graph modes say where their first call went
        if r.mode.startswith("graphcap-") and r.path != "eager":
            phases = r.first_call_phases
            assert set(phases) == set(report.PHASES), (r.mode, phases)
            assert phases["warmup_s"] > 0 and phases["capture_s"] > 0, (r.mode, phases)
            assert phases["compile_s"] == 0.0  # the CPU reference backend compiles nothing
            assert sum(phases.values()) == pytest.approx(r.first_call_s, rel=1e-6)
            assert r.compiled is False and r.compile_cache is None
    assert data["peak_bandwidth_gbps"] is None  # no roofline on the host without --peak-bandwidth
    assert {f.name for f in dataclasses.fields(ModeResult)} == set(data["results"][0])
    table = report.format_table(result)
    assert "steady ms [min-max]" in table and "first calls (s): prefill + compile + warmup" in table
    # what the figures are not: speed on the CPU, a ratio without its baseline, a known peak
    assert (
        report.CPU_REFERENCE in table
        and "peak bandwidth n/a (unknown device: give --peak-" in table
    )
    assert "note: x hf-static is n/a: hf-static-compile did not run" in table
    graph = result.result("graphcap-graph", 1)
    assert f"{graph.steady_median_s * 1e3:.1f} [{graph.steady_min_s * 1e3:.1f}-" in table


def test_memory_and_roofline_figures_reach_the_report() -> None:
    cfg = BenchConfig(batch_sizes=[1], modes=["graphcap-graph"], peak_bandwidth=50e9, **SMALL)
    result = run_benchmark(cfg, backend=MemoryReportingBackend())
    graph = result.result("graphcap-graph", 1)
    assert graph.peak_memory_bytes == 5000 and graph.engine_memory_bytes == 0
    assert result.peak_bandwidth_gbps == 50.0
    achieved = result.weight_bytes_per_step / graph.decode_step_s
    assert graph.weight_bandwidth_gbps == pytest.approx(achieved / 1e9)
    assert graph.bandwidth_fraction == pytest.approx(achieved / 50e9)


def test_continuous_mode_queues_rows_through_fewer_slots(backend: CPUBackend) -> None:
    cfg = BenchConfig(
        batch_sizes=[5],
        modes=["graphcap-eager", "graphcap-continuous"],
        continuous_slots=2,
        **SMALL,
    )
    result = run_benchmark(cfg, backend=backend)
    continuous = result.result("graphcap-continuous", 5)
    assert continuous.status == "ok" and continuous.tokens_identical, continuous.reason
    # 5 rows through 2 slots take three waves of decode steps, not one.
    assert continuous.replays_per_call > 2 * (SMALL["new_tokens"] - 1)
    assert result.config["continuous_slots"] == 2


def test_graph_modes_are_refused_on_a_backend_without_graphs() -> None:
    names = ["graphcap-eager", "graphcap-graph", "graphcap-continuous"]
    result = run_benchmark(
        BenchConfig(batch_sizes=[1], modes=names, threads=2, **SMALL), backend=NoGraphBackend()
    )
    assert torch.get_num_threads() == 1 and result.config["threads"] == 2  # restored after
    for name in names[1:]:
        r = result.result(name, 1)
        assert r.status == "unsupported" and "cannot capture" in r.reason and r.tokens_per_s is None


def test_graph_mode_that_ran_eagerly_is_a_fallback_not_a_graph_result() -> None:
    cfg = BenchConfig(batch_sizes=[1], modes=["graphcap-eager", "graphcap-graph"], **SMALL)
    with pytest.warns(RuntimeWarning, match="capture exploded"):
        result = run_benchmark(cfg, backend=FailingCaptureBackend())
    graph = result.result("graphcap-graph", 1)
    assert graph.status == "fallback" and "capture exploded" in graph.reason
    assert graph.path == "eager" and graph.captures == 0
    assert graph.tokens_identical  # the eager completion still gives the reference tokens
    assert "[fallback]" in report.format_table(result)


def test_static_compile_that_compiled_nothing_and_compile_limits_and_budget(
    backend: CPUBackend,
) -> None:
    # transformers compiles static-cache decode only on some accelerators, not on the CPU.
    modes_ = ["hf-static-compile", "graphcap-eager"]
    cfg = BenchConfig(
        batch_sizes=[1, 2], compile_batch_sizes=[2], modes=modes_, **{**SMALL, "model": "tiny-gpt2"}
    )
    result = run_benchmark(cfg, backend=backend)
    assert [(r.mode, r.batch_size) for r in result.results] == [
        ("graphcap-eager", 1), ("hf-static-compile", 2), ("graphcap-eager", 2)
    ]  # fmt: skip
    static = result.result("hf-static-compile", 2)
    assert static.status == "fallback" and static.compiled_graphs_first_call == 0
    assert "compiled nothing" in static.reason
    table = report.format_table(result)
    assert "x hf-static is n/a where hf-static-compile did not finish" in table
    spent = run_benchmark(replace(cfg, budget_s=1e-9), backend=backend)
    assert {r.status for r in spent.results} == {"skipped"} and "budget" in spent.results[0].reason


def test_isolated_pairs_run_in_fresh_processes_and_fill_the_same_report(
    backend: CPUBackend,
) -> None:
    lines: list[str] = []
    names = ["graphcap-eager", "graphcap-graph"]
    cfg = BenchConfig(batch_sizes=[1], modes=names, isolate=True, **{**SMALL, "repeats": 1})
    result = run_benchmark(cfg, backend=backend, progress=lines.append)
    assert [(r.mode, r.batch_size) for r in result.results] == [(n, 1) for n in names]
    for r in result.results:
        assert r.status == "ok" and r.first_call_s > 0 and len(r.steady_s) == 1, r.reason
        assert r.decode_step_s > 0 and r.weight_bandwidth_gbps > 0
        # The tokens came back from the children: fp32 graph replay equals the eager reference.
        assert r.tokens_identical and r.first_call_tokens_identical and r.distinct_tokens
    assert result.result("graphcap-graph", 1).captures == 1
    # Each child builds its own model and reports its calls; the parent describes the model
    # after them from one built on the meta device (no weights).
    builds = [i for i, line in enumerate(lines) if line.startswith("building ")]
    pairs = [i for i, line in enumerate(lines) if " left] bs 1: " in line]
    assert len(builds) == 3 and pairs[0] < builds[0] < pairs[1] < builds[1] < builds[2]
    assert lines[builds[2]].endswith(" on meta") and "on meta" not in lines[builds[0]]
    assert result.model["parameters"] > 0 and result.weight_bytes_per_step > 0
    assert any(line.startswith("  steady 1: ") for line in lines)
    assert result.config["isolate"] and "a fresh process per mode" in report.format_table(result)


def test_a_failed_child_gives_its_pair_an_error_with_its_last_lines() -> None:
    # The child looks the backend up by name: one only the parent has cannot be found there.
    cfg = BenchConfig(batch_sizes=[1], modes=["graphcap-eager"], isolate=True, **SMALL)
    (r,) = run_benchmark(cfg, backend=NoGraphBackend()).results
    assert r.status == "error" and r.reason.startswith("child process exited with status 1")
    assert "BackendSelectionError" in r.reason and "'no-graph'" in r.reason


@pytest.mark.parametrize(("optimizer", "lr"), [("sgd", 1e-2), ("adamw", 1e-3)])
def test_rl_loop_keeps_one_capture_across_in_place_updates(optimizer: str, lr: float) -> None:
    work = tiny(batch=2)
    before = {n: p.data_ptr() for n, p in work.model.named_parameters()}
    weight = work.model.lm_head.weight.clone()
    (eager, graph), warnings = _script("rl_loop").run_rl_loop(
        work, iterations=3, optimizer=optimizer, lr=lr
    )
    assert (eager.mode, graph.mode) == ("graphcap-eager", "graphcap-graph") and warnings == []
    assert graph.captures_final == 1 and eager.captures_final == 0
    assert [it.captures for it in graph.iterations] == [1, 1, 1]
    assert all(it.path == "static_graph" for it in graph.iterations)
    # The graph sees the updated weights: same tokens as eager on the same weights...
    assert all(it.tokens_match_eager for it in graph.iterations)
    # ...and the updates did change what the model generates.
    assert any(it.tokens_changed for it in graph.iterations[1:])
    assert not graph.parameters_reallocated and graph.steady_generate_median_s is not None
    assert {n: p.data_ptr() for n, p in work.model.named_parameters()} == before
    assert not work.model.training and not torch.equal(work.model.lm_head.weight, weight)


def test_rl_warnings_adamw_on_fp16_and_the_script(tmp_path: Any, capsys: Any) -> None:
    rl = _script("rl_loop")
    assert rl.rl_warnings([rl.RLLoopResult("graphcap-graph", 2, "sgd", captures_final=1)]) == []
    bad = rl.RLLoopResult("graphcap-graph", 2, "sgd", captures_final=3, parameters_reallocated=True)
    text = " ".join(rl.rl_warnings([bad]))
    assert "captured 3 times" in text and "reallocated" in text
    with pytest.raises(ValueError, match="fp16"):
        rl.make_optimizer("adamw", [torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))], 1e-3)
    argv = (
        f"--batch-size 2 --prompt-len 4 --new-tokens 3 --iterations 2 --json {tmp_path / 'r.json'}"
    )
    assert rl.main(argv.split()) == 0
    assert "rl-loop graphcap-graph (bs 2, sgd): captures at end 1" in capsys.readouterr().out
    data = json.loads((tmp_path / "r.json").read_text())
    assert [r["captures_final"] for r in data["results"]] == [0, 1] and data["warnings"] == []


class CompilingBackend(CPUBackend):
    """Declares that compiled captures pay, as CUDA does (the CPU graph would refuse them)."""

    captures_compiled = True
    compile_by_default = True


def test_the_graph_mode_is_the_default_config_and_compiles_where_that_pays(
    backend: CPUBackend,
) -> None:
    # graphcap-graph is RolloutConfig(enable_graph_capture=True): it compiles where the backend
    # declares that compiling pays; graphcap-graph-uncompiled is compile=False, a default mode
    # only where it differs from graphcap-graph.
    compiling = CompilingBackend()
    graph, uncompiled = MODES["graphcap-graph"], MODES["graphcap-graph-uncompiled"]
    assert graph.compiles(compiling) and not graph.compiles(backend)
    assert not uncompiled.compiles(compiling) and not MODES["graphcap-eager"].compiles(compiling)
    assert "graphcap-graph-uncompiled" in default_modes(compiling)
    assert "graphcap-graph-uncompiled" not in default_modes(backend)
    with uncompiled.session(tiny(backend=compiling)) as (call, _engine):
        out = call()
    assert out.stats.path == "static_graph" and not out.stats.compiled


# ---- configuration and command line -----------------------------------------------------------
def test_defaults_come_from_the_fields(backend: CPUBackend) -> None:
    resolved = resolve(BenchConfig(), backend)
    for f in dataclasses.fields(BenchConfig):
        if "cpu" in f.metadata:
            assert getattr(resolved, f.name) == f.metadata["cpu"]
    assert resolved.dtype == "fp32" and resolved.modes == default_modes(backend)
    assert "hf-static-compile" not in resolved.modes
    for bad, message in [
        ({"new_tokens": 1}, "new tokens"),
        ({"repeats": 0}, "repeats"),
        ({"modes": ["x"]}, "unknown mode"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve(BenchConfig(**bad), backend)


def test_every_option_is_a_config_field() -> None:
    parser = argparse.ArgumentParser()
    config.add_fields(parser, BenchConfig)
    for f in dataclasses.fields(BenchConfig):
        assert "--" + f.name.replace("_", "-") in parser.format_help()
    argv = "--model llama-8b --dtype bf16 --batch-sizes 1,8,32,64 --modes hf-eager,graphcap-graph"
    args = parser.parse_args([*argv.split(), "--peak-bandwidth", "4.8TB/s", "--repeats", "3"])
    cfg = config.from_args(BenchConfig, args)
    assert cfg.batch_sizes == [1, 8, 32, 64] and cfg.modes == ["hf-eager", "graphcap-graph"]
    assert cfg.peak_bandwidth == pytest.approx(4.8e12) and cfg.repeats == 3
    assert parse_modes("graphcap-graph, hf-eager") == ["graphcap-graph", "hf-eager"]


@pytest.mark.parametrize(
    "bad", [["--batch-sizes", "1,x"], ["--batch-sizes", "0"], ["--modes", "turbo"]]
)
def test_bad_options_are_usage_errors_that_say_why(bad: list[str], capsys: Any) -> None:
    with pytest.raises(SystemExit):
        command.main(bad)
    assert "comma-separated positive integers" in capsys.readouterr().err or "turbo" in bad


def test_command_writes_json_and_prints_table(tmp_path: Any, capsys: Any) -> None:
    out = tmp_path / "r" / "bench.json"
    argv = "--batch-sizes 1 --prompt-len 4 --new-tokens 3 --repeats 1 --warmup 0 --quiet "
    argv += f"--modes graphcap-eager,graphcap-graph --json {out}"
    assert command.main(argv.split()) == 0
    text = capsys.readouterr().out
    assert "graphcap-graph" in text
    data = json.loads(out.read_text())
    assert data["results"][1]["captures"] == 1 and "rl_loop" not in data
    assert command.main(["--model", "no-such-model", "--quiet"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_graph_attention_option_reaches_the_engine_and_is_recorded(backend: CPUBackend) -> None:
    config = BenchConfig(batch_sizes=[1], modes=["graphcap-graph"], **SMALL)
    own = run_benchmark(replace(config, graph_attention="model"), backend=backend).results[0]
    assert own.status == "ok" and own.attention == "sdpa"  # the preset's own
    typo = run_benchmark(replace(config, graph_attention="no-such"), backend=backend).results[0]
    assert typo.status == "error" and "graph_attention='no-such'" in typo.reason


def _script(name: str) -> Any:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        _script("plot_report").plot_throughput({"config": {}, "results": []}, "out.png")


def test_plot_writes_png_when_matplotlib_is_installed(tmp_path: Any, backend: CPUBackend) -> None:
    pytest.importorskip("matplotlib")
    result = run_benchmark(
        BenchConfig(batch_sizes=[1, 2], modes=["graphcap-eager"], **SMALL), backend=backend
    )
    written = _script("plot_report").plot_throughput(
        dataclasses.asdict(result), tmp_path / "tps.png"
    )
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_first_call_s_compiling_is_taken_out_of_its_warm_up() -> None:
    stats = dataclasses.make_dataclass("Stats", ["prefill_s", "warmup_s", "capture_s", "decode_s"])(
        0.2, 1.5, 1.7, 0.1
    )
    phases = report.first_call_phases(stats, 2.1, compile_s=1.2)
    assert phases["compile_s"] == 1.2 and phases["warmup_s"] == pytest.approx(0.3)
    assert phases["capture_s"] == pytest.approx(0.2)
    assert sum(phases.values()) == pytest.approx(2.1)
    # compiling counted outside the warm-up (a recapture's, a negative delta after a reset)
    # never makes the warm-up negative nor the phases exceed the call
    assert report.first_call_phases(stats, 2.1, compile_s=9.0)["warmup_s"] == 0.0
    assert report.first_call_phases(stats, 2.1, compile_s=-1.0)["compile_s"] == 0.0


def test_a_first_calls_phases_are_the_engines_own_and_the_rest_of_the_call() -> None:
    # 0.9 s of captures (0.5 of them warm-up), 0.5 s of steps: the rest of 2.2 s is other_s
    stats = dataclasses.make_dataclass("Stats", ["prefill_s", "warmup_s", "capture_s", "decode_s"])(
        0.2, 0.5, 0.9, 0.5
    )
    phases = report.first_call_phases(stats, 2.2)
    assert phases["capture_s"] == pytest.approx(0.4) and phases["warmup_s"] == 0.5
    assert phases["decode_s"] == 0.5 and phases["other_s"] == pytest.approx(0.6)
    assert sum(phases.values()) == pytest.approx(2.2)


def test_compile_seconds_counts_what_dynamo_compiles() -> None:
    before = modes.compile_counts()[2]
    compiled = torch.compile(lambda x: torch.sin(x) + 1, backend="eager", fullgraph=True)
    compiled(torch.ones(3))
    assert modes.compile_counts()[2] > before


# ---- the rl-round workload ----------------------------------------------------------------------
ROUND = {"model": "tiny-llama", "workload": "rl-round", "prompts": 2, "samples": 3}
ROUND.update(prompt_widths=[3, 6], new_tokens=8, repeats=2, hf_repeats=1, eos_fraction=0.3)


def test_round_inputs_lengths_and_limit_by_hand() -> None:
    ids, mask = models.round_prompts(100, 5, [3, 6], seed=0, device=CPU)
    widths = mask.sum(1)
    assert ids.shape == (5, int(widths.max())) and bool(((widths >= 3) & (widths <= 6)).all())
    assert bool((ids[mask == 0] == 0).all()) and bool((ids[mask == 1] > 0).all())
    assert bool((mask.cummax(1).values == mask).all())  # left-padded
    eos = models.eos_ids(8192, 16, 0.4, seed=0)
    assert len(eos) == 1280 and 0 not in eos and len(set(eos)) == 1280
    tokens = torch.tensor([[5, 7, 0, 0], [5, 5, 5, 5], [7, 7, 7, 7]])
    assert run.response_lengths(tokens, [7, 9], cap=4) == [2, 4, 1]
    assert run.dead_share([2, 4, 1]) == pytest.approx(1 - 7 / 12)
    # two rows of 3 and 1 tokens after prompts of 2 and 4: decode steps 1 and 2 serve row 0 only
    limit = models.round_limit([3, 1], [2, 4], costs=(10, 4, 2, 2, 8))
    prefill = 2 * 4 * 6 / 8
    steps = (max(5, 2 * 4 * 1 / 8) + 2 * 3 / 2) + (max(5, 1) + 2 * 4 / 2)
    assert limit == pytest.approx(prefill + steps)


def test_round_reports_useful_tokens_dead_share_and_limit(
    backend: CPUBackend, tmp_path: Any
) -> None:
    peaks = {"peak_bandwidth": 4.8e12, "peak_flops": 7.9e14, "draws": "generate"}
    result = run_benchmark(BenchConfig(**ROUND, **peaks), backend=backend)
    rows = ROUND["prompts"] * ROUND["samples"]
    assert [r.mode for r in result.results] == modes.ROUND_MODES and result.eos_ids > 0
    paths = ["hf", "static_graph", "static_graph", "continuous_graph"]
    for r, path in zip(result.results, paths, strict=True):
        assert (r.status, r.path, r.batch_size) == ("ok", path, rows), r.reason
        rounds_run = 1 + (ROUND["hf_repeats"] if r.mode == "hf-eager" else ROUND["repeats"])
        figures = r.round
        assert len(figures["lengths"]) == len(figures["limits_s"]) == rounds_run
        steady = figures["lengths"][1:]
        assert all(len(n) == rows and min(n) >= 1 and max(n) <= ROUND["new_tokens"] for n in steady)
        useful = [sum(n) for n in steady]
        assert figures["useful_tokens"] == round(statistics.median(useful))
        per_s = [u / s for u, s in zip(useful, r.steady_s, strict=True)]
        assert r.tokens_per_s == pytest.approx(statistics.median(per_s))
        dead = [1 - sum(n) / (rows * max(n)) for n in steady]  # row-steps by hand
        assert 0 <= figures["dead_share"] < 1
        assert figures["dead_share"] == pytest.approx(statistics.median(dead))
        limits = figures["limits_s"][1:]
        assert all(0 < lim < s for lim, s in zip(limits, r.steady_s, strict=True))
        assert figures["limit_s"] == statistics.median(limits) and 0 < figures["limit_fraction"] < 1
        assert r.speedup_vs_hf_eager == pytest.approx(
            result.result("hf-eager", rows).steady_median_s / r.steady_median_s
        )
    # the same seed gives every mode the same prompts and draws: the drop-in draws generate's
    hf, drop = result.result("hf-eager", rows), result.result("graphcap-drop-in", rows)
    assert hf.round["lengths"][0] == drop.round["lengths"][0]
    data = json.loads(result.write_json(tmp_path / "round.json").read_text())
    assert data["schema_version"] == 7 and data["results"][0]["round"] == hf.round
    for r in result.results[1:]:  # the ladder's graphs captured mid-decode are counted once
        assert sum(r.first_call_phases.values()) == pytest.approx(r.first_call_s, rel=1e-6)
    table = report.format_table(result)
    assert "round s [min-max]" in table and "rl-round: 2 prompts of 3-6 tokens" in table
    assert "limit: the round's physical limit at 4800 GB/s and 7.9e+14 FLOP/s" in table
    assert "x hf-static" not in table  # a round has no such column, hence no footnote
    result.peak_flops = None
    assert "limit: n/a on an unknown device (give --peak-flops)" in report.format_table(result)
    result.peak_bandwidth_gbps = None
    assert "(give --peak-bandwidth and --peak-flops)" in report.format_table(result)


def test_round_options_resolve_and_refuse(backend: CPUBackend) -> None:
    cfg = resolve(BenchConfig(workload="rl-round"), backend)
    assert cfg.batch_sizes == [16] and cfg.continuous_slots == 8 and cfg.modes == modes.ROUND_MODES
    assert (cfg.new_tokens, cfg.repeats, cfg.warmup) == (16, 2, 0)
    assert resolve(BenchConfig(), backend).new_tokens == 16  # the step workload keeps its own
    for bad, message in [
        ({"prompt_widths": [9, 3]}, "least,most"),
        ({"isolate": True}, "step workload"),
        ({"top_p": 0.0}, "top-p"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve(BenchConfig(**{**ROUND, **bad}), backend)
    settings = modes.engine_settings("model", None, "none", "per_row")
    assert settings["graph_attention"] is None and settings["compile_cache"] is None
    assert settings["draws"] == "per_row"
    assert "draws" not in modes.engine_settings("auto", None, "auto", None)


@pytest.mark.parametrize("between", ["sleep-train", "move"])
def test_round_as_a_trainer_lives_it(backend: CPUBackend, between: str) -> None:
    """``--between``: before each steady round the engine sleeps and a training step runs (or
    the weights move); the graphs of the first round serve every later one, and the report says
    what the pauses did (HF's rounds train too, with nothing to sleep)."""
    cfg = {**ROUND, "modes": ["hf-eager", "graphcap-graph", "graphcap-drop-in"], "train_rows": 4}
    result = run_benchmark(BenchConfig(**cfg, between=between), backend=backend)
    for r in result.results:
        assert r.status == "ok", r.reason
        pauses = r.round["iteration"]
        rounds = ROUND["hf_repeats"] if r.mode == "hf-eager" else ROUND["repeats"]
        assert len(pauses["rounds_s"]) == len(pauses["captured"]) == rounds
        trains = pauses["train_s"]
        assert (len(trains) > 0) == (between == "sleep-train")
        if r.mode == "hf-eager":
            assert pauses["held_bytes"] == [None] * len(trains or pauses["rounds_s"])
            continue
        # new ladder sizes may still be met; a sleep or a move itself captures nothing
        reasons = [reason for call in pauses["recapture_reasons"] for reason in call]
        assert not any("woke" in reason or "tensors" in reason for reason in reasons), reasons
        if between == "sleep-train":
            assert all(w is not None and w >= 0 for w in pauses["wake_s"])
            assert all(h > 0 for h in pauses["held_bytes"])
            assert 0 < pauses["rollout_share"] < 1
    table = report.format_table(result)
    assert "new graphs" in table and "rollout%" in table
    assert {"sleep-train": "the engine slept", "move": "moved to new storage"}[between] in table


def test_between_is_an_rl_round_option(backend: CPUBackend) -> None:
    with pytest.raises(ValueError, match="rl-round"):
        resolve(BenchConfig(between="move"), backend)
    with pytest.raises(ValueError, match="between"):
        resolve(BenchConfig(**{**ROUND, "between": "nap"}), backend)
