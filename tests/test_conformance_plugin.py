"""The conformance pytest plugin (graphcap.testing), run as a backend author runs it.

The suite runs in-process through pytester (the plugin loaded explicitly, the backend chosen
through GRAPHCAP_BACKEND); one subprocess checks the documented command from a bare directory.
Deliberately broken backends, installed through a real ``graphcap`` entry point on sys.path,
show that the checks catch what they claim to catch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

# pytester's in-process runs drop modules first imported inside them, which breaks transformers'
# lazily loaded model modules on the next run: load what the decode check uses up front.
import transformers.models.gpt2.modeling_gpt2
import transformers.models.llama.modeling_llama  # noqa: F401

from graphcap.registry import discover

pytest_plugins = ["pytester"]

GRAPH_CHECKS = (
    "graph_semantics::test_capture_records_without_executing",
    "graph_semantics::test_replay_reexecutes_on_same_memory",
    "graph_semantics::test_replays_accumulate",
    "decode_step::test_engine_decode_step_replays_give_eager_tokens[llama-greedy]",
    "engine::test_static_graph_equals_eager_one_capture[gpt2-greedy]",
)

# Backends a careless vendor might write, offered by a fake installed distribution. Each one but
# eager-only (the control) is broken in one way the suite must catch.
BROKEN_PLUGIN = '''
import contextlib

import torch

from graphcap import PLUGIN_API_VERSION, Backend, hookimpl
from graphcap.cpu.backend import CPUBackend
from graphcap.cpu.torch_internals import TorchDispatchMode


class NoOpGraph:
    """What DeepSpeed's CPU and NPU accelerators had: capture runs eagerly, replay does nothing."""


class NoOpGraphBackend(Backend):
    name = "noop-graph"
    priority = -20
    graph_capture = True
    rng_in_graph = True

    def create_graph(self):
        return NoOpGraph()

    def capture_to_graph(self, graph, pool=None, stream=None, capture_error_mode=None):
        return contextlib.nullcontext()

    def replay_graph(self, graph):
        pass


class EagerOnlyBackend(Backend):
    """Cannot capture and says so: graph checks do not apply."""

    name = "eager-only"
    priority = -20
    graph_capture = False


class SilentEagerBackend(Backend):
    """Says it cannot capture, yet its capture hook silently runs the work."""

    name = "silent-eager"
    priority = -20
    graph_capture = False

    def capture_to_graph(self, graph, pool=None, stream=None, capture_error_mode=None):
        return contextlib.nullcontext()


class RegressedCaptureBackend(CPUBackend):
    """Declares graphs, but create_graph() regressed to None."""

    name = "regressed-capture"
    priority = -20

    def create_graph(self):
        return None


class UndeclaredBackend(CPUBackend):
    """Captures, but never says whether it does."""

    name = "undeclared"
    priority = -20
    graph_capture = None


class MisdeclaredBackend(CPUBackend):
    """Says it cannot capture, yet hands out graphs."""

    name = "misdeclared"
    priority = -20
    graph_capture = False


class StopsAfterEightBackend(CPUBackend):
    """Each graph replays 8 times, then silently does nothing (a counter that ran out)."""

    name = "stops-after-8"
    priority = -20

    def __init__(self, index=None):
        super().__init__(index)
        self.replays = {}

    def replay_graph(self, graph):
        self.replays[id(graph)] = self.replays.get(id(graph), 0) + 1
        if self.replays[id(graph)] <= 8:
            graph.replay()


class _ExplicitGenerators(TorchDispatchMode):
    def __init__(self, found):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in [*args, *kwargs.values()]:
            if isinstance(value, torch.Generator) and value is not torch.default_generator:
                self.found.setdefault(id(value), (value, value.get_state()))
        return func(*args, **kwargs)


class FrozenGeneratorBackend(CPUBackend):
    """Replays put explicit generators back to their state at capture: every replay draws the
    same numbers, whatever the caller seeds."""

    name = "frozen-generator"
    priority = -20

    def __init__(self, index=None):
        super().__init__(index)
        self.frozen = {}

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None, capture_error_mode=None):
        found = self.frozen.setdefault(id(graph), {})
        with graph.capture(), _ExplicitGenerators(found):
            yield

    def replay_graph(self, graph):
        for generator, state in self.frozen.get(id(graph), {}).values():
            generator.set_state(state)
        graph.replay()


class FrozenDefaultRNGBackend(CPUBackend):
    """Declares rng_in_graph, but each replay starts from the generator state at capture."""

    name = "frozen-default-rng"
    priority = -20

    def __init__(self, index=None):
        super().__init__(index)
        self.states = {}

    def capture_to_graph(self, graph, pool=None, stream=None, capture_error_mode=None):
        self.states[id(graph)] = torch.get_rng_state()
        return graph.capture()

    def replay_graph(self, graph):
        torch.set_rng_state(self.states[id(graph)])
        graph.replay()


class CaptureLeftOpenBackend(CPUBackend):
    """Reports a capture in progress until a capture ends without error."""

    name = "capture-left-open"
    priority = -20
    open = False

    @contextlib.contextmanager
    def capture_to_graph(self, graph, pool=None, stream=None, capture_error_mode=None):
        self.open = True
        with graph.capture():
            yield
        self.open = False

    def is_current_stream_capturing(self):
        return self.open or super().is_current_stream_capturing()


class RNGOffBackend(CPUBackend):
    """Sound, but declares rng_in_graph=False: the engine must keep sampling out of graphs."""

    name = "rng-off"
    priority = -20
    rng_in_graph = False


class OffsetProductBackend(CPUBackend):
    """Offers a one-row product that reads a weight from its storage's start: wrong for a row
    slice of a joined buffer (fuse_projections' q/k/v members)."""

    name = "offset-product"
    priority = -20

    def one_row_product(self):
        def product(x, weight, bias=None):
            whole = torch.as_strided(weight, weight.shape, weight.stride(), 0)
            return torch.nn.functional.linear(x, whole, bias)

        return product


class SoundProductBackend(CPUBackend):
    """Offers a correct one-row product (the control)."""

    name = "sound-product"
    priority = -20

    def one_row_product(self):
        return lambda x, weight, bias=None: torch.nn.functional.linear(x, weight, bias)


BACKENDS = [
    OffsetProductBackend,
    SoundProductBackend,
    RNGOffBackend,
    NoOpGraphBackend,
    EagerOnlyBackend,
    SilentEagerBackend,
    RegressedCaptureBackend,
    UndeclaredBackend,
    MisdeclaredBackend,
    StopsAfterEightBackend,
    FrozenGeneratorBackend,
    FrozenDefaultRNGBackend,
    CaptureLeftOpenBackend,
]


@hookimpl
def graphcap_api_version():
    return PLUGIN_API_VERSION


@hookimpl
def graphcap_backends():
    return BACKENDS
'''


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that, on PYTHONPATH, looks like an installed plugin distribution."""
    site = tmp_path_factory.mktemp("site")
    (site / "graphcap_broken_backends.py").write_text(textwrap.dedent(BROKEN_PLUGIN))
    dist_info = site / "graphcap_broken_backends-0.0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: graphcap-broken-backends\nVersion: 0.0.1\n"
    )
    (dist_info / "entry_points.txt").write_text("[graphcap]\nbroken = graphcap_broken_backends\n")
    return site


@pytest.fixture
def with_broken_plugins(broken_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The broken backends installed for one test; the registry forgets them afterwards."""
    monkeypatch.syspath_prepend(str(broken_site))
    discover(refresh=True)
    yield
    monkeypatch.undo()
    discover(refresh=True)


def run_suite(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, backend: str, *args: str
) -> tuple[pytest.RunResult, dict[str, Any] | None]:
    monkeypatch.setenv("GRAPHCAP_BACKEND", backend)
    result = pytester.runpytest_inprocess(
        "-p", "graphcap.testing", "--pyargs", "graphcap.testing.conformance", *args
    )
    json_path = pytester.path / f"conformance-{backend}.json"
    record = json.loads(json_path.read_text()) if json_path.exists() else None
    return result, record


def outcomes(record: dict[str, Any]) -> dict[str, str]:
    return {check["check"]: check["outcome"] for check in record["checks"]}


def test_cpu_passes_with_table_and_json(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, record = run_suite(pytester, monkeypatch, "cpu")
    out = result.stdout.str()
    assert result.ret == 0, out
    assert "graphcap conformance: backend 'cpu'" in out
    assert "rng_in_graph" in out and "capture_needs_side_stream" in out
    assert record is not None, "no conformance-cpu.json written"
    assert record["backend"]["name"] == "cpu" and record["backend"]["selected"]
    assert record["backend"]["capabilities"]["graph_capture"] is True
    assert record["device"]["device"] == "cpu"
    versions = record["versions"]
    assert versions["torch"] and versions["transformers"] and versions["graphcap"]
    assert versions["plugin"].startswith("graphcap ")
    datetime.fromisoformat(record["date"])
    results = outcomes(record)
    assert record["summary"]["failed"] == 0 and record["summary"]["error"] == 0
    assert all(results[check] == "passed" for check in GRAPH_CHECKS)
    assert "rng::test_replays_draw_what_eager_steps_draw" in results
    # Only checks of what the CPU backend does not declare or offer are skipped, saying why.
    skipped = {c["check"]: c["reason"] for c in record["checks"] if c["outcome"] == "skipped"}
    assert set(skipped) == {
        "contract::test_graph_hooks_refuse_without_capture",
        "capabilities::test_graph_attention_is_offered",
        "capabilities::test_one_row_product_matches_linear",
        "capabilities::test_truncated_draw_matches_the_reference",
        "capabilities::test_offered_attention_matches_sdpa[gpt2]",
        "capabilities::test_offered_attention_matches_sdpa[llama]",
        "kv_blocks::test_host_lengths_reach_the_backend_before_every_replay",
    }
    assert all(skipped.values())
    for check in results:  # the table lists every check
        assert check in out


def test_unselectable_backend_fails_unless_allowed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, _ = run_suite(pytester, monkeypatch, "no-such-backend", "-k", "identity")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(["*backend cannot be selected*--graphcap-allow-unavailable*"])


def test_allow_unavailable_skips_every_check_with_reason(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, record = run_suite(
        pytester,
        monkeypatch,
        "no-such-backend",
        "--graphcap-allow-unavailable",
        "--graphcap-json",
        "out/result.json",
    )
    assert result.ret == 0, result.stdout.str()
    assert record is None  # written where asked, not to the default path
    record = json.loads((pytester.path / "out" / "result.json").read_text())
    assert record["backend"]["selected"] is False
    assert record["backend"]["name"] == "no-such-backend"
    assert "no installed plugin provides it" in record["backend"]["reason"]
    assert record["device"] is None
    assert len(record["checks"]) >= 20
    for check in record["checks"]:
        assert check["outcome"] == "skipped", check
        assert "'no-such-backend' cannot be used" in check["reason"]
    result.stdout.fnmatch_lines(
        ["NOT SELECTED*no-such-backend*", "Installed backends:", "skipped (--graphcap-allow*"]
    )


@pytest.mark.usefixtures("with_broken_plugins")
def test_noop_graph_backend_fails_the_graph_checks(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, record = run_suite(pytester, monkeypatch, "noop-graph")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    assert record is not None
    assert record["versions"]["plugin"] == "graphcap-broken-backends 0.0.1"
    results = outcomes(record)
    assert all(results[check] == "failed" for check in GRAPH_CHECKS), results
    assert results["contract::test_identity"] == "passed"


@pytest.mark.usefixtures("with_broken_plugins")
def test_backend_without_graphs_reports_no_graphs(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, record = run_suite(pytester, monkeypatch, "eager-only")
    assert result.ret == 0, result.stdout.str()
    assert record is not None
    assert record["backend"]["declares_graphs"] is False
    results = outcomes(record)
    assert results["contract::test_graph_hooks_refuse_without_capture"] == "passed"
    assert results["contract::test_declared_graph_capture_matches_behaviour"] == "passed"
    for check in record["checks"]:
        if check["check"].split("::")[0] in ("graph_semantics", "rng", "decode_step", "engine"):
            assert check["outcome"] == "no graphs", check
            assert "does not capture graphs" in check["reason"]
    assert record["summary"]["no graphs"] >= 15


#: Planted backend -> (checks to run, checks that must fail or error).
PLANTS = {
    "regressed-capture": (
        "contract or graph_semantics",
        [
            "contract::test_declared_graph_capture_matches_behaviour",
            "graph_semantics::test_replays_accumulate",
        ],
    ),
    "undeclared": ("contract", ["contract::test_declared_graph_capture_matches_behaviour"]),
    "misdeclared": ("contract", ["contract::test_declared_graph_capture_matches_behaviour"]),
    "stops-after-8": ("test_replays_accumulate", ["graph_semantics::test_replays_accumulate"]),
    "frozen-generator": ("rng", ["rng::test_explicit_generator_replays_draw_what_eager_draws"]),
    "frozen-default-rng": ("rng", ["rng::test_replays_draw_what_eager_steps_draw"]),
    "offset-product": ("one_row", ["capabilities::test_one_row_product_matches_linear"]),
    "capture-left-open": (
        "capture_errors and item",
        ["capture_errors::test_host_sync_inside_capture_fails_loudly[item]"],
    ),
}


@pytest.mark.parametrize("backend", list(PLANTS))
@pytest.mark.usefixtures("with_broken_plugins")
def test_planted_broken_backend_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    selection, must_fail = PLANTS[backend]
    result, record = run_suite(pytester, monkeypatch, backend, "-k", selection)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    assert record is not None
    results = outcomes(record)
    for check in must_fail:
        assert results[check] in ("failed", "error"), (check, results)


@pytest.mark.usefixtures("with_broken_plugins")
def test_a_sound_one_row_product_passes_its_check(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, record = run_suite(pytester, monkeypatch, "sound-product", "-k", "one_row")
    assert record is not None
    assert outcomes(record) == {"capabilities::test_one_row_product_matches_linear": "passed"}
    assert result.ret == 0


@pytest.mark.usefixtures("with_broken_plugins")
def test_rng_in_graph_false_is_honoured_by_the_engine(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, record = run_suite(
        pytester, monkeypatch, "rng-off", "-k", "static_graph_equals_eager and gpt2-sampled"
    )
    assert record is not None
    assert set(outcomes(record).values()) == {"passed"}, outcomes(record)
    assert result.ret == 0


@pytest.mark.usefixtures("with_broken_plugins")
def test_silently_eager_capture_hook_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, record = run_suite(pytester, monkeypatch, "silent-eager", "-k", "contract")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert record is not None
    assert outcomes(record)["contract::test_graph_hooks_refuse_without_capture"] == "failed"


def test_documented_commands_from_a_bare_directory(tmp_path: Path) -> None:
    """`python -m graphcap.testing` works from anywhere; without the plugin the checks refuse."""
    env = {**os.environ, "GRAPHCAP_BACKEND": "cpu"}
    run = {"cwd": tmp_path, "env": env, "capture_output": True, "text": True, "timeout": 300}
    select = ["-p", "no:cacheprovider", "-q", "-k", "test_identity"]
    proc = subprocess.run([sys.executable, "-m", "graphcap.testing", *select], **run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "contract::test_identity" in proc.stdout
    assert (tmp_path / "conformance-cpu.json").exists()
    bare = [sys.executable, "-m", "pytest", "--pyargs", "graphcap.testing.conformance", *select]
    without_plugin = subprocess.run(bare, **run)
    assert without_plugin.returncode == pytest.ExitCode.USAGE_ERROR
    assert "need their plugin" in without_plugin.stdout + without_plugin.stderr
